// pier's dashboard, shared by every tab of one browser: ONE EventSource on /ui/events for
// all of them. A browser opens at most six HTTP/1.1 connections to a host; one stream per
// tab would leave the seventh tab unable to load a page. Every event goes to every tab,
// which keeps what concerns it.

const TYPES = ["run_created", "task_created", "transition", "question", "answer", "message", "message_sent", "cancel_requested",
  "session_update", "permission", "client_call", "elicitation", "protocol_error"];
const ports = new Set();
let source = null;
let last = 0;

function start(after) {
  if (source) return;
  last = after;
  source = new EventSource(`/ui/events?follow=true&after=${after}`);
  const relay = (m) => {
    let e;
    try { e = JSON.parse(m.data); } catch { return; }
    last = Math.max(last, e.seq);
    for (const p of ports) p.postMessage(e);
  };
  for (const t of TYPES) source.addEventListener(t, relay);
  source.onmessage = relay;
  // EventSource retries a dropped connection itself (resuming by Last-Event-ID), but gives
  // up for good on an answer that is not a stream (the login page, once the session is
  // gone; a proxy's error page). Start again from the last event, and tell the tabs.
  source.onerror = () => {
    if (!source || source.readyState !== EventSource.CLOSED) return;
    source = null;
    for (const p of ports) p.postMessage({ down: true });
    setTimeout(() => { if (ports.size > 0) start(last); }, 3000);
  };
}

onconnect = (ev) => {
  const port = ev.ports[0];
  ports.add(port);
  port.onmessage = (m) => {
    if (m.data && m.data.bye) {
      ports.delete(port);
      if (ports.size === 0 && source) { source.close(); source = null; }
      return;
    }
    // Again on every hello: a tab back from the back-forward cache said bye when it left.
    ports.add(port);
    start(Number(m.data.after) || 0);
    // A tab that loaded before the stream's start catches up by re-rendering once.
    port.postMessage({ hello: true, last });
  };
  port.start();
};
