"""Time calibrated quantization (quantize_model with GPTQ) and split its CPU seconds by phase.

    python scripts/calib_time.py --source results/models/qwen2.5-0.5b/source --windows 2 [--bits 4] [--threads 2]

One run in this process (run it in a fresh one; the pipeline's BLAS setup: `source scripts/env.sh`
or `env $(python -m vqpipe.blas --env)`). Prints wall and CPU seconds (user + system) of
quantize_model and the CPU seconds spent inside: the calibration forward passes with moment
collection (in process the moments are summed in each layer's rotated basis), the factorisation
(R H R^T where the moments are not rotated yet, i.e. the tied head's; the Cholesky), the GPTQ
column loop, the H-weighted scale refit, and the tied head's layer as a whole. CPU seconds are the figure
to quote on a shared machine (wall time grows with the load, CPU time much less). Split the
phases at --threads 1: with more, the layers' numpy work runs on other threads beside the
timed calls (vqpipe/parallel.py), and a phase's timer counts them too.
"""

import argparse
import json
import resource
import time


def cpu():
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def timed(acc, key, fn):
    def wrapper(*a, **k):
        t = cpu()
        try:
            return fn(*a, **k)
        finally:
            acc[key] = acc.get(key, 0.0) + cpu() - t
    return wrapper


def digest(model):
    """sha256 over the quantized layers' stored arrays, in name order."""
    import hashlib

    import mlx.core as mx
    import numpy as np

    from vqpipe.quant.quantize import split_state

    _, arrays, _ = split_state(model)
    h = hashlib.sha256()
    for k in sorted(arrays):
        a = arrays[k]
        a = a.view(mx.uint16) if a.dtype == mx.bfloat16 else a  # numpy has no bfloat16
        h.update(k.encode() + np.array(a).tobytes())
    return h.hexdigest()[:16]


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--source", required=True)
    p.add_argument("--bits", type=int, default=4)
    p.add_argument("--windows", type=int, default=2, help="calibration windows of --length tokens")
    p.add_argument("--length", type=int, default=512)
    p.add_argument("--group-size", type=int, default=64, help="0: one scale per row")
    p.add_argument("--rotation", default="auto")
    p.add_argument("--sequential", action="store_true", help="sequential moments (default: full precision)")
    p.add_argument("--threads", type=int, default=1,
                   help="quantize_model's threads (vqpipe/parallel.py); the phases' CPU seconds are "
                   "only meaningful with 1 (with more, a phase's timer also counts the other threads)")
    p.add_argument("--digest", action="store_true",
                   help="also print a sha256 of every quantized layer's arrays (exactness checks)")
    args = p.parse_args()

    from mlx_lm.utils import load

    from vqpipe.quant import calibrate
    from vqpipe.codec import gptq
    from vqpipe.layers import qlinear
    from vqpipe.quant.config import QuantizeConfig
    from vqpipe.quant.quantize import quantize_model
    from vqpipe.quant.calibrate import calibration_tokens

    from vqpipe.prefault import hold_freed_heap

    hold_freed_heap()  # as `python -m vqpipe quantize` does (vqpipe/__main__.py)
    acc = {}
    gptq.gptq = timed(acc, "gptq column loop", gptq.gptq)
    gptq.refit_steps = timed(acc, "scale refit", gptq.refit_steps)
    qlinear._rotated_factors = timed(acc, "factorisation (R H R^T, Cholesky)", qlinear._rotated_factors)
    calibrate.collect = timed(acc, "forward passes + moments", calibrate.collect)
    t0, c0 = time.perf_counter(), cpu()
    model, tok = load(args.source, lazy=True)
    tokens, _ = calibration_tokens(tok, "text", args.windows, args.length, 0)
    load_cpu = cpu() - c0
    layers = []
    t1, c1 = time.perf_counter(), cpu()
    config = QuantizeConfig(args.bits, args.rotation, group_size=args.group_size or None, sequential=args.sequential,
                            threads=args.threads)
    records = quantize_model(model, config, calibration=tokens, progress=layers.append)
    wall, cpus = time.perf_counter() - t1, cpu() - c1
    head = [r for r in records if r["kind"] == "embedding"]
    out = {"source": args.source, "bits": args.bits, "calibration_tokens": int(tokens.size), "threads": args.threads,
           "load_cpu_s": load_cpu, "quantize_model_wall_s": wall, "quantize_model_cpu_s": cpus,
           "phases_cpu_s": acc, "head_layer_wall_s": head[0]["seconds"] if head else None,
           "layers": len(records), "load_avg_1min": open("/proc/loadavg").read().split()[0]}
    print(json.dumps(out, indent=1), flush=True)
    if args.digest:
        print(json.dumps({"digest": digest(model)}))


if __name__ == "__main__":
    main()
