"""Whole-model quality of each codebook on SmolLM2-135M, with LDLQ in vqpipe's rotated basis.

    python -m experiments.vq.smollm2 reference --out DIR [--windows 20]
    python -m experiments.vq.smollm2 arm --ref DIR --arm e8p|scalar|trellis [--L 10] [--bits 2]
                                     [--mixed QUANTIZED_DIR] --out FILE.json

Every quantized matrix as the pipeline's recipe has them (every Linear, the tied embedding/head
with the final norm's moments), rotated as quantize_model rotates them (``auto``, seed 0), the
pipeline's calibration moments (results/calibration/smollm2: the Devil's Dictionary's
calibration split), one float32 scale per row. The quantized weights are evaluated dense (as
bench-quality evaluates every arm) on bench-quality's windows: KL(source || arm), top-1,
perplexity, on the Devil's Dictionary's eval split and the Jargon File (the other domain).
``--mixed`` takes the per-layer widths the recipe chose for an artifact (its quantized.json
``allocation``) and gives each layer that width in the arm's codebook family.
"""

import argparse
import json
import math
import os
import time
from pathlib import Path

import mlx.core as mx
import numpy as np

from vqpipe import text
from vqpipe.codec import gptq
from vqpipe.quant import quantize
from vqpipe.stages import bench_quality as bq
from vqpipe.store import calibration as calibrate

from experiments.vq.codes import E8P, Scalar, Trellis
from experiments.vq.ldlq import ldlq

ROOT = Path("/work/main")
SOURCE = ROOT / "results/models/smollm2/source"
MOMENTS = ROOT / "results/calibration/smollm2"
SCALES = {("trellis", 8): 1.08, ("trellis", 10): 1.05, ("e8p", None): 1.03}  # gauss.py fits (synthetic data)


def make_quantizer(arm, bits, dim, L):
    if arm == "scalar" or (arm == "e8p" and bits != 2):  # E8P exists at 2 bits only: other widths scalar
        return Scalar(bits, dim)
    if arm == "e8p":
        return E8P(SCALES[("e8p", None)])
    if arm == "trellis":
        return Trellis(L, bits, "1mad", SCALES.get(("trellis", L), 1.0))
    raise ValueError(arm)


def groups(model, moments):
    """[(key, [names])] in model order: the matrices that share moments (and so a rotation)."""
    out = {}
    for name, _, kind in quantize._targets(model, True, True):
        key = moments[name][0]
        out.setdefault(key, []).append(name)
    return list(out.items())


def quantize_arm(model, arm, bits, L=10, widths=None, blocks=None, progress=print):
    """Replace every quantized matrix's weight with the arm's dequantized one, in place; returns records."""
    moments, _ = calibrate.load(MOMENTS)
    modules = dict(model.named_modules())
    records = []
    for key, names in groups(model, moments):
        if blocks is not None and any(n.startswith("model.layers.") and int(n.split(".")[2]) >= blocks for n in names):
            continue
        t0 = time.perf_counter()
        ws = [modules[n].weight.astype(mx.float32) for n in names]
        w = mx.concatenate(ws, axis=0)
        d = w.shape[1]
        rot = quantize.layer_rotation("auto", 0, names[0], d)
        wr = np.array(rot.apply(w), dtype=np.float32)
        hr = np.array(gptq.rotate_hessian(moments[names[0]][1], rot), dtype=np.float32)
        # per member width (mixed): quantize each member on its own where widths differ
        member_bits = [(widths or {}).get(n, bits) for n in names]
        parts, r0 = [], 0
        spans = []
        for n, wv, b in zip(names, ws, member_bits):
            spans.append((n, r0, r0 + wv.shape[0], b))
            r0 += wv.shape[0]
        # merge runs of equal width (q/k/v at one width are one LDLQ call: the same H and factor)
        runs = []
        for n, a, e, b in spans:
            if runs and runs[-1][3] == b:
                runs[-1] = (runs[-1][0] + [n], runs[-1][1], e, b)
            else:
                runs.append(([n], a, e, b))
        what = np.empty_like(wr)
        for ns, a, e, b in runs:
            q = make_quantizer(arm, b, d, L)
            c, s, err = ldlq(wr[a:e], hr, q)
            what[a:e] = s[:, None] * c
            records.append({"layers": ns, "bits": b, "quantizer": type(q).__name__, "rows": e - a, "in": d,
                            "out_err": err})
        wh = rot.apply_transpose(mx.array(what))
        for n, a, e, b in spans:
            modules[n].weight = wh[a:e].astype(modules[n].weight.dtype)
        mx.eval([modules[n].weight for n in names])
        records[-1]["seconds"] = time.perf_counter() - t0
        progress(f"{'+'.join(n.split('.')[-1] for n in names)} {names[0]} {wr.shape} {time.perf_counter() - t0:.1f}s "
                 f"out_err {records[-1]['out_err']:.4f}")
    return records


