# Sourced by the GPU jobs: unpack the offline MLX CUDA runtime (two parts; part00 may have been
# staged in /root/stage by an earlier call) and point PYTHONPATH at it. PYTHON=... skips this.
if [ -z "${PYTHON:-}" ] && [ ! -d /opt/mlx/mlx ] && [ -f .gpu/mlx-cuda13-site.tar.xz.part01 ]; then
  p0=/root/stage/mlx-cuda13-site.tar.xz.part00
  [ -f "$p0" ] || p0=.gpu/mlx-cuda13-site.tar.xz.part00
  mkdir -p /opt/mlx && cat "$p0" .gpu/mlx-cuda13-site.tar.xz.part01 | tar xJ -C /opt/mlx || exit 1
fi
[ -d /opt/mlx/mlx ] && [ -z "${PYTHON:-}" ] && export PYTHONPATH=/opt/mlx:$PWD
export PYTHONPATH=${PYTHONPATH:-$PWD}
export PYTHONUNBUFFERED=1

# What a GPU job ran on, into the file $1 (and stdout).
gpu_record_env() {
  {
    date -u
    nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem --format=csv 2>/dev/null
    ${PY:-python3} -c "import mlx.core as mx, sys; print('python', sys.version.split()[0], 'mlx', mx.__version__, mx.default_device(), 'metal', mx.metal.is_available(), 'cuda', mx.cuda.is_available())"
  } 2>&1 | tee "$1"
}

# Nsight Compute over the qmv kernels of one command, if ncu is installed:
#   gpu_ncu_profile PREFIX LIMIT_S [more ncu options] COMMAND...
# writes PREFIX.ncu-rep, its details page (PREFIX-details.txt) and raw metrics (PREFIX-raw.csv).
gpu_ncu_profile() {
  local out=$1 limit=$2 ncu
  shift 2
  ncu=$(command -v ncu || ls /usr/local/cuda*/bin/ncu /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -n 1)
  [ -n "$ncu" ] || { echo "== no Nsight Compute on this host"; return 0; }
  echo "== Nsight Compute ($ncu)"
  timeout "$limit" "$ncu" --kernel-name regex:vqpipe_qmv --section SpeedOfLight \
    --section ComputeWorkloadAnalysis --section MemoryWorkloadAnalysis --section SchedulerStats \
    --section WarpStateStats --section InstructionStats --section Occupancy --section LaunchStats \
    -f -o "$out" "$@" 2>&1 | tail -n 40
  "$ncu" --import "$out.ncu-rep" --page details > "$out-details.txt" 2>&1
  "$ncu" --import "$out.ncu-rep" --page raw --csv > "$out-raw.csv" 2>&1
}
