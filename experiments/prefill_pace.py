"""Prefill paced block by block (Decoder.prefill ``pace``) against queued all at once: time and peak memory.

    python -m experiments.prefill_pace --model RESERVOIR [--lengths 9 65 257 1025] [--prompts 20]
        [--reps 2] [--pace 2] [--out FILE]

For each prompt length: ``Decoder.prefill`` with the blocks paced (``--pace`` blocks queued) and
unpaced (pace 0: the whole chunk queued at once, as mlx-lm's prefill does), interleaved prompt by
prompt over ``--prompts`` distinct random prompts, with an A/A pass of the unpaced arm; then each
arm's peak memory over one prefill (MLX's peak above what was active before it), and whether the
two arms' caches are equal. Runs on the default device (CPU or GPU).
"""

import argparse
import json
import statistics
import time

import mlx.core as mx
import numpy as np

import vqpipe
from vqpipe.decode.step import Decoder


def summary(v):
    return {"median": statistics.median(v), "min": min(v), "max": max(v), "n": len(v)}


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", required=True)
    p.add_argument("--lengths", type=int, nargs="+", default=[9, 65, 257, 1025])
    p.add_argument("--prompts", type=int, default=20)
    p.add_argument("--reps", type=int, default=2)
    p.add_argument("--pace", type=int, default=2)
    p.add_argument("--out")
    a = p.parse_args()
    model, _ = vqpipe.load(a.model)
    vocab = int(model.args.vocab_size)
    rng = np.random.default_rng(0)
    rows = []
    for n in a.lengths:
        dec = Decoder(model, n + 8, "split")
        prompts = [mx.array(rng.integers(100, min(vocab, 30000), n)) for _ in range(a.prompts)]

        def run(pace, prompt):
            caches = dec.new_cache()
            mx.eval([(c.keys, c.values) for c in caches])
            mx.synchronize()
            t = time.perf_counter()
            dec.prefill(prompt, caches, pace=pace)
            mx.synchronize()
            return time.perf_counter() - t, caches

        def peak(pace):
            caches = dec.new_cache()
            mx.eval([(c.keys, c.values) for c in caches])
            mx.synchronize()
            mx.clear_cache()
            mx.reset_peak_memory()
            before = mx.get_active_memory()
            dec.prefill(prompts[0], caches, pace=pace)
            mx.synchronize()
            return mx.get_peak_memory() - before, caches

        for pace in (a.pace, 0, a.pace, 0):  # warm-up
            run(pace, prompts[0])
        t = {"paced": [], "unpaced": [], "unpaced-aa": []}
        for _ in range(a.reps):
            for pr in prompts:
                t["paced"].append(run(a.pace, pr)[0])
                t["unpaced"].append(run(0, pr)[0])
                t["unpaced-aa"].append(run(0, pr)[0])
        ratio = [x / y for x, y in zip(t["paced"], t["unpaced"])]
        aa = [x / y for x, y in zip(t["unpaced-aa"], t["unpaced"])]
        pk_paced, c1 = peak(a.pace)
        pk_unpaced, c2 = peak(0)
        same = all(bool(mx.array_equal(x.keys, y.keys).item()) and bool(mx.array_equal(x.values, y.values).item())
                   for x, y in zip(c1, c2))
        row = {"prompt_tokens": n, "pace": a.pace, "device": str(mx.default_device()),
               "ms": {k: summary([x * 1e3 for x in v]) for k, v in t.items()},
               "paced_over_unpaced": summary(ratio), "aa": summary(aa),
               "peak_bytes": {"paced": pk_paced, "unpaced": pk_unpaced}, "same_cache": same}
        rows.append(row)
        print(f"tokens {n:5d}: paced {statistics.median(t['paced']) * 1e3:8.2f} ms  unpaced "
              f"{statistics.median(t['unpaced']) * 1e3:8.2f} ms  paced/unpaced {statistics.median(ratio):.3f} "
              f"[{min(ratio):.3f}-{max(ratio):.3f}] n={len(ratio)}  A/A {statistics.median(aa):.3f} "
              f"[{min(aa):.3f}-{max(aa):.3f}]  peak MB paced {pk_paced / 1e6:.1f} unpaced {pk_unpaced / 1e6:.1f}"
              f"  same cache {same}", flush=True)
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
