#!/usr/bin/env bash
# Aggregate decode throughput against concurrency, Kylin's batching engine against llama.cpp on
# the same weights, then a plot (docs/concurrency.svg) and a table (stdout).
#   bash scripts/bench_concurrency.sh [MODEL] [GGUF]
# Defaults: qwen3-0.6b-shaped against its BF16 GGUF twin, at LEVELS="1 2 4 8 16" sequences,
# PROMPT_TOKENS=128-token prompts and GEN_TOKENS=64 generated tokens each, REPETITIONS=2
# measured runs per level (environment variables).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
M="${KYLIN_MODELS:-$HOME/.cache/kylin-models}"
MODEL="${1:-$M/qwen3-0.6b-shaped}"
GGUF="${2:-$M/qwen3-0.6b-shaped/gguf/qwen3-0.6b-shaped-bf16.gguf}"
read -r -a LEVELS <<< "${LEVELS:-1 2 4 8 16}"
OUT="${BENCH_OUT:-$ROOT/target/bench-concurrency}"
mkdir -p "$OUT"
cargo build --release -p kylin-cli --manifest-path "$ROOT/Cargo.toml"
for n in "${LEVELS[@]}"; do
  echo "concurrency $n" >&2
  "$ROOT/target/release/kylin" bench "$MODEL" --vs "$GGUF" --concurrency "$n" \
    --prompt-tokens "${PROMPT_TOKENS:-128}" --gen-tokens "${GEN_TOKENS:-64}" --repetitions "${REPETITIONS:-2}" \
    --json > "$OUT/c$n.json"
done
python3 "$ROOT/scripts/plot_concurrency.py" "$OUT"/c*.json --out "$ROOT/docs/concurrency.svg"
