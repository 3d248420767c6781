"""Quality sweep: perplexity, KL to the source, top-1 agreement and honest bits/weight per arm.

    PYTHONPATH=$PWD python scripts/quality_sweep.py --source DIR --bits 4 3 \
        --arms affine:g64 vq vq:g64 gptq gptq:g64 --windows 20 --length 512

Arms: ``affine:gN`` is MLX's affine quantization (group N) of every linear; ``vq[:gN]`` is vqpipe
data-free (per-row scales, or group N scales); ``gptq[:gN]`` is vqpipe with calibration (GPTQ
in the rotated basis). Options after the kind, in any order: ``emb`` also quantizes the
embedding table (and so a tied head: MLX's nn.quantize on the embedding, as mlx_lm.convert does;
vqpipe calibrates a tied head on the final norm's output); ``fp`` (gptq) takes every H from the
full-precision model instead of the already quantized blocks. Without ``emb`` the embedding stays
dense. Every model is built first, then each evaluation window runs through the source and every
arm in turn, so the source logits are never stored.

Bits per weight: ``bpw`` counts every stored tensor of the quantized layers (codes, scales,
biases of affine groups, codebooks, rotation signs/matrices) over their weights; affine scales
and biases at 16 bits, as MLX stores them for a 16-bit model. ``bpw_all`` is over every weight
matrix of the model, embedding included, a dense embedding counted at the source's 16 bits: the
figure that compares arms with and without a quantized embedding.
"""

import argparse
import json
import math
import sys
import time
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from vqpipe.bench.harness import summarize  # noqa: E402
from vqpipe.stages.bench_quality import dense_copy, load_fp32  # noqa: E402
from vqpipe.layers.qlinear import QuantizedLinear  # noqa: E402
from vqpipe.quant.config import QuantizeConfig  # noqa: E402
from vqpipe.quant.quantize import quantize_model  # noqa: E402


PROGRESS = None


def text_windows(tokenizer, text, n, length, offset=0):
    ids = tokenizer.encode(text)
    if len(ids) < offset + n * length:
        raise ValueError(f"text has {len(ids)} tokens, need {offset + n * length}")
    return mx.array(np.array(ids[offset : offset + n * length], dtype=np.int32).reshape(n, length))


def affine_bpw(model, bits, group):
    n = sum(m.weight.shape[0] * m.weight.shape[1] * 32 // bits for _, m in model.named_modules()
            if isinstance(m, (nn.QuantizedLinear, nn.QuantizedEmbedding)))
    return bits + 32 / group, n


def dense_embedding_weights(model):
    return sum(m.weight.size for _, m in model.named_modules() if isinstance(m, nn.Embedding))


def bpw_all(bpw, quantized, dense):
    """Bits per weight over the quantized layers and the dense embedding (16 bits each)."""
    return (bpw * quantized + 16 * dense) / (quantized + dense)


def vq_bpw(model):
    stored = weights = 0
    seen = set()
    for _, m in model.named_modules():
        if isinstance(m, QuantizedLinear):
            weights += m.in_features * m.out_features
            meta, arrays = m.to_state()
            for k, a in arrays.items():
                if k == "codebook":  # shared per (bits, width): count once
                    key = (m.bits, m.in_features)
                    if key in seen:
                        continue
                    seen.add(key)
                if k == "bias":
                    continue
                stored += a.nbytes * 8
    return stored / weights, weights


def parse_arm(arm):
    """(kind, group or None, {options}) of an arm name like ``gptq:g64:emb``."""
    kind, *opts = arm.split(":")
    group = next((int(o[1:]) for o in opts if o.startswith("g")), None)
    flags = {o for o in opts if not o.startswith("g")}
    if kind not in ("affine", "vq", "gptq") or flags - {"emb", "fp"}:
        raise ValueError(f"unknown arm {arm!r}")
    return kind, group, flags


def build(source, arm, bits, calib, seed):
    model, _ = load_fp32(source)
    kind, group, flags = parse_arm(arm)
    emb = "emb" in flags
    t0 = time.perf_counter()
    if kind == "affine":
        kinds = (nn.Linear, nn.Embedding) if emb else nn.Linear
        nn.quantize(model, group_size=group or 64, bits=bits, class_predicate=lambda p, m: isinstance(m, kinds))
        mx.eval(model.parameters())
        bpw, n = affine_bpw(model, bits, group or 64)
    else:
        config = QuantizeConfig(bits, "auto", seed, emb, dtype="float32", group_size=group, sequential="fp" not in flags,
                                threads=1, calib_text="none")
        quantize_model(model, config, calibration=calib if kind == "gptq" else None, progress=PROGRESS)
        bpw, n = vq_bpw(model)
    total = bpw_all(bpw, n, dense_embedding_weights(model))
    # Evaluate as dense float32 layers holding the dequantized weights: the same weights, and
    # MLX's CPU quantized matmul is far slower than a GEMM at 512 tokens (stages/bench_quality.py).
    return dense_copy(model), bpw, total, time.perf_counter() - t0


