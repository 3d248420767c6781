#!/usr/bin/env bash
# The pipeline on the offline GPU host, through the same Snakefile as everywhere (config/gpu.yaml):
# download -> quantize -> pack -> validate -> benchmarks -> report, with the rules' own commands.
# The host has no snakemake and no network: carry .whl/ (scripts/gpu_wheels.sh builds it) and the
# MLX CUDA runtime (.gpu/, ../shared/gpu/README.md); this installs both under /opt and runs
# snakemake. Extra arguments go to snakemake (targets, -n, --forcerun ...).
#
#   bash scripts/gpu_pipeline.sh                       # the whole GPU config
#   bash scripts/gpu_pipeline.sh results/report/index.html
#   CONFIG=config/ci.yaml bash scripts/gpu_pipeline.sh    # the small CI pipeline (plumbing check)
set -uo pipefail
cd "$(dirname "$0")/.."
source scripts/gpu_env.sh # MLX on PYTHONPATH
SMK=/opt/snakemake
if [ ! -d "$SMK/snakemake" ]; then
  [ -d .whl ] || { echo "gpu_pipeline: no .whl/ (carry it; scripts/gpu_wheels.sh builds it)" >&2; exit 2; }
  python3 -m pip install -q --no-index --no-deps --target "$SMK" .whl/*.whl 2>/dev/null \
    || for w in .whl/*.whl; do python3 -m zipfile -e "$w" "$SMK" || exit 2; done
fi
export PYTHONPATH=$PYTHONPATH:$SMK
# The rules run `python -m vqpipe ...`; the host may have only python3.
command -v python > /dev/null || { mkdir -p /opt/pybin && ln -sf "$(command -v python3)" /opt/pybin/python; export PATH=/opt/pybin:$PATH; }
# One job at a time by default: the benchmarks time one GPU, which a concurrent job would disturb.
python3 -m snakemake --cores "${CORES:-1}" --scheduler greedy --configfile "${CONFIG:-config/gpu.yaml}" \
  --rerun-incomplete --keep-going "$@"
