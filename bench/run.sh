#!/usr/bin/env bash
# The benchmark suite (not part of CI): builds the harness (pier's side in crates/pier-bench,
# the official Rust SDK's in bench/rust-sdk, the TypeScript SDK's in bench/ts), installs the
# TypeScript SDK, and prints B1-B4 as JSON lines. Results and their reading: docs/benchmarks.md.
#
#   bench/run.sh [ROUNDS]      # default 5 rounds after one warm-up
set -euo pipefail
cd "$(dirname "$0")/.."
rounds="${1:-5}"

peers="${PIER_TEST_PEERS:-$PWD/target/test-peers}"
if [ ! -f "$peers/node_modules/@agentclientprotocol/sdk/dist/examples/agent.js" ]; then
  mkdir -p "$peers"
  npm install --prefix "$peers" --no-audit --no-fund --loglevel=error @agentclientprotocol/sdk@1.9.0
fi
ln -sfn "$peers/node_modules" bench/ts/node_modules
cargo build --release -p pier -p pier-bench --quiet
(cd bench/rust-sdk && cargo build --release --quiet)
sdk=bench/rust-sdk/target/release/sdk-bench
bench=target/release/pier-bench
pier=target/release/pier
sdk_agent="$peers/node_modules/@agentclientprotocol/sdk/dist/examples/agent.js"
home="$(mktemp -d)"
trap 'rm -rf "$home"' EXIT

run() { # NAME COMMAND...: one warm-up, then $rounds measured runs
  local name="$1"; shift
  "$@" >/dev/null
  for i in $(seq "$rounds"); do echo "{\"bench\":\"$name\",\"round\":$i,\"result\":$("$@")}"; done
}

echo "# machine: $(nproc) cores, $(free -g | awk '/Mem:/{print $2}') GiB, $(uname -sr), $(rustc --version), node $(node --version)"
run B1B2-pier       "$bench" client --updates 100000 --rtt 20000 --rtt-session-new -- "$bench" agent
run B1B2-rust-sdk   "$sdk" client 100000 20000 -- "$sdk" agent
run B1B2-typescript node bench/ts/client.mjs 100000 20000 node bench/ts/agent.mjs
run B1-serde-limit  "$bench" limit --updates 100000
run B3-pier-agent   env PIER_HOME="$home" "$bench" startup --n 20 -- "$pier" agent
run B3-ts-example   "$bench" startup --n 20 -- node "$sdk_agent"
run B4-pier-agent   env PIER_HOME="$home" "$bench" sessions --sessions 1000 -- "$pier" agent
