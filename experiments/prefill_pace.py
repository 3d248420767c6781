"""Prefill paced block by block (Decoder.prefill ``pace``) against queued all at once: time and peak memory.

    python -m experiments.prefill_pace (--model RESERVOIR | --preset NAME) [--lengths 9 65 257 1025]
        [--prompts 20] [--reps 2] [--paces 1 4] [--auto] [--out FILE]

For each prompt length: ``Decoder.prefill`` with the blocks paced (a wait every ``pace`` blocks, for
each of ``--paces``; with ``--auto`` the default too, Decoder.waits) and unpaced (pace 0: the whole
chunk queued at once, as mlx-lm's prefill does), interleaved prompt by prompt over ``--prompts``
distinct random prompts, with an A/A pass of the unpaced arm; then each arm's peak memory over one
prefill (MLX's peak above what was active before it), and whether every arm's cache equals the
unpaced one. Runs on the default device (CPU or GPU). ``--preset`` (e.g. llama3-8b) builds a 4-bit
model of a synthetic preset's shapes with random scalar codes on the device instead of loading one
(experiments.decode_shapes.random_vqpipe: no files, for shapes too large to quantize in a GPU run).
"""

import argparse
import json
import statistics

import mlx.core as mx
import numpy as np

import vqpipe
from vqpipe.decode.step import Decoder

from experiments.row_limit import prefill, random_prompts


def summary(v):
    return {"median": statistics.median(v), "min": min(v), "max": max(v), "n": len(v)}


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--model")
    src.add_argument("--preset")
    p.add_argument("--lengths", type=int, nargs="+", default=[9, 65, 257, 1025])
    p.add_argument("--prompts", type=int, default=20)
    p.add_argument("--reps", type=int, default=2)
    p.add_argument("--paces", type=int, nargs="+", default=[1, 4])
    p.add_argument("--auto", action="store_true", help="an arm with the default pace (Decoder.waits) too")
    p.add_argument("--out")
    a = p.parse_args()
    if a.preset:
        from experiments.decode_shapes import random_vqpipe

        model = random_vqpipe(a.preset, 4)
    else:
        model, _ = vqpipe.load(a.model)
    rng = np.random.default_rng(0)
    rows = []
    for n in a.lengths:
        dec = Decoder(model, n + 8, "split")
        prompts = random_prompts(model, n, a.prompts, rng)

        def run(pace, prompt):
            return prefill(dec, prompt, pace=pace)

        def peak(pace):
            return prefill(dec, prompts[0], peak=True, pace=pace)

        paces = [*a.paces, None] if a.auto else list(a.paces)
        arms = [0, *paces]
        for pace in arms * 2:  # warm-up
            run(pace, prompts[0])
        t = {pace: [] for pace in arms}
        t["aa"] = []
        for _ in range(a.reps):
            for pr in prompts:
                for pace in arms:
                    t[pace].append(run(pace, pr)[0])
                t["aa"].append(run(0, pr)[0])
        pk0, c0 = peak(0)
        row = {"prompt_tokens": n, "device": str(mx.default_device()),
               "ms": {str(k): summary([x * 1e3 for x in v]) for k, v in t.items()},
               "aa": summary([x / y for x, y in zip(t["aa"], t[0])]), "peak_bytes": {"0": pk0}, "arms": {}}
        line = (f"tokens {n:5d}: unpaced {statistics.median(t[0]) * 1e3:7.2f} ms peak {pk0 / 1e6:7.1f} MB  A/A "
                f"{row['aa']['median']:.3f} [{row['aa']['min']:.3f}-{row['aa']['max']:.3f}]")
        for pace in paces:
            ratio = [x / y for x, y in zip(t[pace], t[0])]
            pk, c = peak(pace)
            same = all(bool(mx.array_equal(x.keys, y.keys).item()) and bool(mx.array_equal(x.values, y.values).item())
                       for x, y in zip(c, c0))
            row["peak_bytes"][str(pace)] = pk
            row["arms"][str(pace)] = {"over_unpaced": summary(ratio), "same_cache": same}
            name = "auto" if pace is None else pace
            line += (f" | pace {name}: x{statistics.median(ratio):.3f} [{min(ratio):.3f}-{max(ratio):.3f}] "
                     f"peak {pk / 1e6:.1f} MB same {same}")
        rows.append(row)
        print(line + f" (n={len(t[0])})", flush=True)
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
