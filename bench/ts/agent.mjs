// B1/B2 agent on the official TypeScript SDK: answers a prompt whose text is a number N
import * as acp from "@agentclientprotocol/sdk";
import { Readable, Writable } from "node:stream";

const CHUNK = "The quick brown fox jumps over the lazy dog while the benchmark counts every single message. ok";
let sessions = 0;
const stream = acp.ndJsonStream(Writable.toWeb(process.stdout), Readable.toWeb(process.stdin));
acp
  .agent({ name: "bench-agent" })
  .onRequest("initialize", () => ({ protocolVersion: acp.PROTOCOL_VERSION, agentCapabilities: {} }))
  .onRequest("session/new", () => ({ sessionId: `s${sessions++}` }))
  .onRequest("session/prompt", async (ctx) => {
    const n = parseInt(ctx.params.prompt[0].text, 10) || 1;
    for (let i = 0; i < n; i++) {
      await ctx.client.notify(acp.methods.client.session.update, {
        sessionId: ctx.params.sessionId,
        update: { sessionUpdate: "agent_message_chunk", content: { type: "text", text: CHUNK } },
      });
    }
    return { stopReason: "end_turn" };
  })
  .connect(stream);
