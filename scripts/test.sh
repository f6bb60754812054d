#!/usr/bin/env bash
# The test command: sets up (idempotent), then runs every test of the workspace in release mode.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$ROOT/scripts/setup.sh"
cd "$ROOT"
export KYLIN_MODELS="${KYLIN_MODELS:-$HOME/.cache/kylin-models}"
cargo test --release --workspace --no-fail-fast
# The code is formatted and lint-free: rustfmt, and clippy with every warning an error (after the
# tests, so that it reuses their build scripts' output, llama.cpp's included).
cargo fmt --all --check
cargo clippy --release --workspace --all-targets -- -D warnings
# The Kubernetes manifests against Kubernetes' schemas (strict: an unknown field fails).
"$ROOT/.venv/bin/kubernetes-validate" --strict "$ROOT/deploy/kubernetes/kylin.yaml"
# The build without llama.cpp: GGUF files get a clear error, Hugging Face models still run.
cargo test --release -p kylin-cli --no-default-features --test without_llamacpp
# The end-to-end test of `kylin serve` (default features) with the official openai client: the
# suite starts the server on a free 127.0.0.1 port, waits for /health and stops it with SIGTERM.
cargo build --release -p kylin-cli
TARGET_DIR="${CARGO_TARGET_DIR:-$ROOT/target}"
KYLIN_BIN="$TARGET_DIR/release/kylin" timeout 1500 "$ROOT/.venv/bin/pytest" -q "$ROOT/tests/e2e"
# The Python package: its wheel built with maturin (PyO3; the same target directory), installed
# into the test venv like a user's pip install, and tested from Python.
rm -rf "$TARGET_DIR/wheels"
CARGO_TARGET_DIR="$TARGET_DIR" "$ROOT/.venv/bin/maturin" build --release -m "$ROOT/python/Cargo.toml" \
  -i "$ROOT/.venv/bin/python" --out "$TARGET_DIR/wheels"
"$ROOT/.venv/bin/pip" install -q --disable-pip-version-check --force-reinstall --no-deps "$TARGET_DIR"/wheels/kylin-*.whl
(cd "$TARGET_DIR" && KYLIN_BIN="$TARGET_DIR/release/kylin" timeout 900 "$ROOT/.venv/bin/pytest" -q "$ROOT/python/tests")
# Every cargo-fuzz target for 30 s (issue 15): a crash, a hang over 5 s or an allocation past
# 2 GiB fails the run. Without a sanitizer here (a from-scratch build takes about 4 minutes
# instead of 14-20 with AddressSanitizer; the parsers are safe Rust, so panics, hangs and huge
# allocations are what there is to find); `scripts/fuzz.sh` alone uses AddressSanitizer.
KYLIN_FUZZ_SANITIZER="${KYLIN_FUZZ_SANITIZER:-none}" bash "$ROOT/scripts/fuzz.sh" 30
