#!/usr/bin/env bash
# The qmv GPU job: the fused codebook mat-vec's GPU tests (float64 reference sweep, determinism,
# layers, generation on/off, compile count), then bench-qmv, then a summary table.
#
# On the team's NVIDIA host (MLX CUDA backend, offline), after staging the runtime bundle
# (docs/kivi.md, "Running on a GPU"):   bash scripts/gpu_qmv.sh
# Elsewhere (e.g. a Mac with Metal):      PYTHON=.venv/bin/python bash scripts/gpu_qmv.sh
# STEPS picks steps (default "gpu_time tests bench bench_bits cpu_tests"); BENCH_ARGS goes to bench-qmv;
# bench_bits times 2 and 3 bits on three large shapes. gpu_time: the kernel's GPU time per launch
# outside MLX (experiments/qmv_gpu_time.py: CUDA events, copy and plain-read arms in the same
# process) at the Llama-3-8B shapes, 4 bits, M = 1, against revision 6 if vqpipe/qmv_v6.py is there
# (`git show 049c2de:vqpipe/qmv.py > vqpipe/qmv_v6.py`, not committed) and the ablations (TIME_VARIANTS
# overrides the arms); gpu_time_bits: 2/3 bits at M = 1 and 2/3/4 bits at M = 4 at the four shapes
# (BITS_VARIANTS, BITS_CASES); gpu_time_m8: M = 8, with pair tables in registers beside the ring
# (M8_*). profile: Nsight Compute on one launch per variant and case (PROFILE_VARIANTS,
# PROFILE_CASES), if ncu is installed: the report, its details page and its raw metrics as CSV.
# The seventh revision's two device calls: docs/results/2026-12-01-h200-qmv7/README.md.
# Results go to $OUT (default results/gpu_qmv): env.txt, qmv_tests.log, bench.log, bench-qmv.json.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-results/gpu_qmv}
mkdir -p "$OUT"
PY=${PYTHON:-python3}

source scripts/gpu_env.sh
# A fresh PTX cache, so the compile-count test sees only this run's kernels (bench-qmv reuses it).
MLX_PTX_CACHE_DIR=$(mktemp -d)
export MLX_PTX_CACHE_DIR

gpu_record_env "$OUT/env.txt"

t0=$(date +%s)
since() { echo "($(( $(date +%s) - t0 )) s)"; }
STEPS=${STEPS:-gpu_time tests bench bench_bits cpu_tests}
want() { [[ " $STEPS " == *" $1 "* ]]; }
BASE=""
[ -f vqpipe/qmv_v5.py ] && BASE="qmv_v5"
[ -f vqpipe/qmv_v6.py ] && BASE="qmv_v6"

if want profile; then
  echo "== profile $(since)"
  gpu_ncu_profile "$OUT/profile" "${PROFILE_LIMIT:-150}" --section MemoryWorkloadAnalysis_Tables \
    $PY -m experiments.qmv_gpu_time --check-only --inputs 1 --max-pool 2 --out "$OUT/profile-check.json" \
    --variants ${PROFILE_VARIANTS:-$BASE qmv:auto:0} --cases ${PROFILE_CASES:-l3-gateup:4:1 l3-lm_head:4:1}
fi

if want gpu_time; then
  echo "== qmv GPU time outside MLX $(since)"
  timeout "${TIME_LIMIT:-120}" $PY -m experiments.qmv_gpu_time --out "$OUT/gpu-time.json" \
    --variants ${TIME_VARIANTS:-qmv:auto:0 $BASE qmv:auto:0:1 qmv:auto:0:1::2 qmv:auto:0:1:nolut qmv:auto:0:0:nolut qmv:auto:0:0:noload} \
    --cases l3-qkv:4:1 l3-gateup:4:1 l3-down:4:1 l3-lm_head:4:1 ${TIME_ARGS:-} 2>&1 | tee "$OUT/gpu-time.log"
fi

if want gpu_time_bits; then
  echo "== qmv GPU time, 2/3 bits and M > 1 $(since)"
  timeout "${TIME_BITS_LIMIT:-120}" $PY -m experiments.qmv_gpu_time --out "$OUT/gpu-time-bits.json" \
    --variants ${BITS_VARIANTS:-qmv:auto:0 $BASE qmv:0:0:1} --cases ${BITS_CASES:-l3-qkv:3:1 l3-gateup:3:1 \
    l3-down:3:1 l3-lm_head:3:1 l3-qkv:2:1 l3-gateup:2:1 l3-down:2:1 l3-lm_head:2:1 l3-qkv:4:4 l3-gateup:4:4 l3-down:4:4 \
    l3-lm_head:4:4 l3-qkv:3:4 l3-gateup:3:4 l3-down:3:4 l3-lm_head:3:4 l3-qkv:2:4 l3-gateup:2:4 l3-down:2:4 l3-lm_head:2:4} ${TIME_BITS_ARGS:-} 2>&1 | tee "$OUT/gpu-time-bits.log"
