#!/usr/bin/env python3
"""Fuzz campaigns: seeded, structure-aware mutations of tiny reservoirs or a tiny GGUF file.

    nice -n 19 .venv/bin/python scripts/fuzz.py reservoir --cases 100000 --out fuzz.json
    nice -n 19 .venv/bin/python scripts/fuzz.py gguf --cases 10000 --out fuzz-gguf.json
    .venv/bin/python scripts/fuzz.py reservoir --replay 4242        # one case, in this process

Mutations and outcomes: experiments/fuzz_reservoir.py and experiments/fuzz_gguf.py; the runner (worker
processes, crash and hang detection): experiments/fuzz.py; results: docs/reliability.md. Exits 1 if any
case failed.
"""

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from experiments import fuzz  # noqa: E402

# target -> (module, default case count)
TARGETS = {"reservoir": ("experiments.fuzz_reservoir", 100000), "gguf": ("experiments.fuzz_gguf", 10000)}


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("target", choices=TARGETS, help="what to fuzz: the reservoir reader or the gguf: source")
    p.add_argument("--cases", type=int, default=None, help="cases to run (default: 100000 / 10000)")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--start", type=int, default=0, help="first case index")
    p.add_argument("--batch", type=int, default=5000, help="cases per worker process")
    p.add_argument("--timeout", type=float, default=60.0, help="seconds a case may take before it is a hang")
    p.add_argument("--workdir", default=None, help="scratch directory (default: under /dev/shm)")
    p.add_argument("--out", default=None, help="write the summary JSON here")
    p.add_argument("--replay", type=int, default=None, help="run this one case in-process and print it")
    args = p.parse_args()
    target, default_cases = TARGETS[args.target]
    base = "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else None
    workdir = args.workdir or tempfile.mkdtemp(prefix=f"vqpipe-fuzz-{args.target}-", dir=base)
    if args.replay is not None:
        print(fuzz.run_one(target, args.seed, args.replay, workdir))
        return 0
    summary = fuzz.campaign(target, args.seed, args.cases or default_cases, workdir, batch=args.batch,
                            timeout=args.timeout, start=args.start, progress=lambda m: print(m, flush=True))
    text = json.dumps(summary, indent=2)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    return 1 if summary["failed"] else 0


if __name__ == "__main__":
    sys.exit(main())
