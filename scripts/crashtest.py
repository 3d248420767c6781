#!/usr/bin/env python3
"""SIGKILL campaign: kill download, quantize and pack at seeded random points, check what is left.

    nice -n 19 .venv/bin/python scripts/crashtest.py --trials 200 --out crash.json
    .venv/bin/python scripts/crashtest.py --stages pack --trials 5

What a trial checks: experiments/crashtest.py; results: docs/reliability.md. Exits 1 on any failure.
"""

import argparse
import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from experiments import crashtest  # noqa: E402


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--stages", nargs="+", default=list(crashtest.STAGES), choices=crashtest.STAGES)
    p.add_argument("--trials", type=int, default=200, help="trials per stage")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--start", type=int, default=0, help="first trial index (to split a campaign)")
    p.add_argument("--recover-every", type=int, default=1,
                   help="run the stage to completion (and check it) after every k-th kill (default 1)")
    p.add_argument("--workdir", default=None)
    p.add_argument("--out", default=None, help="write the summaries (JSON) here")
    args = p.parse_args()
    results = []
    for stage in args.stages:
        work = Path(args.workdir or tempfile.mkdtemp(prefix="vqpipe-crash-")) / stage
        r = crashtest.campaign(stage, args.trials, args.seed, work, progress=lambda m: print(m, flush=True),
                               recover_every=args.recover_every, start=args.start)
        print(json.dumps(r), flush=True)
        results.append(r)
        if args.out:
            Path(args.out).write_text(json.dumps(results, indent=2) + "\n")
    return 1 if any(r["failures"] for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
