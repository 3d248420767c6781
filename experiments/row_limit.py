"""The row limit of the compiled trellis mat-vec, measured on a whole model's prefill.

    python -m experiments.row_limit --model RESERVOIR [--lengths 17 33 49 65 97 129] [--prompts 20]
        [--reps 2] [--out FILE]

A prompt of n tokens sends n - 1 rows through every layer (the last token goes to the first decode
step). For each length: the prefill with the mat-vec (the row limit raised to n) against the dense
path (limit 0: the extension's decode + matmul), interleaved prompt by prompt over ``--prompts``
distinct random prompts, plus an A/A pass of the mat-vec arm; the limit is ext.GPU_MAX_M on a GPU
default device, ext.MAX_M on the CPU. Prints per length the median time of each arm, the ratio
mat-vec / dense per prompt (median [min-max], n) and each arm's peak memory over the prefill.

"""

import argparse
import json
import statistics
import time

import mlx.core as mx
import numpy as np

import vqpipe
from vqpipe.decode.step import Decoder
from vqpipe.kernels import ext


def summary(v):
    return {"median": statistics.median(v), "min": min(v), "max": max(v), "n": len(v)}


def random_prompts(model, n, count, rng):
    """``count`` prompts of ``n`` random token ids (ids 100 to 30,000, within the vocabulary)."""
    vocab = int(model.args.vocab_size)
    return [mx.array(rng.integers(100, min(vocab, 30000), n)) for _ in range(count)]


def prefill(dec, prompt, peak=False, **kwargs):
    """(seconds, or with ``peak`` MLX's peak memory above what was active before, caches) of one
    ``dec.prefill`` on fresh caches (``kwargs`` go to it), the device synchronized around it."""
    caches = dec.new_cache()
    mx.eval([(c.keys, c.values) for c in caches])
    mx.synchronize()
    if peak:
        mx.clear_cache()
        mx.reset_peak_memory()
    before = mx.get_active_memory()
    t = time.perf_counter()
    dec.prefill(prompt, caches, **kwargs)
    mx.synchronize()
    return (mx.get_peak_memory() - before if peak else time.perf_counter() - t), caches


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", required=True)
    p.add_argument("--lengths", type=int, nargs="+", default=[17, 33, 49, 65, 97, 129])
    p.add_argument("--prompts", type=int, default=20)
    p.add_argument("--reps", type=int, default=2)
    p.add_argument("--out")
    a = p.parse_args()
    gpu = mx.default_device() == mx.gpu
    limit_name = "GPU_MAX_M" if gpu else "MAX_M"
    model, _ = vqpipe.load(a.model)
    rng = np.random.default_rng(0)
    rows = []
    for n in a.lengths:
        dec = Decoder(model, n + 8, "split")
        prompts = random_prompts(model, n, a.prompts, rng)

        def run(limit, prompt):
            setattr(ext, limit_name, limit)
            return prefill(dec, prompt)[0]

        def peak(limit):
            setattr(ext, limit_name, limit)
            return prefill(dec, prompts[0], peak=True)[0]

        for limit in (n, 0, n, 0):  # warm-up: kernel builds, the allocator's cache
            run(limit, prompts[0])
        t = {"kernel": [], "dense": [], "kernel-aa": []}
        for _ in range(a.reps):
            for pr in prompts:
                t["kernel"].append(run(n, pr))
                t["dense"].append(run(0, pr))
                t["kernel-aa"].append(run(n, pr))
        ratio = [k / d for k, d in zip(t["kernel"], t["dense"])]
        aa = [k2 / k for k, k2 in zip(t["kernel"], t["kernel-aa"])]
        pk = {"kernel": peak(n), "dense": peak(0)}
        row = {"prompt_tokens": n, "rows": n - 1, "limit": limit_name, "device": str(mx.default_device()),
               "ms": {k: summary([x * 1e3 for x in v]) for k, v in t.items()},
               "kernel_over_dense": summary(ratio), "aa": summary(aa), "peak_bytes": pk}
        rows.append(row)
        print(f"rows {n - 1:4d}: mat-vec {statistics.median(t['kernel']) * 1e3:8.2f} ms  dense "
              f"{statistics.median(t['dense']) * 1e3:8.2f} ms  mat-vec/dense {statistics.median(ratio):.3f} "
              f"[{min(ratio):.3f}-{max(ratio):.3f}] n={len(ratio)}  A/A {statistics.median(aa):.3f} "
              f"[{min(aa):.3f}-{max(aa):.3f}]  peak MB mat-vec {pk['kernel'] / 1e6:.1f} dense {pk['dense'] / 1e6:.1f}",
              flush=True)
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
