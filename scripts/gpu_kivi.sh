#!/usr/bin/env bash
# The KIVI GPU job: kernel tests (bit-exactness sweep, half-even, compile count), the KIVI cache and
# quantizer tests on the GPU, kernels-on/off generation for the synthetic presets, and bench-kivi.
#
# On the team's NVIDIA host (MLX CUDA backend, offline), after staging the runtime bundle
# (docs/kivi.md, "Running on a GPU"):   bash scripts/gpu_kivi.sh
# Elsewhere (e.g. a Mac with Metal):      PYTHON=.venv/bin/python bash scripts/gpu_kivi.sh
# STEPS picks steps (default "kernels bench generation cpu_suite"; "nvrtc": experiments/nvrtc.py and its
# callers; the packed cache's steps are
# "attn", its kernel tests, and "bench_attn", bench-kivi-attn with ATTN_ARGS, or its parts one
# process each: "attn_op", "attn_memory", "attn_decode"; "pick_shape" exports the fastest v3 launch
# shapes of attn_op's run and "attn_op2" runs the op part again (OP2_ARGS) with them; the launch-cost
# probe "floor" and, where installed, "nsys" / "ncu" on it); BENCH_ARGS goes to bench-kivi.
# Every kernel layout (kernels.LAYOUTS: "vec", the default, and "warp"; vqpipe/kivi/kernels.py) is
# tested bit-exact in the kernels step and timed side by side in the bench step (BENCH_LAYOUTS,
# default "vec warp"; empty: only the current layout). KERNELS_K narrows the kernels step (pytest -k;
# default "not generation"; e.g. "vec and not generation" for one layout alone). The generation step
# uses the current layout (VQPIPE_KIVI_LAYOUT).
# ATTN_K narrows the packed cache's kernel tests (pytest -k).
# Results go to $OUT (default results/gpu_kivi): env.txt, one log per step, kivi_ops.json; a summary
# prints last.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-results/gpu_kivi}
mkdir -p "$OUT"
PY=${PYTHON:-python3}

source scripts/gpu_env.sh
# A fresh PTX cache (unless given), so the compile-count test sees only this run's kernels.
MLX_PTX_CACHE_DIR=${MLX_PTX_CACHE_DIR:-$(mktemp -d)}
export MLX_PTX_CACHE_DIR

gpu_record_env "$OUT/env.txt"

t0=$(date +%s)
pt() {  # a pytest step with a time limit and its own log; never stops the job
  local name=$1 limit=$2
  shift 2
  timeout "$limit" $PY -m pytest -q -ra -p no:cacheprovider "$@" 2>&1 | tee "$OUT/$name.log" | tail -n 15
}
since() { echo "($(( $(date +%s) - t0 )) s)"; }
STEPS=${STEPS:-kernels bench generation cpu_suite}
want() { [[ " $STEPS " == *" $1 "* ]]; }

want kernels && echo "== kernels: bit-exact sweep, half to even, compile count; every layout $(since)" &&
pt kernels 420 --maxfail=10 tests/test_kivi_kernels.py -m gpu -k "${KERNELS_K:-not generation}"

BENCH_LAYOUTS=${BENCH_LAYOUTS-vec warp}
if want bench; then
  echo "== bench-kivi $(since)"
  timeout 300 $PY -m vqpipe bench-kivi --out "$OUT/kivi_ops.json" ${BENCH_LAYOUTS:+--layouts $BENCH_LAYOUTS} ${BENCH_ARGS:-} 2>&1 | tee "$OUT/bench.log"
fi

want generation && echo "== generation, kernels on vs off, synthetic presets $(since)" &&
pt generation 240 --maxfail=3 tests/test_kivi_kernels.py -m gpu -k generation

# experiments/nvrtc.py and both of its callers: its tests (the GPU one launches a cubin through
# cuda_time's driver calls and PTX through mx.fast.precompiled_cuda_kernel), the qmv harness's
# tests, and a short run of the qmv GPU-time harness itself (QMV_ARGS).
if want nvrtc; then
  echo "== nvrtc: tests, qmv GPU-time harness $(since)"
  pt nvrtc 120 tests/test_nvrtc.py tests/test_qmv_gpu_time.py
  timeout ${QMV_LIMIT:-90} $PY -m experiments.qmv_gpu_time --out "$OUT/qmv_gpu_time.json" \
    ${QMV_ARGS:---cases qwen-gateup:4:1 --variants qmv:auto:0 --repeats 5 --warmup 1} 2>&1 | tail -n 8
