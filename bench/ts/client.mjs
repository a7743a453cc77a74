// B1/B2 client on the official TypeScript SDK: spawns the agent, counts updates of one
// prompt, then times sequential session/new round trips. Prints one JSON line.

import * as acp from "@agentclientprotocol/sdk";
import { spawn } from "node:child_process";
import { Readable, Writable } from "node:stream";

const [updates = "100000", rtts = "20000", ...cmd] = process.argv.slice(2);
const child = spawn(cmd[0], cmd.slice(1), { stdio: ["pipe", "pipe", "inherit"] });
const stream = acp.ndJsonStream(Writable.toWeb(child.stdin), Readable.toWeb(child.stdout));
let count = 0;
const result = await acp
  .client({ name: "bench-client" })
  .onNotification(acp.methods.client.session.update, () => { count++; })
  .connectWith(stream, async (ctx) => {
    await ctx.request(acp.methods.agent.initialize, { protocolVersion: acp.PROTOCOL_VERSION, clientCapabilities: {} });
    const s = await ctx.request(acp.methods.agent.session.new, { cwd: process.cwd(), mcpServers: [] });
    const t0 = process.hrtime.bigint();
    await ctx.request(acp.methods.agent.session.prompt, { sessionId: s.sessionId, prompt: [{ type: "text", text: updates }] });
    const seconds = Number(process.hrtime.bigint() - t0) / 1e9;
    const lat = [];
    for (let i = 0; i < Number(rtts); i++) {
      const t = process.hrtime.bigint();
      await ctx.request(acp.methods.agent.session.new, { cwd: process.cwd(), mcpServers: [] });
      lat.push(Number(process.hrtime.bigint() - t) / 1e3);
    }
    lat.sort((a, b) => a - b);
    return { updates: count, seconds, msgs_per_s: count / seconds, rtt_p50_us: lat[Math.floor((lat.length - 1) * 0.5)], rtt_p99_us: lat[Math.floor((lat.length - 1) * 0.99)], client_peak_rss_kb: process.resourceUsage().maxRSS };
  });
console.log(JSON.stringify(result));
child.kill();
process.exit(0);
