#!/usr/bin/env python3
"""Reservoir reader fuzz campaign: seeded, structure-aware mutations of two tiny reservoirs.

    nice -n 19 .venv/bin/python scripts/fuzz_reservoir.py --cases 100000 --out fuzz.json
    .venv/bin/python scripts/fuzz_reservoir.py --replay 4242        # one case, in this process

Mutations and outcomes: vqpipe/fuzz_reservoir.py; the runner (worker processes, crash and hang
detection): vqpipe/fuzz.py; results: docs/reliability.md. Exits 1 if any case failed.
"""

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from vqpipe import fuzz  # noqa: E402

TARGET = "vqpipe.fuzz_reservoir"


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--cases", type=int, default=100000)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--start", type=int, default=0, help="first case index")
    p.add_argument("--batch", type=int, default=5000, help="cases per worker process")
    p.add_argument("--timeout", type=float, default=60.0, help="seconds a case may take before it is a hang")
    p.add_argument("--workdir", default=None, help="scratch directory (default: under /dev/shm)")
    p.add_argument("--out", default=None, help="write the summary JSON here")
    p.add_argument("--replay", type=int, default=None, help="run this one case in-process and print it")
    args = p.parse_args()
    base = "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else None
    workdir = args.workdir or tempfile.mkdtemp(prefix="vqpipe-fuzz-", dir=base)
    if args.replay is not None:
        print(fuzz.run_one(TARGET, args.seed, args.replay, workdir))
        return 0
    summary = fuzz.campaign(TARGET, args.seed, args.cases, workdir, batch=args.batch, timeout=args.timeout,
                            start=args.start, progress=lambda m: print(m, flush=True))
    text = json.dumps(summary, indent=2)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    return 1 if summary["failed"] else 0


if __name__ == "__main__":
    sys.exit(main())