fi

want attn && echo "== packed cache: decode-attention kernel tests $(since)" &&
pt attn ${ATTN_TEST_LIMIT:-300} --maxfail=5 tests/test_kivi_attention.py -m gpu ${ATTN_K:+-k "$ATTN_K"}

if want bench_attn; then
  echo "== bench-kivi-attn $(since)"
  timeout ${ATTN_LIMIT:-420} $PY -m experiments.bench_kivi_attn --out "$OUT/kivi_attn.json" ${ATTN_ARGS:-} 2>&1 | tee "$OUT/bench_attn.log"
fi

# The packed cache's benchmark in three processes, each under its own limit, so one part that runs
# long or fails leaves the others' figures: op (OP_ARGS), memory (MEM_ARGS), decode (DEC_ARGS; its
# Amdahl prediction reads the op part's rows).
if want attn_op; then
  echo "== bench-kivi-attn op $(since)"
  timeout ${OP_LIMIT:-170} $PY -m experiments.bench_kivi_attn --out "$OUT/kivi_attn_op.json" --parts op ${OP_ARGS:-} 2>&1
fi
# The fastest v3 launch shape per bit width in the op part's JSON (its largest context), exported as
# VQPIPE_KIVI_V3_SHAPE<bits> for the steps after it (decode_kernel.V3_SHAPES).
if want pick_shape && [ -f "$OUT/kivi_attn_op.json" ]; then
  echo "== pick the v3 launch shape $(since)"
  eval "$($PY - "$OUT/kivi_attn_op.json" <<'EOF'
import json, re, sys
row = max(json.load(open(sys.argv[1]))["op"], key=lambda r: r["S"])
for bits in (4, 2):
    arms = {k: a["median"] for k, a in row["arms"].items() if re.fullmatch(rf"kivi{bits}:v3:w\d+c\d+pf\dmb\d+", k)}
    if arms:
        best = min(arms, key=arms.get)
        w, c, pf, mb = re.fullmatch(r"kivi\d:v3:w(\d+)c(\d+)pf(\d)mb(\d+)", best).groups()
        print(f"export VQPIPE_KIVI_V3_SHAPE{bits}={w}x{c}:pf{pf}:mb{mb}")
EOF
)"
  env | grep VQPIPE_KIVI_V3_SHAPE | tee "$OUT/picked_shape.txt"
fi
# A second op run (OP2_ARGS) after the pick, so its default arms use the picked shapes.
if want attn_op2; then
  echo "== bench-kivi-attn op, picked shapes $(since)"
  timeout ${OP2_LIMIT:-120} $PY -m experiments.bench_kivi_attn --out "$OUT/kivi_attn_op2.json" --parts op ${OP2_ARGS:-} 2>&1
fi
if want attn_memory; then
  echo "== bench-kivi-attn memory $(since)"
  timeout ${MEM_LIMIT:-110} $PY -m experiments.bench_kivi_attn --out "$OUT/kivi_attn_memory.json" --parts memory ${MEM_ARGS:-} 2>&1
fi
if want attn_decode; then
  echo "== bench-kivi-attn decode $(since)"
  timeout ${DEC_LIMIT:-150} $PY -m experiments.bench_kivi_attn --out "$OUT/kivi_attn_decode.json" --parts decode \
    $(for f in kivi_attn_op2.json kivi_attn_op.json; do [ -f "$OUT/$f" ] && echo --op-from "$OUT/$f" && break; done) ${DEC_ARGS:-} 2>&1
fi

# The launch-cost probe (experiments/kivi_floor.py; FLOOR_ARGS), then, where the host has
# them, the same probe under Nsight Systems (CUDA API and NVTX ranges, kernel durations; NSYS_ARGS)
# and one decode-kernel launch under Nsight Compute (NCU_ARGS).
if want floor; then
  echo "== bench-kivi-floor $(since)"
  timeout ${FLOOR_LIMIT:-90} $PY -m experiments.kivi_floor --out "$OUT/kivi_floor.json" ${FLOOR_ARGS:-} 2>&1