fi

if want gpu_time_m8; then
  echo "== qmv GPU time, M = 8 $(since)"
  timeout "${TIME_M8_LIMIT:-120}" $PY -m experiments.qmv_gpu_time --out "$OUT/gpu-time-m8.json" \
    --variants ${M8_VARIANTS:-qmv:auto:0 $BASE qmv:0:0:1 qmv:0:0:0} --cases ${M8_CASES:-l3-qkv:4:8 l3-gateup:4:8 \
    l3-down:4:8 l3-lm_head:4:8 l3-qkv:3:8 l3-gateup:3:8 l3-down:3:8 l3-lm_head:3:8 l3-qkv:2:8 l3-gateup:2:8 l3-down:2:8 \
    l3-lm_head:2:8} 2>&1 | tee "$OUT/gpu-time-m8.log"
fi

if want tests; then
  echo "== qmv GPU tests $(since)"
  timeout "${TEST_LIMIT:-150}" $PY -m pytest -q -ra -p no:cacheprovider --maxfail=10 tests/test_qmv.py -m gpu \
    2>&1 | tee "$OUT/qmv_tests.log" | tail -n 25
fi

if want bench; then
  echo "== bench-qmv $(since)"
  timeout "${BENCH_LIMIT:-120}" $PY -m experiments.bench_qmv --out "$OUT/bench-qmv.json" ${BENCH_ARGS:-} 2>&1 | tee "$OUT/bench.log"
fi

if want bench_bits; then
  for b in 2 3; do
    echo "== bench-qmv --bits $b $(since)"
    timeout "${BITS_LIMIT:-40}" $PY -m experiments.bench_qmv --bits $b --shapes qwen-lm_head qwen-down llama4k-up \
      --modes independent chained --repeats 20 --copy-mib 256 ${BITS_ARGS:-} --out "$OUT/bench-qmv-b$b.json" 2>&1 | tee "$OUT/bench-b$b.log"
  done
fi

if want cpu_tests; then
  echo "== qmv dispatch/validation tests on this host $(since)"
  timeout 60 $PY -m pytest -q -ra -p no:cacheprovider tests/test_qmv.py -m "not gpu" 2>&1 | tee "$OUT/qmv_cpu_tests.log" | tail -n 5
fi

echo "== summary $(since)"
for f in qmv_tests qmv_cpu_tests; do
  [ -f "$OUT/$f.log" ] || continue
  printf '%-14s ' "$f"
  grep -E "(passed|failed|skipped|error).* in [0-9.]+s" "$OUT/$f.log" | tail -n 1
done
for j in "$OUT"/bench-qmv*.json; do [ -f "$j" ] && $PY - "$j" <<'EOF'
import json, sys
d = json.load(open(sys.argv[1]))
print(f"== {sys.argv[1]}: bits {d['config']['bits']}")
copy = d["copy_bandwidth"]["median"]
print(f"backend {d['backend']}  device {d['environment'].get('gpu_name')}  copy {copy / 1e9:.0f} GB/s (read+write)  "
      f"empty call {d['harness_overhead_s']['median'] * 1e6:.1f} us  compiled kernels {d['compiled_kernels']}")
for mode in ("independent", "chained", "isolated"):
    rows = [r for r in d["results"] if r["mode"] == mode]
    if not rows:
        continue
    print(f"-- {mode}: us per call, median [min-max]; GB/s and % of copy for the kernel arms; speedups of {rows[0]['subject']}")
    for r in rows:
        a, g = r["arms"], r["bytes_per_s"]
        cell = lambda k: f"{a[k]['median'] * 1e6:.1f} [{a[k]['min'] * 1e6:.1f}-{a[k]['max'] * 1e6:.1f}]" if k in a else "-"
        ratios = " ".join(f"{k.split(' vs ')[1]}:{c['speedup']:.2f}x" for k, c in r["comparisons"].items())
        kern = [k for k in ("vq-kernel", "vq-core") if k in g]
        bw = " ".join(f"{k} {g[k] / 1e9:.0f} GB/s {g[k] / copy:.0%}" for k in kern)
        print(f"{r['shape']:>14} {r['in_features']:>6}->{r['out_features']:<7} n={a[r['subject']]['n']} "
              f"bf16 {cell('dense-bf16')} | affine4 {cell('affine4')} | ref {cell('vq-ref')} | "
              f"kernel {cell('vq-kernel')} | core {cell('vq-core')} | {bw} | {ratios} | floor {r['noise_floor']:.1%}"
              + (f" | check {r['check']}" if "check" in r else ""))
EOF
done
exit 0
