#!/usr/bin/env bash
# Interop check outside CI: installs codex-acp, claude-agent-acp and gemini-cli from npm
# (about 400 MB), then runs `pier exec` against each with its model traffic sent to a
# local fake server speaking its provider's API (OpenAI Responses, Anthropic Messages,
# Gemini streamGenerateContent). Rewrites the table in docs/interop.md.
#
#   scripts/interop.sh [codex] [claude] [gemini]
set -euo pipefail
cd "$(dirname "$0")/.."

peers="${PIER_INTEROP_PEERS:-$PWD/target/interop}"
mkdir -p "$peers"
if [ ! -x "$peers/node_modules/.bin/codex-acp" ] || [ ! -x "$peers/node_modules/.bin/claude-agent-acp" ] || [ ! -x "$peers/node_modules/.bin/gemini" ]; then
  npm install --prefix "$peers" --no-audit --no-fund --loglevel=error \
    @zed-industries/codex-acp@0.16.0 @zed-industries/claude-agent-acp@0.23.1 @google/gemini-cli@0.61.0
fi
cargo build -p pier --example interop
cargo build -p pier
exec target/debug/examples/interop --peers "$peers" --out docs/interop.md "$@"
