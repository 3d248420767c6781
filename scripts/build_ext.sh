#!/usr/bin/env bash
# Builds vqpipe._ext (csrc/) against the installed MLX and puts the module in vqpipe/.
# Usage: scripts/build_ext.sh [PYTHON]   (default .venv/bin/python; needs cmake, a C++20 compiler,
# nanobind; the CUDA kernel also needs nvcc and a CUDA build of MLX)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${1:-.venv/bin/python}
build=${VQPIPE_EXT_BUILD:-build/ext}
mkdir -p "$(dirname "$build")"
cmake -S csrc -B "$build" -DPython_EXECUTABLE="$("$PY" -c 'import sys; print(sys.executable)')" \
  -DCMAKE_BUILD_TYPE=Release >"$build.log" 2>&1 || { mkdir -p "$(dirname "$build")"; cat "$build.log" >&2; exit 1; }
cmake --build "$build" -j "$(nproc 2>/dev/null || echo 2)" >>"$build.log" 2>&1 || { tail -40 "$build.log" >&2; exit 1; }
# a new file, renamed into place: a running process keeps the module it mapped
for so in "$build"/_ext*.so; do cp "$so" "vqpipe/.$(basename "$so").new" && mv -f "vqpipe/.$(basename "$so").new" "vqpipe/$(basename "$so")"; done
echo "build_ext: $(ls vqpipe/_ext*.so)"
