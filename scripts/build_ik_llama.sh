#!/usr/bin/env bash
# Builds ik_llama.cpp (the fork with repacked row-interleaved quants and its own AVX-512 kernels)
# for this CPU, the way its users build it, from the sources PyPI's `ik-llama-cpp-python` 0.1.5
# ships in its source distribution (vendor/ik_llama.cpp), for issue 36's side-by-side runs.
#
#   bash scripts/build_ik_llama.sh          # prints the path of its llama-bench
#
# GGML_NATIVE=ON (this CPU's instruction set), no CURL, release build of llama-bench and
# llama-cli. That tree lacks the cmake script that writes common/build-info.cpp; the file is
# written from its template. Idempotent: a finished build is reused.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
OUT="${KYLIN_PEERS:-$HOME/.cache/kylin-peers}"
VERSION=0.1.5
SRC="$OUT/ik_llama_cpp_python-$VERSION/vendor/ik_llama.cpp"
BENCH="$SRC/build/bin/llama-bench"
if [ -x "$BENCH" ]; then echo "$BENCH"; exit 0; fi
mkdir -p "$OUT"
if [ ! -d "$SRC" ]; then
  PY="$ROOT/.venv/bin/python"
  [ -x "$PY" ] || PY=python3
  "$PY" -m pip download -q --disable-pip-version-check --no-binary :all: --no-deps \
    "ik-llama-cpp-python==$VERSION" -d "$OUT" >&2
  tar -xzf "$OUT/ik_llama_cpp_python-$VERSION.tar.gz" -C "$OUT"
fi
if [ ! -f "$SRC/common/build-info.cpp" ]; then
  sed -e 's/@BUILD_NUMBER@/0/' -e "s/@BUILD_COMMIT@/ik-llama-cpp-python-$VERSION/" \
      -e "s/@BUILD_COMPILER@/$(cc --version | head -1 | tr -d '"')/" -e 's/@BUILD_TARGET@/x86_64-linux-gnu/' \
      "$SRC/common/build-info.cpp.in" > "$SRC/common/build-info.cpp"
fi
cmake -S "$SRC" -B "$SRC/build" -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON -DLLAMA_CURL=OFF \
  -DBUILD_SHARED_LIBS=OFF >&2
cmake --build "$SRC/build" --config Release -j "$(nproc)" --target llama-bench llama-cli >&2
echo "$BENCH"
