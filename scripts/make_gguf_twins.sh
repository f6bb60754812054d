#!/usr/bin/env bash
# GGUF twins of the real models' Hugging Face directories, for like-with-like comparisons with
# llama.cpp: BF16 and Q8_0 of exactly the weights Kylin loads (scripts/hf_to_gguf.py), and the
# Q4_K_M llama.cpp's own quantizer makes from the BF16 twin (no importance matrix).
#
#   bash scripts/make_gguf_twins.sh     # into $KYLIN_MODELS/twins (default ~/.cache/kylin-models)
#
# Needs the models and the venv of testdata/models/fetch.sh. Idempotent.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
M="${KYLIN_MODELS:-$HOME/.cache/kylin-models}"
PY="$M/.venv/bin/python"
OUT="$M/twins"
mkdir -p "$OUT"
[ -x "$PY" ] || { echo "missing $PY: run bash testdata/models/fetch.sh first" >&2; exit 1; }
cargo build --release -q -p kylin-llamacpp --example gguf_quantize --manifest-path "$ROOT/Cargo.toml"
QUANTIZE="$ROOT/target/release/examples/gguf_quantize"
for pair in qwen2.5-coder-0.5b-instruct:qwen2.5-coder-0.5b-instruct-q4_k_m smollm2-135m-instruct:smollm2-135m-instruct-q4_1; do
  name="${pair%%:*}"; source="$M/gguf/${pair#*:}.gguf"
  for type in bf16 q8_0; do
    [ -f "$OUT/$name-$type.gguf" ] || "$PY" "$ROOT/scripts/hf_to_gguf.py" "$M/$name" "$source" "$OUT/$name-$type.gguf" "$type"
  done
  [ -f "$OUT/$name-q4_k_m.gguf" ] || "$QUANTIZE" "$OUT/$name-bf16.gguf" "$OUT/$name-q4_k_m.gguf" q4_k_m 2>&1 | tail -1
done
ls -l "$OUT"
