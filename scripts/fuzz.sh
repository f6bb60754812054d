#!/usr/bin/env bash
# Coverage-guided fuzzing of every input parser (issue 15): builds the cargo-fuzz targets in
# fuzz/ and runs each for SECONDS_PER_TARGET seconds (default 30). Exits non-zero when any
# target crashes (panic, sanitizer report), hangs (-timeout=5: one input running over 5 s) or
# runs out of memory (-rss_limit_mb=2048, which also catches single huge allocations).
#
# cargo-fuzz passes nightly -Z flags to rustc; on a stable toolchain this script sets
# RUSTC_BOOTSTRAP=1 so that stable accepts them. The address sanitizer is tried first; where it
# cannot be built the script falls back to no sanitizer (panics, hangs and huge allocations are
# still caught: the code under test is safe Rust). KYLIN_FUZZ_SANITIZER=none|address forces one.
#
# The committed seeds in fuzz/corpus/<target> are copied to a working corpus under the target
# directory, so a run never modifies the repository; crashing inputs are written to
# fuzz/artifacts/<target>/ (not committed) and named in the summary.
#
# Campaigns: FUZZ_RUNS=N stops each target after N executions (or SECONDS_PER_TARGET, whichever
# comes first); FUZZ_TARGETS="a b" runs only those targets (to run two lists side by side).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
SECONDS_PER_TARGET="${1:-30}"
cd "$ROOT"
export RUSTC_BOOTSTRAP=1
TARGET_DIR="${CARGO_TARGET_DIR:-$ROOT/target}/fuzz"
WORK="$TARGET_DIR/corpus"
LOGS="$TARGET_DIR/logs"
mkdir -p "$WORK" "$LOGS"

if ! cargo fuzz --version >/dev/null 2>&1; then
    cargo install cargo-fuzz --locked
fi

# The targets and the dictionary each one uses (none for binary formats).
TARGETS=(
    "safetensors_header:"
    "shard_index:json.dict"
    "hf_config:json.dict"
    "generation_config:json.dict"
    "tokenizer_config:json.dict"
    "chat_template:jinja.dict"
    "gguf_header:"
    "llama2c_bin:"
    "llama2c_tokenizer:"
    "server_request:json.dict"
    "image_file:"
    "preprocessor_config:json.dict"
)

SANITIZER="${KYLIN_FUZZ_SANITIZER:-}"
build() {
    cargo fuzz build --fuzz-dir fuzz --target-dir "$TARGET_DIR" -O --sanitizer "$1"
}
if [ -z "$SANITIZER" ]; then
    if build address; then
        SANITIZER=address
    else
        echo "fuzz.sh: the address sanitizer build failed; falling back to --sanitizer none" >&2
        SANITIZER=none
        build none
    fi
else
    build "$SANITIZER"
fi

failed=()
for entry in "${TARGETS[@]}"; do
    target="${entry%%:*}"
    dict="${entry#*:}"
    if [ -n "${FUZZ_TARGETS:-}" ] && [[ " $FUZZ_TARGETS " != *" $target "* ]]; then
        continue
    fi
    mkdir -p "$WORK/$target" "fuzz/artifacts/$target"
    args=(
        -max_total_time="$SECONDS_PER_TARGET" -rss_limit_mb=2048 -timeout=5
        -print_final_stats=1 -artifact_prefix="fuzz/artifacts/$target/"
    )
    [ -n "$dict" ] && args+=(-dict="fuzz/dict/$dict")
    [ -n "${FUZZ_RUNS:-}" ] && args+=(-runs="$FUZZ_RUNS")
    echo "=== $target ($SECONDS_PER_TARGET s, sanitizer $SANITIZER)"
    if cargo fuzz run --fuzz-dir fuzz --target-dir "$TARGET_DIR" -O --sanitizer "$SANITIZER" \
        "$target" "$WORK/$target" "fuzz/corpus/$target" -- "${args[@]}" >"$LOGS/$target.log" 2>&1; then
        # The last status line: executions, coverage (cov) and features (ft).
        grep -E '^#[0-9]+' "$LOGS/$target.log" | tail -n 1 || true
        grep -E 'stat::number_of_executed_units' "$LOGS/$target.log" || true
    else
        echo "FAILED: $target (log: $LOGS/$target.log)"
        grep -E 'ERROR: libFuzzer|panicked at|Test unit written to|SUMMARY' "$LOGS/$target.log" | head -n 8 || true
        failed+=("$target")
    fi
done

if [ "${#failed[@]}" -gt 0 ]; then
    echo "fuzz.sh: ${#failed[@]} target(s) found problems: ${failed[*]}" >&2
    exit 1
fi
echo "fuzz.sh: every target ran $SECONDS_PER_TARGET s without a crash, hang or OOM"
