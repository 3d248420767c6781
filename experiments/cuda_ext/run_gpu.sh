#!/usr/bin/env bash
# On the GPU host (scripts/gpu_env.sh unpacks the offline MLX CUDA runtime): build the probe with
# nvcc against the wheel's headers and libmlx.so, then time it. nanobind comes as a wheel in .whl/.
set -eo pipefail
source scripts/gpu_env.sh
OUT=${OUT:-results/cuda_ext}
mkdir -p "$OUT" /tmp/site
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/nanobind-*.whl
export PYTHONPATH=/tmp/site:$PYTHONPATH
B=/tmp/cuda_ext_build
SECONDS=0
cmake -S experiments/cuda_ext -B $B -DPython_EXECUTABLE=$(command -v python3) -DCMAKE_BUILD_TYPE=Release > "$OUT/cmake.log" 2>&1 || { tail -30 "$OUT/cmake.log"; exit 1; }
cmake --build $B -j 16 >> "$OUT/cmake.log" 2>&1 || { grep -E "error|Error" -A3 "$OUT/cmake.log" | head -60; exit 1; }
echo "build: ${SECONDS} s"
PYTHONPATH=$B:$PYTHONPATH python3 experiments/cuda_ext/probe.py --out "$OUT/probe.json" "$@"
