"""Command line: ``python -m vqpipe STAGE [options]``; each stage module has ``main(argv)``."""

import importlib
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
    "bench-decode": "vqpipe.stages.bench_decode",
    "report": "vqpipe.stages.report",
    # Using a reservoir: mlx-lm's generate/chat/server loops with the reservoir loader.
    "generate": "vqpipe.generate",
    "chat": "vqpipe.chat",
    "serve": "vqpipe.serve",
}

# Stages whose temporaries churn large blocks of memory: freed memory stays in the process
# (vqpipe/prefault.py, hold_freed_heap). Not the stages that measure loads or memory.
HOLD_HEAP = ("calibrate", "quantize", "bench-quality")


def main(argv=None):
    as_program = argv is None
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print("usage: python -m vqpipe STAGE [options]   (STAGE --help for its options)")
        print("stages: " + ", ".join(STAGES))
        return 0
    name, rest = argv[0], argv[1:]
    if name not in STAGES:
        print(f"vqpipe: unknown stage {name!r}; choose one of: {', '.join(STAGES)}", file=sys.stderr)
        return 2
    if as_program:
        # The BLAS is fixed when the process starts (vqpipe/blas.py); say so when it is not the policy's.
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