def bits_per_weight(model, records):
    """Codes + one float32 scale per row, over the quantized weights (rotation state and codebook
    left out alike for every arm: a few KB)."""
    wts = sum(r["rows"] * r["in"] for r in records)
    bits = sum(r["rows"] * r["in"] * r["bits"] + 32 * r["rows"] for r in records)
    return bits / wts, wts


def evaluate(model, ref, n_windows, length):
    tok = bq.load_source(SOURCE, dtype_cast=False)[1]
    doc, evals = bq.read_reference(ref, tok, n_windows, length)
    per_text = {}
    for corpus, (refs, windows) in evals.items():
        lp, per = None, []
        for r, w in zip(refs, windows):
            lp = bq.window_logprobs(model, w, out=lp)
            per.append(bq.window_metrics(r, lp, w))
        kls, top1s, nlls = zip(*per)
        src = doc["source"]["texts"][corpus] if "texts" in doc["source"] else doc["source"]
        per_text[corpus] = {"kl": bq.summarize(kls), "kl_mean": sum(kls) / len(kls), "top1": bq.summarize(top1s),
                            **bq.ppl_record(nlls), "source_ppl": src["ppl"],
                            "per_window": {"kl": list(kls), "nll": list(nlls), "top1": list(top1s)}}
    return per_text


def main(argv=None):
    ap = argparse.ArgumentParser()
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("reference")
    r.add_argument("--out", required=True)
    r.add_argument("--windows", type=int, default=20)
    r.add_argument("--length", type=int, default=512)
    a = sub.add_parser("arm")
    a.add_argument("--ref", required=True)
    a.add_argument("--arm", required=True, choices=("scalar", "e8p", "trellis"))
    a.add_argument("--bits", type=int, default=2)
    a.add_argument("--L", type=int, default=10)
    a.add_argument("--mixed")
    a.add_argument("--blocks", type=int)
    a.add_argument("--windows", type=int, default=20)
    a.add_argument("--length", type=int, default=512)
    a.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    if args.cmd == "reference":
        bq.write_reference(SOURCE, Path(args.out), args.windows, args.length, prompts=(), texts=("devil", "jargon"))
        return
    widths = None
    if args.mixed:
        widths = json.loads((Path(args.mixed) / "quantized.json").read_text())["allocation"]["widths"]
    model, _ = bq.load_source(SOURCE)
    load0 = os.getloadavg()
    t0 = time.perf_counter()
    records = quantize_arm(model, args.arm, args.bits, args.L, widths, args.blocks)
    qsec = time.perf_counter() - t0
    bpw, wts = bits_per_weight(model, records)
    print(f"quantized in {qsec:.1f}s, {bpw:.4f} bits per weight over {wts} weights", flush=True)
    t1 = time.perf_counter()
    res = evaluate(model, args.ref, args.windows, args.length)
    out = {"arm": args.arm, "bits": args.bits, "L": args.L if args.arm == "trellis" else None, "mixed": args.mixed,
           "blocks": args.blocks, "bpw_codes_scales": bpw, "weights": wts, "quantize_seconds": qsec,
           "eval_seconds": time.perf_counter() - t1, "loadavg_start": load0, "loadavg_end": os.getloadavg(),
           "texts": res, "records": records}
    Path(args.out).write_text(json.dumps(out, indent=1))
    for c, v in res.items():
        print(f"{args.arm} {args.bits}b {c}: KL {v['kl']['median']:.4f} ppl {v['ppl']['median']:.2f} "
              f"(source {v['source_ppl']['median']:.2f}) top-1 {v['top1']['median']:.3f}", flush=True)


if __name__ == "__main__":
    main()