fi
if want nsys; then
  echo "== nsys $(since)"
  if command -v nsys >/dev/null; then
    timeout ${NSYS_LIMIT:-60} nsys profile -t cuda,nvtx -s none --cpuctxsw=none -f true -o "$OUT/floor_nsys" \
      $PY -m experiments.kivi_floor --out "$OUT/kivi_floor_nsys.json" ${NSYS_ARGS:---contexts 32768 --repeats 5 --warmup 2 --arms sdpa,noop1,noop11-float3,noop11,kivi4-float3,kivi4} >"$OUT/nsys_run.log" 2>&1
    timeout ${NSYS_STATS_LIMIT:-60} nsys stats -q --report cuda_api_sum,cuda_gpu_kern_sum,nvtx_sum --format csv -o "$OUT/nsys" "$OUT/floor_nsys.nsys-rep" >/dev/null 2>&1
    ls "$OUT" | grep nsys
  else
    echo "no nsys on this host ($(ls -d /usr/local/cuda*/bin 2>/dev/null | tr '\n' ' '))"
  fi
fi
if want ncu; then
  echo "== ncu $(since)"
  if command -v ncu >/dev/null; then
    timeout ${NCU_LIMIT:-60} ncu --section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats \
      --section MemoryWorkloadAnalysis --section SchedulerStats -k regex:kivi_decode_attn -c 1 \
      $PY -m experiments.kivi_floor --out "$OUT/kivi_floor_ncu.json" ${NCU_ARGS:---contexts 32768 --layers 2 --repeats 1 --warmup 0 --arms sdpa,kivi4} \
      >"$OUT/ncu.log" 2>&1
    tail -n 80 "$OUT/ncu.log"
  else
    echo "no ncu on this host"
  fi
fi

# The sixth window's steps. "latency": bench-kivi-latency (experiments/kivi_latency.py; LAT_ARGS),
# every context's arms in one interleave, then the same contexts one after another (LATSEQ_ARGS, the
# old probe's order, to tell which fp16 32k baseline is right); "pick_latency" exports the v3 shape
# per bit width whose chained arm is fastest summed over the contexts; "compiled_decode": end to end
# with the compiled step (DEC_ARGS2); "gputests": the KIVI GPU tests in 8 xdist workers (GPUTEST_LIMIT).
if want latency; then
  echo "== bench-kivi-latency, contexts interleaved $(since)"
  timeout ${LAT_LIMIT:-150} $PY -m experiments.kivi_latency --out "$OUT/kivi_latency.json" ${LAT_ARGS:-} 2>&1 | tee "$OUT/latency.log"
  [ -n "${LATSEQ_ARGS:-}" ] && echo "== bench-kivi-latency, contexts in sequence $(since)" &&
    timeout ${LATSEQ_LIMIT:-60} $PY -m experiments.kivi_latency --out "$OUT/kivi_latency_seq.json" --sequential $LATSEQ_ARGS 2>&1 | tee "$OUT/latency_seq.log"
fi
if want pick_latency && [ -f "$OUT/kivi_latency.json" ]; then
  echo "== pick the v3 launch shape from the chained arms $(since)"
  eval "$($PY - "$OUT/kivi_latency.json" <<'EOF2'
import json, re, sys
rows = json.load(open(sys.argv[1]))["rows"]
for bits in (4, 2):
    tot = {}
    for row in rows:
        for k, a in row["arms"].items():
            m = re.fullmatch(rf"kivi{bits}-chain@(\S+)", k)
            if m:
                tot.setdefault(m.group(1), []).append(a["total"]["median"] / row["arms"]["sdpa-vchain"]["total"]["median"])
    full = {k: sum(v) for k, v in tot.items() if len(v) == len(rows)}
    if full:
        print(f"export VQPIPE_KIVI_V3_SHAPE{bits}={min(full, key=full.get)}")
EOF2
)"
  env | grep VQPIPE_KIVI_V3_SHAPE | tee "$OUT/picked_shape.txt"
