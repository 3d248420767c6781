"""One-off benchmarks, profilers, fuzzers and kill campaigns: ``python -m experiments.NAME``.

They import vqpipe; vqpipe never imports them, no Snakemake rule runs them. Each module's
docstring says what it measured and where its results are (docs/results/).
"""

import os
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def child_env():
    """This process's environment with the repository first on PYTHONPATH: ``-m experiments.X`` in a child."""
    paths = [str(ROOT), *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(paths)}
