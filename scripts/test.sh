#!/usr/bin/env bash
# The test command: sets up (idempotent), then runs every test of the workspace in release mode.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$ROOT/scripts/setup.sh"
cd "$ROOT"
export KYLIN_MODELS="${KYLIN_MODELS:-$HOME/.cache/kylin-models}"
cargo test --release --workspace --no-fail-fast
# The build without llama.cpp: GGUF files get a clear error, Hugging Face models still run.
cargo test --release -p kylin-cli --no-default-features --test without_llamacpp
