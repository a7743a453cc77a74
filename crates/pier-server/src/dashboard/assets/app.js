// pier's dashboard: keeps a page current from the server's /events stream (the API's own
// SSE, resumed exactly by sequence number). Pages render whole without this script; it
// only re-renders their live regions when the store moves, and fills the event rail.

const main = document.getElementById("main");
const live = main && main.dataset.live;

// Events that change what a page shows; chatter (session updates) only feeds the rail.
const MOVES = new Set(["run_created", "task_created", "transition", "question", "permission", "message"]);

let pageSeq = Number((main && main.dataset.after) || 0);
let refreshing = false;
let again = false;

async function refresh() {
  if (refreshing) { again = true; return; }
  refreshing = true;
  try {
    const resp = await fetch(location.href, { credentials: "same-origin", headers: { accept: "text/html" } });
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
    pageSeq = Math.max(pageSeq, Number(fresh.dataset.after || 0));
    main.dataset.after = String(pageSeq);
  } finally {
    refreshing = false;
    if (again) { again = false; setTimeout(refresh, 100); }
  }
}

let timer = null;
function soon() {
  if (timer === null) timer = setTimeout(() => { timer = null; refresh(); }, 150);
}

function railLine(e) {
  const li = document.createElement("li");
  const what = e.type === "transition" ? `${e.from} → ${e.to}` :
    e.type === "session_update" ? (e.update && e.update.sessionUpdate) || "update" : e.type;
  li.textContent = `${e.seq} · ${e.task || "run"} · ${what}${e.reason ? " · " + e.reason : ""}`;
  li.dataset.seq = String(e.seq);
  return li;
}

let source = null;
function listen(after) {
  if (source) source.close();
  const rail = document.getElementById("events");
  source = new EventSource(`/ui/events?${live}&after=${after}`);
  const seen = (msg) => {
    let e;
    try { e = JSON.parse(msg.data); } catch { return; }
    const r = document.getElementById("events");
    if (r) {
      r.append(railLine(e));
      while (r.children.length > 500) r.firstElementChild.remove();
    }
    if (e.seq > pageSeq && MOVES.has(e.type)) soon();
  };
  for (const type of ["run_created", "task_created", "transition", "question", "permission", "message",
    "session_update", "client_call", "elicitation", "protocol_error", "note"]) {
    source.addEventListener(type, seen);
  }
  source.onmessage = seen;
  if (rail) rail.dataset.after = String(after);
}

if (live) {
  const rail = document.getElementById("events");
  listen(rail ? Number(rail.dataset.after || 0) : pageSeq);
  document.addEventListener("submit", (ev) => {
    if (ev.target.id !== "replay") return;
    ev.preventDefault();
    const from = Number(new FormData(ev.target).get("from") || 0);
    const r = document.getElementById("events");
    if (r) r.replaceChildren();
    listen(Math.max(0, from));
  });
}
