// pier's dashboard: keeps a page current from the server's event stream (the API's own
// SSE, resumed exactly by sequence number). Pages render whole without this script; it
// re-renders their live regions when the store moves, and fills the event rail. The
// stream is shared by all tabs through a SharedWorker (live.js) where there is one.

const main = document.getElementById("main");
const live = main && main.dataset.live;
const run = live ? new URLSearchParams(live).get('run') : null;

// Events that change what a page shows; session updates only feed the rail.
const MOVES = new Set(["run_created", "task_created", "transition", "question", "answer", "permission", "message",
  "cancel_requested"]);
const TYPES = ["run_created", "task_created", "transition", "question", "answer", "message", "message_sent", "cancel_requested",
  "session_update", "permission", "client_call", "elicitation", "protocol_error"];

let pageSeq = Number((main && main.dataset.after) || 0);
let refreshing = false;
let again = false;

async function refresh() {
  if (refreshing) { again = true; return; }
  refreshing = true;
  try {
    const resp = await fetch(location.href, { credentials: "same-origin", headers: { accept: "text/html" } });
    // The session is gone (logged out elsewhere, expired, a restarted server): log in again.
    if (resp.redirected && new URL(resp.url).pathname === "/ui/login") { location.assign("/ui/login"); return; }
    if (!resp.ok) return;
    const doc = new DOMParser().parseFromString(await resp.text(), "text/html");
    const fresh = doc.getElementById("main");
    if (!fresh) return;
    const regions = main.querySelectorAll("[data-region]");
    if (regions.length) {
      for (const r of regions) {
        const n = fresh.querySelector(`[data-region="${r.dataset.region}"]`);
        if (n) r.replaceWith(document.importNode(n, true));
      }
    } else {
      main.replaceChildren(...Array.from(fresh.childNodes, (n) => document.importNode(n, true)));
    }
    zoomGraph();
    pageSeq = Math.max(pageSeq, Number(fresh.dataset.after || 0));
    main.dataset.after = String(pageSeq);
  } finally {
    refreshing = false;
    if (again) { again = false; setTimeout(refresh, 100); }
  }
}

let timer = null;
let stale = false;
// A form being filled in is never replaced under the person's hands: the page re-renders
// once it is sent or left.
let editing = false;
document.addEventListener("input", (ev) => { if (main && main.contains(ev.target)) editing = true; });
document.addEventListener("submit", () => { editing = false; });
document.addEventListener("focusout", () => {
  setTimeout(() => {
    if (editing && !(main && main.contains(document.activeElement) && document.activeElement.form)) {
      editing = false;
      if (stale) { stale = false; soon(0); }
    }
  }, 0);
});
function soon(delay = 150) {
  // A hidden tab re-renders when it is shown again, not for every burst it cannot show.
  if (document.hidden || editing) { stale = true; return; }
  if (timer === null) timer = setTimeout(() => { timer = null; refresh(); }, delay);
}
document.addEventListener("visibilitychange", () => {
  if (!document.hidden && stale) { stale = false; soon(0); }
});

// A transition patches the graph node and the table row of its task at once (a 1,000-task
// page is not fetched again for each); the rest of the page follows in one later refresh.
const GLYPH = { pending: "○", running: "▶", awaiting_input: "?", completed: "✓", failed: "✗", cancelled: "⊘" };
function patch(e) {
  if (e.type !== "transition" || !e.task || !(e.to in GLYPH)) return false;
  const nodes = main.querySelectorAll(`[data-region] [data-task="${CSS.escape(e.task)}"]`);
  for (const el of nodes) {
    el.dataset.state = e.to;
    if (el.tagName.toLowerCase() === "g") {
      el.setAttribute("class", `node state-${e.to}`);
      const text = el.querySelector("text");
      if (text) text.textContent = `${GLYPH[e.to]}${text.textContent.slice(1)}`;
      const title = el.querySelector("title");
      if (title) title.textContent = `${e.task}: ${e.to}`;
    } else {
      const cell = el.querySelector(".state");
      if (cell) { cell.className = `state state-${e.to}`; cell.textContent = `${GLYPH[e.to]} ${e.to}`; }
    }
  }
  // The counts follow the table only when it lists every task (a page of a big run does not).
  const counts = main.querySelector("[data-region] p.counts");
  if (counts && nodes.length && main.querySelector("table.tasks[data-complete]")) {
    const n = {};
    for (const row of main.querySelectorAll("[data-region] tr[data-state]")) n[row.dataset.state] = (n[row.dataset.state] || 0) + 1;
    counts.textContent = Object.keys(n).sort().map((k) => `${n[k]} ${k}`).join(" · ");
  }
  return nodes.length > 0;
}

