"""CPU decode tokens/s of ``vqpipe generate`` on two reservoirs, interleaved A B A B ... (n each).

    python -m experiments.vq.decode_speed --a DIR --b DIR [--n 3] [--tokens 128] --out FILE.json

Each run is a fresh process (the CLI as a user runs it), greedy, one prompt (a run may stop at
EOS: the token count is recorded); the load average before each run (the machine is shared)."""

import argparse
import json
import os
import re
import subprocess
import sys

PROMPT = "Write a long story about a lighthouse keeper who finds a dictionary washed ashore."


def run(model, tokens):
    cmd = [sys.executable, "-m", "vqpipe", "generate", "--model", model, "-p", PROMPT, "-m", str(tokens)]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    m = re.search(r"Generation: (\d+) tokens, ([\d.]+) tokens-per-sec", out)
    return int(m.group(1)), float(m.group(2))


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--a", required=True)
    ap.add_argument("--b", required=True)
    ap.add_argument("--n", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    rows = []
    for i in range(args.n):
        for arm, model in (("a", args.a), ("b", args.b)):
            load = os.getloadavg()
            n, tps = run(model, args.tokens)
            rows.append({"arm": arm, "model": model, "rep": i, "tokens": n, "tokens_per_s": tps, "loadavg": load})
            print(f"{arm} rep {i}: {n} tokens {tps:.2f} tok/s load {load[0]:.2f}", flush=True)
    json.dump(rows, open(args.out, "w"), indent=1)


if __name__ == "__main__":
    main()
