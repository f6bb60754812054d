#!/usr/bin/env bash
# Prefill and decode speed against prompt length, Kylin against llama.cpp on the same weights
# in the same run, then a plot (docs/context.svg) and a table (stdout).
#   bash scripts/bench_context.sh [MODEL] [GGUF]
# Defaults: qwen3-0.6b-shaped against its BF16 GGUF twin, at LENGTHS="512 1024 2048 4096 8192"
# prompt tokens, GEN_TOKENS=32 generated tokens after each prompt, REPETITIONS=1 measured run
# per length (environment variables). The context is planned from the prompt by `kylin bench`.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
M="${KYLIN_MODELS:-$HOME/.cache/kylin-models}"
MODEL="${1:-$M/qwen3-0.6b-shaped}"
GGUF="${2:-$M/qwen3-0.6b-shaped/gguf/qwen3-0.6b-shaped-bf16.gguf}"
read -r -a LENGTHS <<< "${LENGTHS:-512 1024 2048 4096 8192}"
OUT="${BENCH_OUT:-$ROOT/target/bench-context}"
mkdir -p "$OUT"
cargo build --release -p kylin-cli --manifest-path "$ROOT/Cargo.toml"
for n in "${LENGTHS[@]}"; do
  echo "prompt $n" >&2
  "$ROOT/target/release/kylin" bench "$MODEL" --vs "$GGUF" --prompt-tokens "$n" \
    --gen-tokens "${GEN_TOKENS:-32}" --repetitions "${REPETITIONS:-1}" --json > "$OUT/p$n.json"
done
python3 "$ROOT/scripts/plot_context.py" "$OUT"/p*.json --out "$ROOT/docs/context.svg"