def evaluate(source_model, arms, windows):
    """Per window: ppl terms, KL(source || arm), top-1 agreement, for the source and every arm."""
    stats = {name: {"nll": [], "kl": [], "top1": []} for name in ["source", *arms]}
    for w in range(windows.shape[0]):
        x = windows[w : w + 1]
        ref = source_model(x)[0].astype(mx.float32)
        ref = ref - mx.logsumexp(ref, axis=-1, keepdims=True)
        targets = x[0, 1:]
        outs = {"source": ref}
        for name, model in arms.items():
            lp = model(x)[0].astype(mx.float32)
            outs[name] = lp - mx.logsumexp(lp, axis=-1, keepdims=True)
        for name, lp in outs.items():
            nll = -mx.mean(mx.take_along_axis(lp[:-1], targets[:, None], axis=-1))
            kl = mx.mean(mx.sum(mx.exp(ref) * (ref - lp), axis=-1))
            top1 = mx.mean(mx.argmax(ref, axis=-1) == mx.argmax(lp, axis=-1))
            mx.eval(nll, kl, top1)
            stats[name]["nll"].append(nll.item())
            stats[name]["kl"].append(kl.item())
            stats[name]["top1"].append(top1.item())
        if PROGRESS:
            PROGRESS(f"window {w + 1}/{windows.shape[0]}: " + "  ".join(
                f"{n} KL {s['kl'][-1]:.3f}" for n, s in stats.items() if n != "source"))
    return stats


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--source", required=True)
    p.add_argument("--bits", type=int, nargs="+", default=[4, 3, 2])
    p.add_argument("--arms", nargs="+", default=["affine:g64", "vq", "gptq:g64"])
    p.add_argument("--eval-text", default=None, help="file of evaluation text (default: vqpipe.text eval split)")
    p.add_argument("--calib-text", default=None, help="file of calibration text (default: vqpipe.text calibration split)")
    p.add_argument("--windows", type=int, default=20)
    p.add_argument("--length", type=int, default=512)
    p.add_argument("--calib-windows", type=int, default=16)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="JSON output")
    p.add_argument("--verbose", action="store_true")
    args = p.parse_args(argv)
    global PROGRESS
    PROGRESS = (lambda m: print(m, flush=True)) if args.verbose else None
    source, tok = load_fp32(args.source)
    if args.eval_text:
        windows = text_windows(tok, Path(args.eval_text).read_text(), args.windows, args.length)
        calib = text_windows(tok, Path(args.calib_text).read_text(), args.calib_windows, args.length)
    else:
        from vqpipe import text

        windows = mx.stack(text.eval_windows(tok, args.windows, args.length))
        calib = text.calibration_tokens(tok, args.calib_windows, args.length, args.seed)
    models, info = {}, {}
    for bits in args.bits:
        for arm in args.arms:
            name = f"{bits}b {arm}"
            models[name], bpw, total, dt = build(args.source, arm, bits, calib, args.seed)
            info[name] = {"bits": bits, "arm": arm, "bpw": bpw, "bpw_all": total, "build_seconds": dt}
            print(f"built {name}: {bpw:.3f} bits/weight ({total:.3f} over all matrices) in {dt:.1f}s", flush=True)
    t0 = time.perf_counter()
    stats = evaluate(source, models, windows)
    print(f"evaluated {args.windows} x {args.length} tokens in {time.perf_counter() - t0:.0f}s")
    rows = []
    print(f"{'arm':22s} {'bpw':>6s} {'all':>6s} {'ppl':>8s} {'KL median [min-max]':>28s} {'top-1':>6s}")
    for name, s in stats.items():
        ppl = math.exp(sum(s["nll"]) / len(s["nll"]))
        kl = summarize(s["kl"])
        top1 = sum(s["top1"]) / len(s["top1"])
        bpw = info.get(name, {}).get("bpw", 16.0)
        rows.append({"name": name, **info.get(name, {}), "ppl": ppl, "kl": kl, "top1": top1,
                     "kl_mean": sum(s["kl"]) / len(s["kl"])})
        total = info.get(name, {}).get("bpw_all", 16.0)
        print(f"{name:22s} {bpw:6.3f} {total:6.3f} {ppl:8.2f}   {kl['median']:.4f} [{kl['min']:.4f}-{kl['max']:.4f}]"
              f"   {top1:.3f}", flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps({"windows": args.windows, "length": args.length,
                                              "calib_windows": args.calib_windows, "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
