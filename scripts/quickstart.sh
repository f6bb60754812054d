#!/usr/bin/env bash
# From a fresh clone to a running model in one command: install build tools, fetch the models,
# build kylin, then complete a prompt with Qwen2.5-Coder-0.5B and answer a chat with SmolLM2.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$ROOT/scripts/setup.sh"
cd "$ROOT"
cargo build --release -p kylin-cli
M="${KYLIN_MODELS:-$HOME/.cache/kylin-models}"
KYLIN=target/release/kylin
$KYLIN inspect "$M/qwen2.5-coder-0.5b-instruct"
echo
$KYLIN run "$M/qwen2.5-coder-0.5b-instruct" -p "The capital of France is" --temperature 0 --max-tokens 32
echo
printf '[{"role": "user", "content": "What is the capital of France?"}]' > "${TMPDIR:-/tmp}/kylin-messages.json"
$KYLIN run "$M/smollm2-135m-instruct" --messages "${TMPDIR:-/tmp}/kylin-messages.json" --temperature 0 --max-tokens 32
