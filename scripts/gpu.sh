#!/usr/bin/env bash
# The GPU host's one entry point: kernel tests, decode and KIVI benchmarks, Nsight profiles and the
# pipeline, each a part named on the command line, in the order given.
#
#   bash scripts/gpu.sh [--out DIR] [--repeats N] [--presets "P ..."] [--tar] PART ... [-- SNAKEMAKE ARGS]
#
#   tests     the GPU tests (pytest -m gpu over tests/), then the tests that run on the default
#             device without the gpu mark (residual rotation, tuning, small arrays, step kernels);
#             GPU_LIMIT / DEVICE_LIMIT (s) bound each
#   decode    decode side by side, split compiled step, P = 512: vqpipe 4-bit, its residual-rotated
#             layout, bf16 and affine 4-bit, per preset (default qwen2.5-0.5b llama3-8b)
#   qmv       the mat-vec kernels alone (experiments.bench_qmv, Llama-3-8B and Qwen shapes)
#   kivi      one KIVI-4 layer's latency at 8k and 32k, bench-kivi, then the KIVI kernel tests
#   ncu       Nsight Compute: the decode step kernel by kernel (experiments.step_kernels), then the
#             mat-vec kernels' sections (needs ncu on the host)
#   pipeline  the Snakefile with config/gpu.yaml (arguments after -- go to snakemake)
#   ext       build vqpipe._ext with its CUDA kernels (nanobind from the carried .whl/), its tests and the
#             trellis kernel's on the GPU, each bad-argument case in a process of its own (a C++
#             backtrace under gdb), the trellis mat-vec against the scalar kernel (bench_trellis_matvec)
#   user      the default user path: vqpipe._ext built (as setup does; carry .whl/), a synthetic
#             qwen2.5-0.5b reservoir made by the stage CLIs,
#             `vqpipe generate` in three fresh processes (the first two under cProfile) beside
#             mlx_lm.generate on mlx_lm.convert's affine 4-bit and on the source; MLX's PTX cache kept
#   ttft      the time before the first token phase by phase (experiments/ttft.py), after a warm-up
#   first     the first token in a fresh process, side by side: `vqpipe generate --max-tokens 1` on the
#             user reservoir beside mlx_lm.generate on affine 4-bit and on the source, interleaved,
#             FIRST_N rounds (default 6) after one warm-up round (MLX's PTX cache filled)
#   prefill   trellis layers at prefill row counts, compiled mat-vec against the dense rebuild
#             (experiments/trellis_prefill.py: time and transient memory per M), then the user
#             reservoir's phases and peak memory with the mat-vec's GPU row limit at 8 and 64,
#             alternating processes (experiments/ttft.py --gpu-max-m), after one warm-up process
#   dense     prefill's dense weights: the extension built, the trellis extension's tests on the GPU
#             (tests/test_trellis_ext.py: mat-vec and decode), then experiments/trellis_prefill.py at
#             M = DENSE_M (default 128 256 512 1024 2048) with the decode arm (ext.trellis_decode +
#             matmul) beside the kernel and the MLX-op decode
#   rowlimit  the mat-vec's GPU row limit on the user reservoir's whole prefill: mat-vec against the
#             dense path per prompt length, interleaved (experiments/row_limit.py)
#   pace      prefill paced block by block against queued at once on the user reservoir: time, peak
#             memory, the same cache (experiments/prefill_pace.py), then `chat` (CHAT_N pairs)
#   pace8b    the same on a llama3-8b-shaped model with random 4-bit codes made on the device (no
#             reservoir file): paced every block (the default's waits there) against queued at once
#   serve     one client: `vqpipe serve` (mlx-lm's batched loop) against the compiled step on the
#             user reservoir, interleaved per prompt (experiments/serve_one_client.py)
#   chat      `vqpipe chat` with the compiled step (--compiled auto) against mlx-lm's loop (--compiled
#             off) on the user reservoir: alternating fresh processes, CHAT_N pairs (default 4) of a piped
#             3-turn conversation, 48 new tokens a turn; each turn's figures and whether the replies match
#   devtests  only the default-device test files of `tests` (DEVICE_LIMIT s)
#   trellis   trellis against scalar codes on the GPU: a synthetic qwen2.5-0.5b quantized both ways
#             (4 bits), whole-model decode interleaved beside mlx-lm on the source and on affine 4-bit
#             (experiments/vq/decode.py --device gpu --affine); the extension must be built (ext)
#
# The MLX CUDA runtime comes from the carried bundle (scripts/gpu_env.sh); PYTHON=... uses another
# interpreter instead. Results go under DIR (default results/gpu), one folder per part, with env.txt;
# --tar packs DIR into DIR.tgz (fewer files to carry back).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=results/gpu REPEATS=6 PRESETS="qwen2.5-0.5b llama3-8b" TAR=0 PARTS=() SNAKE=()
while [ $# -gt 0 ]; do
  case $1 in
    --out) OUT=$2; shift 2 ;;
    --repeats) REPEATS=$2; shift 2 ;;
    --presets) PRESETS=$2; shift 2 ;;
    --tar) TAR=1; shift ;;
    --) shift; SNAKE=("$@"); break ;;
    tests|devtests|decode|qmv|kivi|ncu|pipeline|ext|user|ttft|first|prefill|dense|rowlimit|pace|pace8b|serve|chat|trellis) PARTS+=("$1"); shift ;;
    *) echo "gpu.sh: unknown argument $1 (parts: tests devtests decode qmv kivi ncu pipeline ext user ttft first prefill dense rowlimit pace pace8b serve chat trellis)" >&2; exit 2 ;;
  esac
