#!/usr/bin/env bash
# The cost and the ceiling of speculative decoding with an MTP head (`--mtp`), on the
# Qwen3.5-0.8B-shaped benchmark model (scripts/make_family_bench_models.py writes it with its
# `mtp.*` head; seeded random weights):
#   - as written: its random head's proposals are never right, so this measures what the head
#     costs when nothing is accepted;
#   - with the embedding (tied: also the head) zeroed: every logit is 0, the model and its head
#     both pick token 0, so every proposal is accepted, which measures the most the machinery
#     can give on this CPU (the layers compute as much as with real weights).
# Alternating runs of `kylin bench --concurrency 1` (512 prompt tokens, 128 generated).
#   bash scripts/bench_mtp.sh [MODEL_DIR] [WORK_DIR]
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
MODEL="${1:-${KYLIN_MODELS:-$HOME/.cache/kylin-models}/qwen3.5-0.8b-shaped}"
WORK="${2:-/tmp/kylin-mtp-bench}"
K="${KYLIN_BIN:-$ROOT/target/release/kylin}"
mkdir -p "$WORK/rand" "$WORK/zero"
# The language model alone (the benchmark model's config names a vision tower it does not hold).
for d in rand zero; do
  python3 - "$MODEL" "$WORK/$d" <<'PY'
import json, sys
c = json.load(open(sys.argv[1] + "/config.json"))
c.pop("vision_config", None)
json.dump(c, open(sys.argv[2] + "/config.json", "w"), indent=2)
PY
  cp "$MODEL/generation_config.json" "$WORK/$d/"
done
ln -sf "$MODEL/model.safetensors" "$WORK/rand/model.safetensors"
if [ ! -f "$WORK/zero/model.safetensors" ]; then
  cp "$MODEL/model.safetensors" "$WORK/zero/model.safetensors"
  python3 - "$WORK/zero/model.safetensors" <<'PY'
import json, struct, sys
with open(sys.argv[1], "r+b") as f:
    n = struct.unpack("<Q", f.read(8))[0]
    a, b = json.loads(f.read(n))["model.language_model.embed_tokens.weight"]["data_offsets"]
    f.seek(8 + n + a)
    for start in range(a, b, 1 << 24):
        f.write(bytes(min(1 << 24, b - start)))
PY
fi
for round in 1 2; do
  for cfg in "rand" "rand --mtp" "zero" "zero --mtp" "zero --mtp --speculative-tokens 4"; do
    set -- $cfg
    d="$WORK/$1"; shift
    KYLIN_QUIET=1 "$K" bench "$d" --concurrency 1 --threads 2 --json "$@" 2>/dev/null | python3 -c "
import json, sys
j = json.load(sys.stdin)
print(f'round $round  {\"$cfg\":36s} decode {j[\"decode_tok_s\"]:6.1f} tok/s  ttft {j[\"ttft_ms_p50\"]:6.0f} ms  accepted {j[\"spec_acceptance_rate\"]}')"
  done
done
