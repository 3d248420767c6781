"""Command line: ``vqpipe STAGE [options]`` (or ``python -m vqpipe``); each stage module has ``main(argv)``."""

import importlib
import os
import sys

# Stage name -> module. Each module parses its own arguments.
STAGES = {
    "download": "vqpipe.stages.download",
    "calibrate": "vqpipe.stages.calibrate",
    "quantize": "vqpipe.stages.quantize",
    "pack": "vqpipe.stages.pack",
    "validate": "vqpipe.stages.validate",
    "inspect": "vqpipe.stages.show",
    "bench-quality": "vqpipe.stages.bench_quality",
    "bench-load": "vqpipe.stages.bench_load",
    "bench-kivi": "vqpipe.stages.bench_kivi",
    "bench-kv-quality": "vqpipe.stages.bench_kv_quality",
    "bench-decode": "vqpipe.stages.bench_decode",
    "report": "vqpipe.stages.report",
    # Using a reservoir: mlx-lm's generate/chat/server loops with the reservoir loader.
    "generate": "vqpipe.apps.generate",
    "chat": "vqpipe.apps.chat",
    "serve": "vqpipe.apps.serve",
}

# Stages whose temporaries churn large blocks of memory: freed memory stays in the process
# (vqpipe/prefault.py, hold_freed_heap). Not the stages that measure loads or memory.
HOLD_HEAP = ("calibrate", "quantize", "bench-quality")

USAGE = "usage: vqpipe STAGE [options]   (vqpipe STAGE --help for its options)"


def policy_env():
    """The environment this process should have run in for the BLAS policy (vqpipe/blas.py), or None
    when it already does (or the policy cannot be met: the caller then warns)."""
    from . import blas

    if blas.policy_mismatch() is None:
        return None
    try:
        env = blas.env_for(blas.choice())
    except (ValueError, RuntimeError):
        return None
    return env if blas.preloaded(env) != blas.preloaded() else None


def main(argv=None):
    as_program = argv is None
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] in ("-h", "--help"):
        print(USAGE)
        print("stages: " + ", ".join(STAGES))
        return 0
    if not argv:
        print(USAGE, file=sys.stderr)
        print("stages: " + ", ".join(STAGES), file=sys.stderr)
        return 2
    name, rest = argv[0], argv[1:]
    if name not in STAGES:
        print(f"vqpipe: unknown stage {name!r}; choose one of: {', '.join(STAGES)}", file=sys.stderr)
        return 2
    if as_program:
        # The BLAS is fixed when a process starts (vqpipe/blas.py): start again under the policy's
        # environment rather than run (and compare) on another BLAS.
        env = policy_env()
        if env is not None:
            sys.stdout.flush()
            os.execve(sys.executable, sys.orig_argv, env)  # the same command line: interpreter flags kept
        from . import blas

        mismatch = blas.policy_mismatch()
        if mismatch:
            print(f"vqpipe: warning: {mismatch}", file=sys.stderr)
    if as_program and name in HOLD_HEAP:
        from .prefault import hold_freed_heap

        hold_freed_heap()
    module = importlib.import_module(STAGES[name])
    return module.main(rest) or 0


if __name__ == "__main__":
    sys.exit(main())
