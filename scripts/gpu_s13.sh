#!/usr/bin/env bash
# Session 13's H200 job. PART=a: the decode step kernel by kernel under Nsight Compute
# (vqpipe/bench/step_kernels.py; qwen2.5-0.5b affine4 / vqpipe-b4 / bf16 split steps, ARMS8 at the 8B
# preset), then KIVI v4 with __launch_bounds__ for 3 and 4 blocks per SM (bench-kivi-latency at 8k and
# 32k, v4's default shape alongside; ncu on the 3-block launch at 32k).
set -o pipefail
source scripts/gpu_env.sh
OUT=${OUT:-results/s13}
mkdir -p "$OUT"
export MLX_PTX_CACHE_DIR=/root/ptx
mkdir -p $MLX_PTX_CACHE_DIR
t0=$(date +%s)
since() { echo "($(( $(date +%s) - t0 )) s)"; }
NCU=$(command -v ncu || ls /usr/local/cuda*/bin/ncu /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -n 1)
kernels() {  # PRESET ARM LIMIT
  local tag=$1-${2//+/_}
  echo "== step kernels $1 $2 $(since)"
  timeout $3 "$NCU" --profile-from-start off --clock-control none --cache-control none \
    --metrics gpu__time_duration.sum --print-kernel-base function --csv --log-file "$OUT/k-$tag.csv" \
    python3 -m vqpipe.bench.step_kernels --preset $1 --arm $2 --steps ${STEPS:-3} > "$OUT/k-$tag.log" 2>&1
  tail -n 3 "$OUT/k-$tag.log"
  python3 -m vqpipe.bench.step_kernels --summarize "$OUT/k-$tag.csv" --steps ${STEPS:-3} --out "$OUT/k-$tag.json" 2>&1 | head -n ${TOP:-25}
}
if [ "${PART:-a}" = a ]; then
  for arm in ${ARMS:-affine4+s vqpipe-b4+s bf16+s}; do kernels qwen2.5-0.5b $arm ${LK:-90}; done
  for arm in ${ARMS8:-vqpipe-b4+s}; do kernels llama3-8b $arm ${LK8:-150}; done
  echo "== kivi latency, launch bounds $(since)"
  timeout ${LAT_LIMIT:-170} python3 -m vqpipe.bench.kivi_latency --out "$OUT/kivi_lat_mb.json" --contexts 8192,32768 \
    --shapes 4xf:v4,4xf:mb3:v4,4xf:mb4:v4 --repeats ${LREP:-15} --warmup 3 2>&1 | tee "$OUT/kivi_lat_mb.log" | tail -n 30
  echo "== ncu kivi v4 mb3 at 32k $(since)"
  VQPIPE_KIVI_V4_SHAPE=4xf:mb3 timeout 60 "$NCU" --clock-control none --section SpeedOfLight --section Occupancy --section LaunchStats \
    --section WarpStateStats -k regex:"kivi_decode_attn" -c 2 \
    python3 -m vqpipe.bench.kivi_floor --out "$OUT/floor_mb3.json" --contexts 32768 --layers 2 --repeats 1 --warmup 0 \
    --arms kivi4-v4-chain > "$OUT/ncu_kivi_mb3.log" 2>&1
  grep -E "kivi_decode_attn|Duration|DRAM Throughput|Registers Per|Achieved Occupancy|Theoretical Occupancy|No Eligible|Block Limit" "$OUT/ncu_kivi_mb3.log" | head -n 30
fi
echo "== done $(since)"
