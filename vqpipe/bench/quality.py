"""Quality benchmark: vqpipe (rotated / unrotated codebook) vs MLX affine quantization.

For each bit width, three methods quantize the same source model:
    rotated    vqpipe, rotation "auto" (Hadamard where MLX supports the size, else Kronecker)
    unrotated  vqpipe, rotation "none" (the same Lloyd-Max codebook on raw normalised rows)
    affine     MLX's own ``nn.quantize`` (affine, group 64, fp32 scales) on every nn.Linear
and we report the weight error (sum ||W - W_hat||^2 / sum ||W||^2 over the quantized layers) and
logit agreement with the full-precision source (KL(source || quantized) per token and top-1
agreement) on windows of the shipped corpus that no method saw.

``--timing`` also times quantization itself (``quantize_model``) per rotation in fresh
subprocesses, with each child's peak RSS against the source model's size on disk.
"""

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_map

from ..fsutil import write_json
from ..quantize import quantize_model
from .env import environment
from .harness import summarize

CORPUS = Path(__file__).resolve().parent.parent / "data" / "corpus.txt"
METHODS = ("rotated", "unrotated", "affine")


def eval_windows(tokenizer, n_windows, length):
    """``n_windows`` distinct token windows of ``length`` spread over the corpus."""
    ids = tokenizer.encode(CORPUS.read_text())
    if len(ids) < length + n_windows:
        raise ValueError(f"corpus has {len(ids)} tokens, too few for {n_windows} windows of {length}")
    step = (len(ids) - length) // n_windows
    return [mx.array(ids[i * step : i * step + length], dtype=mx.int32) for i in range(n_windows)]


def load_fp32(path):
    """The source in float32; an affine-quantized source is dequantized (that is its full precision)."""
    from mlx_lm.utils import dequantize_model, load

    model, tok = load(str(path))
    model = dequantize_model(model)
    model.update(tree_map(lambda a: a.astype(mx.float32) if mx.issubdtype(a.dtype, mx.floating) else a,
                          model.parameters()))
    mx.eval(model.parameters())
    return model, tok


def logprobs(model, tokens):
    logits = model(tokens[None])[0].astype(mx.float32)
    return logits - mx.logsumexp(logits, axis=-1, keepdims=True)


def agreement(ref_lp, lp):
    """(mean KL(ref || q) over tokens, top-1 agreement) for one window."""
    kl = mx.mean(mx.sum(mx.exp(ref_lp) * (ref_lp - lp), axis=-1))
    top1 = mx.mean(mx.argmax(ref_lp, axis=-1) == mx.argmax(lp, axis=-1))
    mx.eval(kl, top1)
    return kl.item(), top1.item()


def affine_error(model, source_weights):
    err = tot = 0.0
    for name, m in model.named_modules():
        if isinstance(m, nn.QuantizedLinear):
            w = source_weights[name]
            w_hat = mx.dequantize(m.weight, m.scales, m.biases, m.group_size, m.bits)
            err += mx.sum((w_hat - w) ** 2).item()
            tot += mx.sum(w * w).item()
    return err / tot


def quantize_method(path, method, bits, seed):
    model, _ = load_fp32(path)
    if method == "affine":
        weights = {n: m.weight for n, m in model.named_modules() if isinstance(m, nn.Linear)}
        nn.quantize(model, group_size=64, bits=bits, class_predicate=lambda p, m: isinstance(m, nn.Linear))
        mx.eval(model.parameters())
        return model, affine_error(model, weights)
    records = quantize_model(model, bits, "auto" if method == "rotated" else "none", seed)
    err = sum(r["squared_error"] for r in records) / sum(r["weight_sq"] for r in records)
    return model, err


def quality(path, bits_list, n_windows=20, length=128, seed=0, progress=print):
    source, tok = load_fp32(path)
    windows = eval_windows(tok, n_windows, length)
    refs = [logprobs(source, w) for w in windows]
    mx.eval(refs)
    del source
    records = []
    for bits in bits_list:
        for method in METHODS:
            t0 = time.perf_counter()
            model, werr = quantize_method(path, method, bits, seed)
            kls, top1s = zip(*(agreement(r, logprobs(model, w)) for r, w in zip(refs, windows)))
            rec = {"bits": bits, "method": method, "weight_rel_mse": werr,
                   "kl": summarize(kls), "kl_mean": sum(kls) / len(kls),
                   "top1": summarize(top1s), "top1_mean": sum(top1s) / len(top1s),
                   "tokens": n_windows * length}
            records.append(rec)
            progress(f"{bits}-bit {method:9s} weight rel MSE {werr:.5f}  KL {rec['kl_mean']:.4f} "
                     f"(median {rec['kl']['median']:.4f})  top-1 {rec['top1_mean']:.3f}  "
                     f"[{time.perf_counter() - t0:.1f}s]")
            del model
    return records


_CHILD = """
import json, resource, sys, time
from mlx_lm.utils import load
from vqpipe.quantize import quantize_model
model, _ = load(sys.argv[1], lazy=True)
t0 = time.perf_counter()
quantize_model(model, int(sys.argv[2]), sys.argv[3], 0)
dt = time.perf_counter() - t0
print(json.dumps({"seconds": dt, "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}))
"""


def timing(path, bits, rotations, repeats, progress=print):
    """Quantize time and peak RSS per rotation, each run a fresh process, arms interleaved."""
    source_bytes = sum(f.stat().st_size for f in Path(path).glob("*.safetensors"))
    runs = {r: [] for r in rotations}
    for i in range(repeats):
        for r in rotations:
            out = subprocess.run([sys.executable, "-c", _CHILD, str(path), str(bits), r],
                                 capture_output=True, text=True, check=True)
            runs[r].append(json.loads(out.stdout.strip().splitlines()[-1]))
            progress(f"timing {r} run {i + 1}/{repeats}: {runs[r][-1]['seconds']:.1f}s, "
                     f"peak RSS {runs[r][-1]['peak_rss_bytes'] / 2**20:.0f} MiB")
    return [{"rotation": r, "bits": bits, "seconds": summarize([x["seconds"] for x in v]),
             "peak_rss_bytes": summarize([x["peak_rss_bytes"] for x in v]),
             "source_bytes": source_bytes,
             "peak_rss_over_source": summarize([x["peak_rss_bytes"] / source_bytes for x in v])}
            for r, v in runs.items()]


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m vqpipe bench-quality", description=__doc__.split("\n")[0])
    p.add_argument("--source", required=True, help="source model directory")
    p.add_argument("--model", default=None, help="model name recorded in the output")
    p.add_argument("--bits", type=int, nargs="+", default=[2, 3, 4])
    p.add_argument("--windows", type=int, default=20, help="distinct evaluation windows (>= 20)")
    p.add_argument("--length", type=int, default=128, help="tokens per window")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timing", nargs="*", default=None, metavar="ROTATION",
                   help="also time quantize_model for these rotations (e.g. auto qr)")
    p.add_argument("--timing-bits", type=int, default=4)
    p.add_argument("--timing-repeats", type=int, default=3)
    p.add_argument("--out", required=True, help="output JSON")
    args = p.parse_args(argv)
    try:
        result = {"kind": "bench-quality", "model": args.model or Path(args.source).name,
                  "environment": environment(),
                  "records": quality(args.source, args.bits, args.windows, args.length, args.seed)}
        if args.timing:
            result["timing"] = timing(args.source, args.timing_bits, args.timing, args.timing_repeats)
    except ValueError as e:
        print(f"vqpipe bench-quality: error: {e}", file=sys.stderr)
        return 2
    write_json(args.out, result)
    return 0
