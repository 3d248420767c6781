#!/usr/bin/env bash
# Snakemake for the offline GPU host, as wheels in .whl/ (git-ignored, ~10 MiB), carried to it the
# way the MLX runtime is (`scripts/gpu.sh pipeline` installs them there). The host runs CPython 3.12
# on x86-64; this machine may run another Python, so compiled wheels are fetched for cp312 and
# pure-Python ones (some exist only as sdists on the index) are built here.
#
#   bash scripts/gpu_wheels.sh          # after `make setup` (reads the versions .venv pins)
#
# pulp is left out: it only serves snakemake's ILP scheduler, and bundles a 20 MiB solver;
# the GPU runs use --scheduler greedy.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
OUT=${OUT:-.whl}
mkdir -p "$OUT"
# snakemake's dependency closure, at the versions installed in .venv, markers evaluated for 3.12.
reqs=$($PY - <<'EOF'
import importlib.metadata as md
from packaging.requirements import Requirement

env = {"python_version": "3.12", "python_full_version": "3.12.0", "sys_platform": "linux",
       "platform_system": "Linux", "platform_machine": "x86_64", "implementation_name": "cpython",
       "platform_python_implementation": "CPython", "os_name": "posix", "extra": ""}
seen, todo = {}, ["snakemake"]
while todo:
    name = todo.pop()
    key = name.lower().replace("_", "-")
    if key in seen or key == "pulp":
        continue
    dist = md.distribution(name)
    seen[key] = f"{dist.metadata['Name']}=={dist.version}"
    for spec in dist.requires or []:
        req = Requirement(spec)
        if req.marker is None or req.marker.evaluate(env):
            todo.append(req.name)
print("\n".join(sorted(seen.values())))
EOF
)
for r in $reqs; do
  $PY -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp --abi cp312 \
      --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 \
      --platform any -d "$OUT" "$r" 2>/dev/null \
    || $PY -m pip wheel -q --no-deps -w "$OUT" "$r"
done
ls "$OUT" | wc -l
du -sh "$OUT"