done
[ ${#PARTS[@]} -gt 0 ] || { sed -n 2,30p "$0"; exit 2; }
source scripts/gpu_env.sh
PY=${PYTHON:-python3}
mkdir -p "$OUT"
gpu_record_env "$OUT/env.txt"
t0=$(date +%s)
since() { echo "($(( $(date +%s) - t0 )) s)"; }
NCU=$(command -v ncu || ls /usr/local/cuda*/bin/ncu /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -n 1)
pt() {  # LOG LIMIT PYTEST-ARGS: a pytest step with a time limit and its own log; never stops the job
  # -v: each test's name and outcome reach the log as it ends, so a run the limit kills still says
  # which tests failed (with -q a killed run left only dots: 2026-12-07, 2 F and 2 E unnamed).
  local log=$1 limit=$2
  shift 2
  timeout "$limit" $PY -m pytest -v -p no:cacheprovider -rfE "$@" > "$log" 2>&1
  grep -E "(FAILED|ERROR) tests/" "$log" | sed 's/^\[gw[0-9]*\] \[ *[0-9]*%\] //' | sort -u | head -n 40
  echo "$(grep -c " PASSED " "$log") passed, $(grep -c " FAILED " "$log") failed, $(grep -c " ERROR " "$log") errors (log: $log)"
  tail -n 3 "$log"
}

part_tests() {
  # The mark-gpu suite first: on an H100 (2026-12-07) 1,581 of its tests took 330 s; the default-device
  # files then passed 14 tests in 150 s (every worker imports transformers and torch there).
  echo "== GPU tests $(since)"
  pt "$1/gpu.log" ${GPU_LIMIT:-600} -m gpu -n 8 --dist load tests/
  part_devtests "$1"
}

texts() {  # the calibration and evaluation texts (Debian packages setup.sh unpacks into .venv/share;
  # carry .venv/share/dict-devil and .venv/share/dict-jargon): test_tune reads them (2026-12-07: its
  # 4 failures and 2 errors on the GPU host were these files missing, nothing of the GPU)
  local share
  share=$($PY -c "import sys; print(sys.prefix)")/share
  for d in .venv/share/dict-*; do
    [ -d "$d" ] && [ ! -d "$share/$(basename "$d")" ] && mkdir -p "$share" && cp -r "$d" "$share/"
  done
  return 0
}

part_devtests() {
  texts
  echo "== tests on the default device $(since)"
  pt "$1/device.log" ${DEVICE_LIMIT:-300} -n 8 --dist load tests/test_residual_rotation.py tests/test_tune.py \
    tests/test_small_arrays.py tests/test_step_kernels.py
}

part_decode() {
  for p in $PRESETS; do
    echo "== decode $p $(since)"
    timeout 300 $PY -m experiments.decode_shapes --preset "$p" --out "$1/$p.json" --prompt-lengths 512 \
      --gen-tokens 32 --repeats "$REPEATS" --bits 4 --residual-bits 4 --split-only --aa-arm vqpipe-b4+s \
      --copy-mib 256 2>&1 | tee "$1/$p.log" | grep -E "^step|decode|floor|vs" | tail -n 30
  done
}

part_qmv() {
  echo "== qmv kernels $(since)"
  timeout 300 $PY -m experiments.bench_qmv --modes independent chained --repeats 20 \
    --shapes qwen-qkv qwen-q/o qwen-gateup qwen-down qwen-lm_head l3-qkv l3-o l3-gateup l3-down l3-lm_head \
    --out "$1/bench-qmv.json" 2>&1 | tee "$1/bench-qmv.log" | tail -n 30
}

part_kivi() {  # the figures first (~95 s on an H100), then the kernel tests (> 250 s there)
  echo "== KIVI-4 layer latency $(since)"
  timeout 200 $PY -m experiments.kivi_latency --out "$1/kivi_latency.json" --contexts 8192,32768 \
    --repeats 15 --warmup 3 2>&1 | tee "$1/kivi_latency.log" | tail -n 30
  echo "== bench-kivi $(since)"
  timeout 300 $PY -m vqpipe bench-kivi --out "$1/kivi_ops.json" 2>&1 | tee "$1/bench-kivi.log" | tail -n 20
  echo "== KIVI kernel tests $(since)"
  MLX_PTX_CACHE_DIR=$(mktemp -d) pt "$1/kernels.log" 420 --maxfail=10 -m gpu tests/test_kivi_kernels.py tests/test_kivi_attention.py
}

part_ncu() {
  [ -n "$NCU" ] || { echo "== no Nsight Compute on this host"; return 0; }
  for arm in affine4+s vqpipe-b4+s bf16+s; do
    local tag=qwen-${arm//+/_}
    echo "== step kernels qwen2.5-0.5b $arm $(since)"
    timeout 120 "$NCU" --profile-from-start off --clock-control none --cache-control none \
      --metrics gpu__time_duration.sum --print-kernel-base function --csv --log-file "$1/k-$tag.csv" \
      $PY -m experiments.step_kernels --preset qwen2.5-0.5b --arm "$arm" --steps 3 > "$1/k-$tag.log" 2>&1
    $PY -m experiments.step_kernels --summarize "$1/k-$tag.csv" --steps 3 --out "$1/k-$tag.json" 2>&1 | head -n 25
  done
  echo "== mat-vec kernel sections, qwen2.5-0.5b $(since)"
  timeout 120 "$NCU" --profile-from-start off --clock-control none --cache-control none -k regex:vqpipe_qmv -c 8 \
    --section SpeedOfLight --section MemoryWorkloadAnalysis --section Occupancy --section LaunchStats --section WarpStateStats \
    $PY -m experiments.step_kernels --preset qwen2.5-0.5b --arm vqpipe-b4+s --steps 1 > "$1/ncu_qmv.log" 2>&1
  grep -E "custom_kernel_vqpipe|Duration|DRAM Throughput|Registers Per|Achieved Occupancy|Memory Throughput" "$1/ncu_qmv.log" \
    | sed 's/(const.*)//' | head -n 60
}

part_pipeline() {
  # The host has no snakemake and no network: carry .whl/ (scripts/gpu_wheels.sh builds it).
  local smk=/opt/snakemake
  if [ ! -d "$smk/snakemake" ]; then
    [ -d .whl ] || { echo "gpu.sh pipeline: no .whl/ (carry it; scripts/gpu_wheels.sh builds it)" >&2; return 2; }
    $PY -m pip install -q --no-index --no-deps --target "$smk" .whl/*.whl 2>/dev/null \
      || for w in .whl/*.whl; do $PY -m zipfile -e "$w" "$smk" || return 2; done
  fi
  # The rules run `python -m vqpipe ...`; the host may have only python3.
  command -v python > /dev/null || { mkdir -p /opt/pybin && ln -sf "$(command -v python3)" /opt/pybin/python; export PATH=/opt/pybin:$PATH; }
  # One job at a time: the benchmarks time one GPU, which a concurrent job would disturb.
  PYTHONPATH=$PYTHONPATH:$smk $PY -m snakemake --cores 1 --scheduler greedy --configfile config/gpu.yaml \
    --rerun-incomplete --keep-going "${SNAKE[@]}" 2>&1 | tee "$1/snakemake.log" | tail -n 30
}

build_ext() {  # vqpipe._ext with its CUDA kernels (nanobind from the carried .whl/), once per host
  $PY -c "from vqpipe import _ext" 2> /dev/null && return 0
  echo "== build vqpipe._ext with CUDA $(since)"
  mkdir -p /tmp/site
  $PY -m pip install -q --no-index --no-deps --target /tmp/site .whl/nanobind-*.whl 2>&1 | tail -n 3
  PYTHONPATH=/tmp/site:$PYTHONPATH VQPIPE_EXT_BUILD=/tmp/ext_build bash scripts/build_ext.sh "$(command -v $PY)" 2>&1 | tail -n 5
  $PY -c "from vqpipe.kernels import ext; m = ext.module(); print('ext', m is not None, 'gpu', m and m.has_gpu())"
}

part_ext() {
  build_ext
  echo "== bad arguments, one process each $(since)"
  $PY experiments/ext_bad_args.py --each 2>&1 | tee "$1/bad_args.log" | tail -n 20
  if command -v gdb > /dev/null; then
    timeout 120 gdb -q -batch -ex run -ex bt -ex "info registers rip" --args $PY experiments/ext_bad_args.py \
      > "$1/gdb.log" 2>&1
    grep -E "^#|signal|rip" "$1/gdb.log" | head -n 40
  else
    echo "(no gdb on this host)"
  fi
  echo "== tests/test_ext.py and the trellis kernels on the GPU $(since)"
  pt "$1/test_ext.log" 300 -p no:randomly -n 8 tests/test_ext.py tests/test_trellis_ext.py
  echo "== trellis mat-vec (csrc/trellis.cu) against the scalar kernel $(since)"
  for b in 2 4; do
    timeout 90 $PY -m experiments.bench_trellis_matvec --device gpu --bits $b --inputs 24 --reps 5 \
      --shapes 896x896 4864x896 896x4864 4096x4096 14336x4096 4096x14336 --out "$1/trellis_gpu_b$b.json" 2>&1 \
      | tee "$1/trellis_gpu_b$b.log" | tail -n 8
  done
}

part_trellis() {
  local d=/tmp/trellis
  build_ext
  echo "== a synthetic qwen2.5-0.5b, trellis and scalar codes at 4 bits $(since)"
  [ -d $d/src ] || $PY -m vqpipe download --source synth:qwen2.5-0.5b --out $d/src 2>&1 | tail -n 1
  for codes in trellis scalar; do
    [ -d $d/r-$codes ] && continue
    $PY -m vqpipe quantize --source $d/src --out $d/q-$codes --bits 4 --codes $codes 2>&1 | tail -n 1
    $PY -m vqpipe pack --quantized $d/q-$codes --out $d/r-$codes --persist-rotation off 2>&1 | tail -n 1
  done
  echo "== whole-model decode, interleaved $(since)"
  timeout 240 $PY -m experiments.vq.decode --trellis $d/r-trellis --scalar $d/r-scalar --source $d/src --device gpu \
    --affine --trials 10 --tokens 32 --out "$1/decode.json" 2>&1 | tee "$1/decode.log" | tail -n 8
}

USER_DIR=/tmp/user
user_reservoir() {  # a synthetic qwen2.5-0.5b reservoir and mlx_lm.convert's affine 4-bit, once per host
  local d=$USER_DIR
  [ -f "$d/affine4/config.json" ] && return 0
  rm -rf "$d" && mkdir -p "$d"
  build_ext  # without it the trellis encode is numpy's: 23 of qwen's 169 layers in 300 s (2026-12-07)
  echo "== a synthetic qwen2.5-0.5b reservoir through the stage CLIs $(since)"
  $PY -m vqpipe download --source synth:qwen2.5-0.5b --out "$d/src" 2>&1 | tail -n 1
  $PY -m vqpipe quantize --source "$d/src" --out "$d/q" --bits 4 2>&1 | tail -n 1
  $PY -m vqpipe pack --quantized "$d/q" --out "$d/r" --persist-rotation off 2>&1 | tail -n 1
  $PY -m mlx_lm convert --hf-path "$d/src" --mlx-path "$d/affine4" -q --q-bits 4 --q-group-size 64 2>&1 | tail -n 1
}

part_ttft() {  # phase by phase before the first token (experiments/ttft.py), after one warm-up process
  user_reservoir
  echo "== warm-up generate (fills MLX's PTX cache) $(since)"
  timeout 200 $PY -m vqpipe generate --model $USER_DIR/r --prompt "warm up" --max-tokens 4 2>&1 | grep -E "Prompt:|Generation:"
  for i in 1 2; do
    for mode in split eager; do
      echo "== ttft $mode, process $i $(since)"
      timeout 120 $PY -m experiments.ttft --model $USER_DIR/r --mode $mode 2>&1 | tee -a "$1/ttft.jsonl" | grep "{"
    done
  done
}

part_first() {  # process start to exit with one new token: what a user waits for the first token
  local d=$USER_DIR prompt="Write a short story about a lighthouse keeper who finds a message in a bottle."
  user_reservoir
  for i in $(seq 0 "${FIRST_N:-6}"); do  # round 0 is the warm-up
    for arm in vqpipe affine4 src; do
      local t=$(date +%s.%N) cmd=(-m mlx_lm generate --model "$d/$arm")
      [ $arm = vqpipe ] && cmd=(-m vqpipe generate --model "$d/r")
      timeout 200 $PY "${cmd[@]}" --prompt "$prompt" --max-tokens 1 > "$1/last.log" 2>&1
      local rc=$?
      echo "{\"round\": $i, \"arm\": \"$arm\", \"wall_s\": $($PY -c "print(round($(date +%s.%N) - $t, 3))"), \"rc\": $rc}" \
        | tee -a "$1/first.jsonl"
    done
  done
  $PY - "$1/first.jsonl" <<'EOF2'
import json, statistics, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
by = {}
for r in rows:
    if r["round"] > 0:
        by.setdefault(r["arm"], []).append(r["wall_s"])
for arm, w in by.items():
    print(f"{arm}: median {statistics.median(w):.2f} s [{min(w):.2f}-{max(w):.2f}] n={len(w)}")
v = [r["wall_s"] for r in rows if r["round"] > 0 and r["arm"] == "vqpipe"]
a = [r["wall_s"] for r in rows if r["round"] > 0 and r["arm"] == "affine4"]
ratios = sorted(x / y for x, y in zip(v, a))
print(f"vqpipe / affine4 per round: median {statistics.median(ratios):.2f} [{ratios[0]:.2f}-{ratios[-1]:.2f}]")
EOF2
}

part_prefill() {
  build_ext
  echo "== trellis layers at prefill sizes, kernel against dense $(since)"
  timeout 150 $PY -m experiments.trellis_prefill --out "$1/trellis_prefill.json" 2>&1 | tee "$1/trellis_prefill.log" | tail -n 30
  user_reservoir
  echo "== phases and peak memory, GPU row limit 8 against 64 (first process: warm-up) $(since)"
  for i in 0 1 2 3; do
    for m in 8 64; do
      timeout 100 $PY -m experiments.ttft --model $USER_DIR/r --gpu-max-m $m 2>&1 | tee -a "$1/ttft.jsonl" | grep "{" | cut -c1-600
    done
  done
}

part_dense() {
  build_ext
  echo "== the trellis extension's tests on the GPU $(since)"
  pt "$1/test_trellis_ext.log" 200 -p no:randomly -n 4 tests/test_trellis_ext.py
  echo "== trellis layers at prefill sizes: kernel, MLX-op decode, extension decode $(since)"
  timeout 200 $PY -m experiments.trellis_prefill --m ${DENSE_M:-128 256 512 1024 2048} --reps 5 \
    --out "$1/trellis_prefill.json" 2>&1 | tee "$1/trellis_prefill.log" | tail -n 40
}

part_rowlimit() {
  user_reservoir
  echo "== the GPU row limit on the whole prefill: mat-vec against dense $(since)"
  timeout ${ROWLIMIT_LIMIT:-200} $PY -m experiments.row_limit --model $USER_DIR/r --lengths 9 17 33 49 65 97 129 193 257 \
    --out "$1/row_limit.json" 2>&1 | tee "$1/row_limit.log" | tail -n 12
}

part_pace() {
  user_reservoir
  echo "== prefill paced against queued at once $(since)"
  timeout ${PACE_LIMIT:-200} $PY -m experiments.prefill_pace --model $USER_DIR/r --lengths 65 129 257 1025 --paces ${PACES:-1 2 4 8} --auto \
    --out "$1/prefill_pace.json" 2>&1 | tee "$1/prefill_pace.log" | grep -v Warning | tail -n 8
  part_chat "$1"
}

part_pace8b() {
  build_ext
  echo "== prefill paced against queued at once, llama3-8b shapes $(since)"
  timeout ${PACE_LIMIT:-300} $PY -m experiments.prefill_pace --preset llama3-8b --lengths 129 257 1025 --paces 1 --auto \
    --prompts ${PACE_PROMPTS:-20} --out "$1/prefill_pace.json" 2>&1 | tee "$1/prefill_pace.log" | grep -v Warning | tail -n 8
}

part_serve() {
  user_reservoir
  echo "== one client: serve against the compiled step $(since)"
  timeout ${SERVE_LIMIT:-200} $PY -m experiments.serve_one_client --model $USER_DIR/r --prompts 20 --max-tokens 128 \
    --out "$1/serve.json" 2>&1 | grep -v "POST /v1" | tee "$1/serve.log" | tail -n 25
}

part_chat() {
  user_reservoir
  local turns=$'Name three rivers in Europe.\nWhich of them is the longest?\nWrite one sentence about it.\n'
  echo "== warm-up chat (fills MLX's PTX cache) $(since)"
  printf 'hello\n' | timeout 200 $PY -m vqpipe chat --model $USER_DIR/r --max-tokens 8 > /dev/null 2>&1
  for i in $(seq 1 ${CHAT_N:-4}); do
    for mode in auto off; do
      echo "== chat --compiled $mode, pair $i $(since)"
      printf '%s' "$turns" | timeout 200 $PY -m vqpipe chat --model $USER_DIR/r --max-tokens 48 --compiled $mode \
        > "$1/chat_${mode}_$i.out" 2> "$1/chat_${mode}_$i.err"
      grep -E "^\[" "$1/chat_${mode}_$i.err"
    done
    cmp -s "$1/chat_auto_$i.out" "$1/chat_off_$i.out" && echo "pair $i: the same replies" || echo "pair $i: replies differ"
  done
}

part_user() {
  local d=$USER_DIR prompt="Write a short story about a lighthouse keeper who finds a message in a bottle."
  user_reservoir
  echo "PTX cache files before: $(ls /tmp/mlx/*/ptx 2>/dev/null | wc -l)"
  for i in 1 2 3; do
    echo "== vqpipe generate, process $i $(since)"
    local prof=()
    [ $i -le 2 ] && prof=(-m cProfile -o "$1/generate$i.prof")
    local t=$(date +%s.%N)
    timeout 300 $PY "${prof[@]}" -m vqpipe generate --model "$d/r" --prompt "$prompt" --max-tokens 128 \
      > "$1/generate$i.log" 2>&1
    echo "wall $($PY -c "print(round($(date +%s.%N) - $t, 2))") s; PTX cache files: $(ls /tmp/mlx/*/ptx 2>/dev/null | wc -l)"
    grep -E "Prompt:|Generation:|Peak" "$1/generate$i.log"
    for m in affine4 src; do
      t=$(date +%s.%N)
      timeout 120 $PY -m mlx_lm generate --model "$d/$m" --prompt "$prompt" --max-tokens 128 > "$1/mlx_lm_$m$i.log" 2>&1
      echo "mlx_lm.generate $m: wall $($PY -c "print(round($(date +%s.%N) - $t, 2))") s; $(grep -E 'Prompt:|Generation:' "$1/mlx_lm_$m$i.log" | tr '\n' ' ')"
    done
  done
  for i in 1 2; do
    echo "== profile of process $i (cumulative, top 30)"
    $PY -c "import pstats; pstats.Stats('$1/generate$i.prof').sort_stats('cumulative').print_stats(30)" \
      2>&1 | grep -E "^ +[0-9]" | head -n 30 | cut -c1-160
  done
}

for part in "${PARTS[@]}"; do
  mkdir -p "$OUT/$part"
  "part_$part" "$OUT/$part"
done
if [ "$TAR" = 1 ]; then
  tar czf "$OUT.tgz" -C "$(dirname "$OUT")" "$(basename "$OUT")" && rm -rf "$OUT"
fi
echo "== done $(since)"
