#!/usr/bin/env bash
# The benchmark suite (not part of CI). Builds the harness (pier's side in crates/pier-bench,
# the official Rust SDK's in bench/rust-sdk, the TypeScript SDK's in bench/ts), installs the
# TypeScript SDK (and, with --peers, codex-acp, claude-agent-acp and gemini-cli, about 400 MB),
# runs every benchmark once to warm up and then ROUNDS times, prints each run as a JSON line on
# stderr and the table of medians (min, max) on stdout. Reading the figures: docs/benchmarks.md.
#
#   bench/run.sh [ROUNDS] [--peers] [--only PREFIX]   # default 5 rounds; --only B6: just those
#
# PIER_BENCH_BINS=DIR takes `pier` and `pier-bench` from DIR instead of building them: how two
# commits are measured side by side (build each, copy its two binaries, run the suite on each).
set -euo pipefail
cd "$(dirname "$0")/.."
rounds=5
with_peers=0
only=""
while [ $# -gt 0 ]; do
  case "$1" in
    --peers) with_peers=1 ;;
    --only) only="$2"; shift ;;
    *) rounds="$1" ;;
  esac
  shift
done
wanted() { [[ "$1" == "$only"* ]]; }

peers="${PIER_TEST_PEERS:-$PWD/target/test-peers}"
if [ ! -f "$peers/node_modules/@agentclientprotocol/sdk/dist/examples/agent.js" ]; then
  mkdir -p "$peers"
  npm install --prefix "$peers" --no-audit --no-fund --loglevel=error @agentclientprotocol/sdk@1.9.0
fi
interop="${PIER_INTEROP_PEERS:-$PWD/target/interop}"
if [ "$with_peers" = 1 ] && [ ! -x "$interop/node_modules/.bin/gemini" ]; then
  mkdir -p "$interop"
  npm install --prefix "$interop" --no-audit --no-fund --loglevel=error \
    @zed-industries/codex-acp@0.16.0 @zed-industries/claude-agent-acp@0.23.1 @google/gemini-cli@0.61.0
fi
# B9: LiteLLM's proxy (PyPI `litellm[proxy]`) beside pier's model gateway, in a venv of its own.
litellm="${PIER_BENCH_LITELLM:-$PWD/target/litellm}"
if { [ -z "$only" ] || wanted B9; } && [ ! -x "$litellm/bin/litellm" ]; then
  python3 -m venv "$litellm"
  "$litellm/bin/pip" install --quiet 'litellm[proxy]==1.108.7'
fi
ln -sfn "$peers/node_modules" bench/ts/node_modules
bins="${PIER_BENCH_BINS:-}"
if [ -z "$bins" ]; then
  cargo build --release --quiet -p pier -p pier-bench
  cargo build --release --quiet -p pier --example interop
  bins="$PWD/target/release"
fi
if [ -z "$only" ] || wanted B1 || wanted B4; then
  (cd bench/rust-sdk && cargo build --release --quiet)
fi
sdk="$PWD/bench/rust-sdk/target/release/sdk-bench"
bench="$bins/pier-bench"
pier="$bins/pier"
sdk_agent="$peers/node_modules/@agentclientprotocol/sdk/dist/examples/agent.js"
work="$(mktemp -d)"
server=""
cleanup() { [ -n "$server" ] && kill "$server" 2>/dev/null; rm -rf "$work"; }
trap cleanup EXIT
export PIER_HOME="$work/home"
pin="taskset -c 0"

run() { # NAME COMMAND...: one warm-up, then $rounds measured runs
  local name="$1"; shift
  wanted "$name" || return 0
  "$@" >/dev/null
  for i in $(seq "$rounds"); do
    local line
    line="{\"bench\":\"$name\",\"round\":$i,\"result\":$("$@")}"
    echo "$line" >&2
    echo "$line"
  done
}