fi
if want compiled_decode; then
  echo "== end to end, eager and compiled $(since)"
  timeout ${DEC2_LIMIT:-200} $PY -m experiments.bench_kivi_attn --out "$OUT/kivi_decode.json" --parts decode --compiled ${DEC_ARGS2:-} 2>&1 | tee "$OUT/decode.log"
fi
if want gputests; then
  echo "== KIVI GPU tests, 8 workers $(since)"
  timeout ${GPUTEST_LIMIT:-240} $PY -m pytest -q -ra -p no:cacheprovider -m gpu -n 8 --dist load tests/test_kivi_attention.py \
    tests/test_kivi_compiled.py tests/test_kivi_kernels.py ${GPUTEST_K:+-k "$GPUTEST_K"} 2>&1 | tee "$OUT/gputests.log" | tail -n 25
fi

want cpu_suite && echo "== quantizer, cache and dispatch tests on this device (kernels on by default) $(since)" &&
pt cpu_suite 120 tests/test_kivi_quant.py tests/test_kivi_cache.py tests/test_kivi_kernels.py -m "not gpu"

echo "== summary $(since)"
for f in kernels generation nvrtc attn gputests cpu_suite; do
  [ -f "$OUT/$f.log" ] || continue
  printf '%-10s ' "$f"
  grep -E "^[0-9]+ (passed|failed)|(passed|failed|skipped|error).* in [0-9.]+s" "$OUT/$f.log" | tail -n 1
done
[ -f "$OUT/kivi_ops.json" ] && $PY - "$OUT/kivi_ops.json" <<'EOF'
import json, sys
d = json.load(open(sys.argv[1]))
copy = d["copy_bandwidth"]["median"]
print(f"backend {d['backend']}  device {d['environment'].get('gpu_name')}  copy {copy / 1e9:.0f} GB/s (read+write)  "
      f"empty call {d['harness_overhead_s']['median'] * 1e6:.1f} us")
print(f"{'S':>6} {'kind':>6} {'mode':>8} {'ref med/min/max us':>24} {'kernel med/min/max us':>24} {'speedup':>8} {'floor':>6} {'GB/s':>6} {'%copy':>6} M4")
for r in d["results"]:
    a = r["arms"]
    fmt = lambda s: f"{s['median'] * 1e6:.1f}/{s['min'] * 1e6:.1f}/{s['max'] * 1e6:.1f}"
    k = a.get("kernel")
    row = f"{r['S']:>6} {r['kind']:>6} {r['mode']:>8} {fmt(a['reference']):>24} {fmt(k) if k else '-':>24}"
    if k:
        floor = max(r["noise_floor"]["reference"], r["noise_floor"]["kernel"])
        row += f" {r['speedup']:>7.2f}x {floor:>6.1%} {r['kernel_bytes_per_s'] / 1e9:>6.0f} {r['fraction_of_copy_bandwidth']:>6.1%}"
        if "m4_speedup" in r:
            row += f" {'beats' if r['beats_m4'] else 'MISSES'} {r['m4_speedup']}x"
    print(row)
    for lay, c in r.get("layouts", {}).items():  # --layouts: every layout's own arm, same run
        arm = a["kernel" if lay == r["kernel_layout"] else "kernel:" + lay]
        floor = max(r["noise_floor"]["reference"], r["noise_floor"]["kernel" if lay == r["kernel_layout"] else "kernel:" + lay])
        line = (f"{'':>6} {'':>6} {'layout':>8} {lay:>24} {fmt(arm):>24} {c['speedup']:>7.2f}x {floor:>6.1%} "
                f"{c['kernel_bytes_per_s'] / 1e9:>6.0f} {c['fraction_of_copy_bandwidth']:>6.1%}")
        if "m4_speedup" in c:
            line += f" {'beats' if c['beats_m4'] else 'MISSES'} {c['m4_speedup']}x"
        if c.get("outputs_equal") is False:
            line += "  OUTPUTS DIFFER"
        print(line)
    if "build" in r:  # host time to build the step's graph, per flush (no evaluation)
        print(f"{'':>6} {'':>6} {'build':>8} " + ", ".join(f"{k} {v['median'] * 1e6:.1f} us" for k, v in r["build"].items()))
EOF
exit 0
