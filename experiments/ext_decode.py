"""Decode speed of the compiled codebook mat-vec (vqpipe/kernels/ext.py) on the CPU, and its M threshold.

Arms, interleaved in one process (A B C ... per trial, the prompt rotated over >= 20 distinct
prompts), greedy, ``--tokens`` generated tokens each through mlx-lm's ``stream_generate``:

- ``ext``: the reservoir through vqpipe.load, the default path (the extension for decode);
- ``ext-aa``: the same model again: the A/A noise floor;
- ``dense``: the same model with the extension off (``ext.using(False)``: the dense weight rebuilt
  per token, the path before it); ``--dense-trials`` of them (it is slow);
- ``source``: mlx-lm on the unquantized source;
- ``affine4``: the source through MLX's ``nn.quantize`` (affine, 4 bits, group 64).

``--threshold`` also times one layer call, extension vs dense path, at SmolLM2's shapes for
M = 1..128 rows (the choice of ``ext.MAX_M``). Medians with [min-max] and n; tokens/s from
mlx-lm's own generation rate; memory as the arm's weight bytes and its peak above the memory in
use when the trial started (the models share one process).

    python -m experiments.ext_decode --reservoir DIR --source DIR --out FILE.json
"""

import argparse
import json
import statistics
import time

import mlx.core as mx
import mlx.nn as nn
import numpy as np

PROMPTS = [
    "What is the capital of France?", "Write a haiku about the sea.", "Explain photosynthesis briefly.",
    "List three prime numbers.", "Who wrote Hamlet?", "Describe a cat in one sentence.",
    "What is 12 times 7?", "Give me a tip for learning to cook.", "Why is the sky blue?",
    "Name a planet with rings.", "Translate 'good morning' into Spanish.", "What does a compiler do?",
    "Suggest a name for a small bakery.", "How many legs does a spider have?", "What is gravity?",
    "Tell me a fun fact about octopuses.", "What is the boiling point of water?",
    "Summarise the plot of Cinderella.", "How do bees make honey?", "What is a prime number?",
    "Recommend a book for a long train ride.", "What causes rain?",
]


def summary(values):
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "n": len(values)}


def weight_bytes(model):
    from mlx.utils import tree_flatten

    return sum(v.nbytes for _, v in tree_flatten(model.parameters()))


def decode(model, tok, prompt, tokens):
    from mlx_lm import stream_generate

    text = tok.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=False)
    mx.synchronize()
    base = mx.get_active_memory()
    mx.reset_peak_memory()
    last = None
    for last in stream_generate(model, tok, text, max_tokens=tokens):
        pass
    return last.generation_tps, mx.get_peak_memory() - base, last.generation_tokens


def arms(reservoir, source):
    import mlx_lm

    import vqpipe
    from vqpipe.kernels import ext

    quantized, qtok = vqpipe.load(reservoir)
    plain, stok = mlx_lm.load(source)
    affine, _ = mlx_lm.load(source)
    nn.quantize(affine, group_size=64, bits=4)
    mx.eval(affine.parameters())

    def off(fn):
        def run(*a):
            with ext.using(False):
                return fn(*a)
        return run

    return {
        "ext": (quantized, qtok, decode),
        "ext-aa": (quantized, qtok, decode),
        "dense": (quantized, qtok, off(decode)),
        "source": (plain, stok, decode),
        "affine4": (affine, stok, decode),
    }


def bench_decode(reservoir, source, trials, dense_trials, tokens):
    table = arms(reservoir, source)
    rates = {k: [] for k in table}
    peaks = {k: [] for k in table}
    texts = {}
    for t in range(trials):
        prompt = PROMPTS[t % len(PROMPTS)]
        for name, (model, tok, run) in table.items():
            if name == "dense" and t >= dense_trials:
                continue
            tps, peak, n = run(model, tok, prompt, tokens)
            rates[name].append(tps)
            peaks[name].append(peak)
        print(f"trial {t + 1}/{trials}: " + ", ".join(f"{k} {v[-1]:.2f}" for k, v in rates.items() if v), flush=True)
    out = {}
    for name, (model, _, _) in table.items():
        if rates[name]:  # the dense arm runs only in its first dense_trials trials (none with 0)
            out[name] = {"tokens_per_s": summary(rates[name]), "peak_above_start_bytes": summary(peaks[name]),
                         "weight_bytes": weight_bytes(model)}
    # per-trial ratios: each pair ran in the same trial on the same prompt
    out["ratios"] = {f"ext/{k}": summary([a / b for a, b in zip(rates["ext"], rates[k])])
                     for k in ("dense", "source", "affine4", "ext-aa") if rates[k]}
    return out


def bench_threshold(reservoir, reps, ms):
    """One call of SmolLM2's gate|up (3072 x 576) and down (576 x 1536): extension vs dense path."""
    import vqpipe
    from vqpipe.kernels import ext
    from vqpipe.layers import fused
    from vqpipe.layers.qlinear import dense_forward

    model, _ = vqpipe.load(reservoir)
    layer = model.model.layers[len(model.model.layers) // 2]
    gate = layer.mlp.gate_proj.__dict__.get("_fused") or layer.mlp.gate_proj
    down = layer.mlp.down_proj
    out = {}
    for name, l in (("gate|up", gate), ("down", down)):
        n = l.rotation.dim
        for m in ms:
            x = mx.random.normal((m, n))
            mx.eval(x)
            arms = {
                "ext": lambda: ext.matvec(x, l.packed, l.scales, l.codebook, l.bits, l.bias if getattr(l, "bias", None) is not None else None, l.group_size),
                "dense": lambda: dense_forward(x, l.packed, l.scales, l.codebook, l.bits, None, l.group_size),
            }
            ts = {k: [] for k in arms}
            for _ in range(reps):
                for k, f in arms.items():
                    a = time.perf_counter()
                    mx.eval(f())
                    ts[k].append((time.perf_counter() - a) * 1e3)
            out[f"{name} M={m}"] = {k: summary(v) for k, v in ts.items()}
            print(name, m, {k: round(statistics.median(v), 3) for k, v in ts.items()}, flush=True)
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--reservoir", required=True)
    p.add_argument("--source", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--trials", type=int, default=20)
    p.add_argument("--dense-trials", type=int, default=3)
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--threshold", action="store_true")
    p.add_argument("--threshold-reps", type=int, default=10)
    args = p.parse_args(argv)
    mx.set_default_device(mx.cpu)
    from vqpipe.kernels import ext

    if not ext.available():
        raise SystemExit(f"vqpipe._ext is not built ({ext._missing}); run scripts/build_ext.sh")
    result = {"machine": "shared", "threads": ext.module().threads(), "avx2": ext.module().has_avx2(),
              "max_m": ext.MAX_M, "tokens": args.tokens}
    if args.threshold:
        result["threshold_ms"] = bench_threshold(args.reservoir, args.threshold_reps, (1, 8, 16, 32, 64, 128))
    result["decode"] = bench_decode(args.reservoir, args.source, args.trials, args.dense_trials, args.tokens)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print(json.dumps(result["decode"]["ratios"], indent=1))


if __name__ == "__main__":
    main()