{
echo "Machine: $(nproc) cores, $(free -g | awk '/Mem:/{print $2}') GiB, $(uname -sr), $(rustc --version), node $(node --version); $(date -u +%F)"
echo
# B1 + B2, each pairing with its own agent and client. Free: the kernel places the two
# processes; pinned: both on one core, where a round trip costs the software, not the
# hypervisor's wake-up of an idle core (see B2-floor).
run B1B2-pier              "$bench" client --updates 100000 --rtt 20000 --rtt-session-new -- "$bench" agent
run B1B2-rust-sdk          "$sdk" client 100000 20000 -- "$sdk" agent
run B1B2-typescript        node bench/ts/client.mjs 100000 20000 node bench/ts/agent.mjs
run B1B2-pier-pinned       $pin "$bench" client --updates 100000 --rtt 20000 --rtt-session-new -- "$bench" agent
run B1B2-rust-sdk-pinned   $pin "$sdk" client 100000 20000 -- "$sdk" agent
run B1B2-typescript-pinned $pin node bench/ts/client.mjs 100000 20000 node bench/ts/agent.mjs
run B1-serde-limit         "$bench" limit --updates 100000
run B2-floor               "$bench" floor
run B2-floor-pinned        $pin "$bench" floor
# B3: cold starts, median of 20 per run.
run B3-pier-agent          "$bench" startup --n 20 -- "$pier" agent
run B3-ts-example          "$bench" startup --n 20 -- node "$sdk_agent"
# B4: agent RSS idle, with 1,000 sessions, and during B1 (pier's client reads the agent's peak).
run B4-pier-agent          "$bench" sessions --sessions 1000 -- "$pier" agent
run B4-rust-sdk-agent      "$bench" sessions --sessions 1000 -- "$sdk" agent
run B4-typescript-agent    "$bench" sessions --sessions 1000 -- node bench/ts/agent.mjs
run B4-B1-rust-sdk-agent   "$bench" client --updates 100000 --rtt 1 --rtt-session-new -- "$sdk" agent
run B4-B1-typescript-agent "$bench" client --updates 100000 --rtt 1 --rtt-session-new -- node bench/ts/agent.mjs
if [ -x /usr/bin/time ]; then
  # pier exec as the client of B1 (its peak RSS includes everything it buffered).
  run B4-pier-exec-B1-json sh -c "/usr/bin/time -f '{\"peak_rss_kb\":%M,\"seconds\":%e}' -o '$work/t' \
    '$pier' exec --agent '$bench agent' --format json 100000 >/dev/null && cat '$work/t'"
fi
# B5: the host end to end, the event log, and the SSE replay of 1,000,000 events.
run B5-host-10000-tasks    "$bench" host --tasks 10000 --concurrency 8 -- "$pier"
run B5-serve-10x1000-tasks "$bench" serve --runs 10 --tasks 1000 --concurrency 8 -- "$pier"
# B5 on PostgreSQL: a throw-away cluster of this run (scripts/pg), beside SQLite above.
if wanted B5-pg; then
  pgdir="$work/pg"; mkdir -p "$pgdir"; chmod 755 "$work" "$pgdir"
  pg="$(scripts/pg start "$pgdir")"
  trap 'scripts/pg stop "$pgdir"; cleanup' EXIT
  run B5-pg-host-10000-tasks "$bench" host --tasks 10000 --concurrency 8 --pg "$pg" -- "$pier"
  for n in 1 2 3; do
    run "B5-pg-serve-10x1000-tasks-${n}-nodes" "$bench" serve --runs 10 --tasks 1000 --concurrency 8 --nodes "$n" --pg "$pg" -- "$pier"
  done
  run B5-claims-sqlite       "$bench" claims --tasks 10000 --claimers 16
  for k in 1 10 100; do
    run "B5-claims-sqlite-keys-$k" "$bench" claims --tasks 10000 --claimers 16 --keys "$k"
  done
  run B5-pg-claims           "$bench" claims --tasks 10000 --claimers 16 --pg "$pg"
  for k in 1 10 100; do
    run "B5-pg-claims-keys-$k" "$bench" claims --tasks 10000 --claimers 16 --keys "$k" --pg "$pg"
  done
  # B11: POST /runs → the warm agent's session/prompt, one-task runs at 100 and 1,000 a second.
  for rate in 100 1000; do
    run "B11-latency-sqlite-$rate" "$bench" latency --rate "$rate" --count "$((rate * 5))" -- "$pier"
    run "B11-latency-pg-$rate"     "$bench" latency --rate "$rate" --count "$((rate * 5))" --pg "$pg" -- "$pier"
  done
fi
run B5-log-appends         sh -c "rm -f '$work'/log.db*; '$bench' log --writers 8 --appends 40000 -- '$work/log.db'"
if wanted B5-sse; then
  "$bench" log --writers 1 --appends 1 --fill 1000000 -- "$work/replay.db" >/dev/null
  port=$((20000 + RANDOM % 20000))
  "$pier" serve --store "$work/replay.db" --listen "127.0.0.1:$port" --token bench 2>"$work/serve.log" &
  server=$!
  for _ in $(seq 100); do curl -sf "http://127.0.0.1:$port/health" >/dev/null && break; sleep 0.1; done
  run B5-sse-replay-1M       "$bench" replay --token bench -- "http://127.0.0.1:$port"
  kill "$server"; server=""
fi
# B8: the cost of confinement: the bench agent's start open, under workspace and under strict
# (interleaved), and a request direct and through the egress proxy.
run B8-jail-startup        "$bench" jail-startup --n 20 --pier "$pier" -- "$bench" agent
run B8-egress              "$bench" egress --n 2000
# B9: streamed chat completions from the fake upstream, direct, through pier's gateway and
# through LiteLLM's proxy (one worker each), at 1 and 64 concurrent streams; RSS; token counts.
run B9-gateway             "$bench" gateway --n 200 --n64 1000 --litellm "$litellm/bin/litellm"
# B10: the same tasks on a pier serve's own agents and on one pier worker's (concurrency 4 each),
# and one progress event from a worker's post to an /events reader.
run B10-workers            "$bench" workers --tasks 500 --concurrency 4 --events 200 -- "$pier"
# B6: one answer of 20,000 one-token deltas streamed by the fake model (started inside
# pier-bench) as fast as it can, through the agent to a counting client; `direct` is the
# fake read straight over HTTP, no agent (the fake's own ceiling and loopback latency).
run B6-direct              "$bench" stream --kind direct --tokens 20000
run B6-pier-editor         "$bench" stream --kind pier --tokens 20000 -- "$pier" agent --profile editor
if [ "$with_peers" = 1 ]; then
  run B6-codex-acp         "$bench" stream --kind codex --tokens 20000 -- "$interop/node_modules/.bin/codex-acp"
  run B6-claude-agent-acp  "$bench" stream --kind claude --tokens 20000 -- "$interop/node_modules/.bin/claude-agent-acp"
fi
# D1: the dashboard's run page of a 1,000-task (and a 10,000-task) run in headless Chromium, and 10 tabs of it
# kept live while workers complete 50 tasks (crates/pier/examples/dashboard_bench.rs).
if wanted D1 && command -v chromedriver >/dev/null; then
  cargo build --release --quiet -p pier --example dashboard_bench
  run D1-dashboard-1000-tasks target/release/examples/dashboard_bench
  # Issue #34's bars: a 10,000-task run page under 1 s, the runs page of 10,000 runs under 0.5 s.
  run D1-dashboard-10000-tasks-10000-runs target/release/examples/dashboard_bench --tasks 10000 --runs 10000
fi
# B7: a delegation (the delegate tool, pier's own agent as the child) beside the same child
# run directly by the harness; overhead_ms is what delegating adds (median of 20 per run).
run B7-delegate            "$bench" delegate --pier "$pier" --n 20
# B12: an MCP tool call's round trip through pier's agent (and, with --peers, codex-acp) beside the
# same stdio server called directly; *_overhead_ms is what the agent adds (median of 50 calls).
mcp_server="$PWD/crates/pier-mcp/tests/fixtures/mcp_server.py"
if [ "$with_peers" = 1 ]; then
  run B12-mcp              "$bench" mcp --pier "$pier" --server "$mcp_server" --n 50 --codex "$interop/node_modules/.bin/codex-acp"
else
  run B12-mcp              "$bench" mcp --pier "$pier" --server "$mcp_server" --n 50
fi
if [ "$with_peers" = 1 ] && wanted B3-; then
  # B3 for the real agents, their models pointed at a local fake server: a warm-up, then rounds.
  target/release/examples/interop --peers "$interop" --startup "$bench" --n 20 >/dev/null
  for i in $(seq "$rounds"); do
    target/release/examples/interop --peers "$interop" --startup "$bench" --n 20 \
      | sed "s/^{\"agent\":\"\([a-z]*\)\",/{\"bench\":\"B3-\1\",\"round\":$i,/" \
      | while read -r line; do echo "$line" >&2; echo "$line"; done
  done
fi
} | python3 bench/summarize.py
