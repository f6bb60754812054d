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
