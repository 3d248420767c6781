#!/usr/bin/env bash
# The seventh KIVI window's GPU job (kernel v4). PART=a: a v4 smoke test (stops here if it fails),
# the KIVI GPU tests in 8 workers (GPUTEST_K), bench-kivi-latency (LAT_ARGS: fp16 SDPA, v3, v4 shapes,
# chained and independent, every context in one interleave). PART=b: Nsight Compute on one launch
# per arm (NCU_ARMS; the probe adds sdpa first, which takes 2 of NCU_COUNT kernels), then end to
# end at the 8B geometry (compiled and eager) with VQPIPE_KIVI_DECODE as exported (the seventh
# window's run b had auto, i.e. v4, as the default), and with v3 too if V3_TOO is set.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-results/gpu_kivi7}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
source scripts/gpu_env.sh
export MLX_PTX_CACHE_DIR=${MLX_PTX_CACHE_DIR:-/root/ptx}
mkdir -p "$MLX_PTX_CACHE_DIR"
gpu_record_env "$OUT/env.txt"
t0=$(date +%s)
since() { echo "($(( $(date +%s) - t0 )) s)"; }
if [ "${PART:-a}" = a ]; then
  echo "== v4 smoke $(since)"
  timeout ${SMOKE_LIMIT:-90} $PY -m pytest -q -x -p no:cacheprovider -m gpu tests/test_kivi_attention.py \
    -k "v4_within and float16-4-32-128-8-4-4133" 2>&1 | tail -n 40 | tee "$OUT/smoke.log"
  grep -q " passed" "$OUT/smoke.log" || { echo "smoke failed $(since)"; exit 1; }
  echo "== GPU tests $(since)"
  timeout ${GPUTEST_LIMIT:-200} $PY -m pytest -q -ra -p no:cacheprovider -m gpu -n 8 --dist load tests/test_kivi_attention.py \
    tests/test_kivi_compiled.py ${GPUTEST_K:+-k "$GPUTEST_K"} 2>&1 | tee "$OUT/gputests.log" | tail -n 30
  echo "== bench-kivi-latency $(since)"
  timeout ${LAT_LIMIT:-200} $PY -m experiments.kivi_latency --out "$OUT/kivi_latency.json" ${LAT_ARGS:-} 2>&1 | tee "$OUT/latency.log"
else
  # Nsight Compute, one launch per kernel at each context (real clocks): device time of fp16 SDPA,
  # v4 and v3 chained, and what limits v4
  NCU=$(command -v ncu || ls /usr/local/cuda*/bin/ncu 2>/dev/null | head -n 1)
  for s in ${NCU_CONTEXTS:-32768 8192}; do
    [ -n "$NCU" ] || break
    echo "== ncu at $s $(since)"
    timeout ${NCU_LIMIT:-60} "$NCU" --clock-control none --section SpeedOfLight --section Occupancy --section LaunchStats \
      --section WarpStateStats --section MemoryWorkloadAnalysis --section SchedulerStats -k regex:"kivi_decode_attn|sdpa" -c ${NCU_COUNT:-8} \
      $PY -m experiments.kivi_floor --out "$OUT/floor_ncu_$s.json" --contexts $s --layers 2 --repeats 1 --warmup 0 \
      --arms ${NCU_ARMS:-kivi4-v4-chain,kivi4-v3-chain} > "$OUT/ncu_$s.log" 2>&1
    grep -E "kivi_decode_attn|sdpa|Duration|DRAM Throughput|Memory Throughput|Compute \(SM\)|Registers Per|Achieved Occupancy|No Eligible|Issued Warp" "$OUT/ncu_$s.log" | head -n 80
  done
  echo "== end to end, VQPIPE_KIVI_DECODE=${VQPIPE_KIVI_DECODE:-default} $(since)"
  timeout ${DEC_LIMIT:-200} $PY -m experiments.bench_kivi_attn --out "$OUT/kivi_decode_v4.json" --parts decode --compiled ${DEC_ARGS:-} 2>&1 | tee "$OUT/decode_v4.log"
  if [ -n "${V3_TOO:-}" ]; then
    echo "== end to end, v3 $(since)"
    VQPIPE_KIVI_DECODE=v3 timeout ${DEC3_LIMIT:-150} $PY -m experiments.bench_kivi_attn --out "$OUT/kivi_decode_v3.json" --parts decode --compiled ${DEC_ARGS:-} 2>&1 | tee "$OUT/decode_v3.log"
  fi
fi
echo "== done $(since)"