// The rail: each event once, in sequence order; an agent's text deltas shown as one line per
// message (the history comes merged by the server, live deltas join the line before them).
let railLast = -1;
function rail(e) {
  const list = document.getElementById("events");
  if (!list || e.seq <= railLast) return;
  railLast = e.seq;
  const kind = e.type === "session_update" ? (e.update && e.update.sessionUpdate) || "update" : null;
  const delta = kind && kind.endsWith("_chunk") ? `${e.task}|${e.attempt}|${kind}` : null;
  const n = Number(e.merged || 1);
  const last = list.lastElementChild;
  if (delta && last && last.dataset.delta === delta) {
    last.dataset.n = String(Number(last.dataset.n) + n);
    last.textContent = `${last.dataset.first}–${e.seq} · ${e.task} · ${kind} ×${last.dataset.n}`;
    return;
  }
  const li = document.createElement("li");
  const what = e.type === "transition" ? `${e.from} → ${e.to}` : kind || e.type;
  if (delta) {
    Object.assign(li.dataset, { delta, n: String(n), first: String(e.first_seq || e.seq) });
    li.textContent = n > 1 ? `${li.dataset.first}–${e.seq} · ${e.task} · ${kind} ×${n}` : `${e.seq} · ${e.task} · ${kind}`;
  } else {
    li.textContent = `${e.seq} · ${e.task || "run"} · ${what}${e.reason ? " · " + e.reason : ""}`;
  }
  list.append(li);
  while (list.children.length > 500) list.firstElementChild.remove();
}

// Live events of the stream: past the page, for this page.
let railReady = false;
const held = [];
function seen(e) {
  if (run && e.run !== run) return;
  if (railReady) rail(e); else held.push(e);
  if (e.seq > pageSeq && MOVES.has(e.type)) {
    if (patch(e)) soon(1000); else soon();
  }
}

// The rail's history from `after`: a finite read of the same stream (follow=false). A
// later call (a second Replay) supersedes an earlier one still reading.
let generation = 0;
async function history(after) {
  const mine = ++generation;
  railReady = false;
  const list = document.getElementById("events");
  if (list) list.replaceChildren();
  railLast = -1;
  if (list && run) {
    const resp = await fetch(`/ui/events?run=${encodeURIComponent(run)}&after=${after}&follow=false&merge=deltas`, { credentials: "same-origin" });
    const text = resp.ok ? await resp.text() : "";
    if (mine !== generation) return;
    if (!resp.ok) {
      const li = document.createElement("li");
      li.textContent = `cannot replay from ${after}: ${resp.status}`;
      list.append(li);
    }
    for (const block of text.split("\n\n")) {
      const data = block.split("\n").filter((l) => l.startsWith("data:")).map((l) => l.slice(5).trim()).join("\n");
      if (data) { try { rail(JSON.parse(data)); } catch { /* a keep-alive */ } }
    }
  }
  railReady = true;
  for (const e of held.splice(0)) rail(e);
}

function connect() {
  const worker = main.dataset.worker;
  if (typeof SharedWorker === "function" && worker) {
    const w = new SharedWorker(worker, { type: "module", name: "pier-live" });
    w.port.onmessage = (m) => {
      if (m.data && m.data.hello) { if (m.data.last > pageSeq) soon(); return; }
      if (m.data && m.data.down) { soon(0); return; } // a refresh finds out whether the session is gone
      seen(m.data);
    };
    w.port.start();
    w.port.postMessage({ after: pageSeq });
    addEventListener("pagehide", () => w.port.postMessage({ bye: true }));
    addEventListener("pageshow", (ev) => { if (ev.persisted) w.port.postMessage({ after: pageSeq }); });
    return;
  }
  let last = pageSeq;
  const open = () => {
    const source = new EventSource(`/ui/events?${live}&after=${last}`);
    const relay = (m) => {
      let e;
      try { e = JSON.parse(m.data); } catch { return; }
      last = Math.max(last, e.seq);
      seen(e);
    };
    for (const t of TYPES) source.addEventListener(t, relay);
    source.onmessage = relay;
    source.onerror = () => {
      if (source.readyState !== EventSource.CLOSED) return;
      soon(0);
      setTimeout(open, 3000);
    };
  };
  open();
}

if (live) {
  connect();
  const list = document.getElementById("events");
  history(list ? Number(list.dataset.after || 0) : pageSeq);
  document.addEventListener("submit", (ev) => {
    if (ev.target.id !== "replay") return;
    ev.preventDefault();
    history(Math.max(0, Math.floor(Number(new FormData(ev.target).get('from')) || 0)));
  });
}

// The graph's zoom, kept across re-renders: a factor of its drawn size, or "fit" (the box's width).
let zoom = 1;
function zoomGraph() {
  const svg = main && main.querySelector("svg.graph");
  if (!svg) return;
  const [, , w, h] = (svg.getAttribute("viewBox") || "").split(" ").map(Number);
  if (!(w > 0 && h > 0)) return;
  const box = svg.closest(".graph-box");
  const f = zoom === "fit" ? Math.min(1, ((box && box.clientWidth) || w) / w) : zoom;
  svg.setAttribute("width", String(Math.round(w * f)));
  svg.setAttribute("height", String(Math.round(h * f)));
  svg.dataset.zoom = String(f);
}
document.addEventListener("click", (ev) => {
  const b = ev.target.closest && ev.target.closest("[data-zoom]");
  if (!b) return;
  const now = Number((main.querySelector("svg.graph") || { dataset: {} }).dataset.zoom || 1);
  const step = { in: now * 1.25, out: now / 1.25 }[b.dataset.zoom];
  zoom = b.dataset.zoom === "fit" ? "fit" : Math.min(4, Math.max(0.1, step));
  zoomGraph();
});
