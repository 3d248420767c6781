"""GPTQ aimed at the full-precision model's output (asymmetric calibration), against GPTQ on the
full-precision moments (the recipe's default) and on sequential moments: SmolLM2, untuned.

    python -m experiments.asym_gptq --arm fp|seq|asym --bits 2 --ref DIR --out FILE.json [--windows 64]

GPTQ minimises ||(W - W_hat) X||^2 for the input X a layer sees. With sequential moments X is
what the already quantized blocks hand on, and the target is still W X although the model wanted
W X~ (X~: the full-precision model's input to the layer). Minimising ||W X~ - W_hat X||^2 instead
is GPTQ on the target W' = W G H^-1 with H = X^T X and G = X~^T X (G, H summed over tokens): the
unquantized weight that best maps the quantized model's input to the full-precision output;
the rest of the objective does not depend on W_hat. (GPTAQ, Li et al. 2025, and Qronos, Zhang et
al. 2025, fold the same correction into the GPTQ recursion.) H is damped as GPTQ damps it.

Arms: ``fp`` the calibrate stage's stored moments (results/calibration/smollm2), ``seq`` moments
from the quantized stream, ``asym`` the corrected target on the quantized stream. The widths are
the recipe's allocation (computed by the ``fp`` arm from the stored moments and sensitivities, and
passed to the others as rules), tuning off. Held-out KL: 16 calibration-split windows that the 64
calibration windows (seed 0) do not contain; the evaluation texts as experiments/vq/smollm2.py
(bench-quality's windows against the source's reference), reported, not used to choose.
"""

import argparse
import json
import time
from pathlib import Path

import mlx.core as mx
import numpy as np

from vqpipe import text as corpus
from vqpipe.quant import calibrate, quantize
from vqpipe.quant.config import QuantizeConfig
from vqpipe.quant.tune import kl, teacher_of, target  # noqa: F401
from vqpipe.stages import bench_quality as bq
from vqpipe.store import calibration as stored

from experiments.vq.smollm2 import MOMENTS, SOURCE, evaluate

DAMP = 0.01


def held_out_windows(tokenizer, n=16, length=512, used=64, seed=0):
    """``n`` calibration-split windows in slots the ``used`` calibration windows of ``seed`` do not take."""
    ids = np.asarray(corpus.tokens(tokenizer, "calibration"), dtype=np.int32)
    slots = len(ids) // length
    taken = set(np.random.default_rng(seed).choice(slots, used, replace=False).tolist())
    free = np.array([s for s in range(slots) if s not in taken])
    pick = np.sort(np.random.default_rng(1000 + seed).choice(free, n, replace=False))
    return mx.array(np.stack([ids[s * length:(s + 1) * length] for s in pick]))


def quantize_asymmetric(model, tokens, quantize_one, targets, progress=None, sequential=True, rotation=None,
                        damp=DAMP, blocks=None, correct=True):
    """calibrate.quantize_calibrated's sequential path with each linear's target corrected to the
    full-precision stream (module docstring). Moments unrotated (quantize_one rotates them)."""
    inner = calibrate.decoder(model)
    kinds = dict(targets)
    records = {}
    prefix = {id(m): n for n, m in model.named_modules()}
    head = prefix[id(inner.embed_tokens)] if calibrate.tied_head(model) else None
    for name, kind in targets:
        if kind != "linear" and not (name == head and kind == "embedding"):
            records[name] = quantize_one(name, kind, None)
    block_names = [prefix[id(layer)] for layer in inner.layers]
    h, calls = calibrate.decoder_inputs(model, calibrate._batches(tokens))
    h = [x.astype(mx.float32) for x in h]
    hf = list(h)
    mx.eval(h)
    modules = dict(model.named_modules())
    for i, (layer, bname) in enumerate(zip(inner.layers, block_names)):
        t0 = time.perf_counter()
        names = [n for n in kinds if kinds[n] == "linear" and n.startswith(bname + ".")]
        run = calibrate.block_forward(layer, calls[i])
        seen = {}

        def record(name, x):
            seen[name] = x

        for n in names:
            calibrate._set(model, n, calibrate._Recorder(modules[n], n, record))
        H, G, owner, outs_f = {}, {}, {}, []
        try:
            for bf, bq_ in zip(hf, h):
                seen.clear()
                outs_f.append(run(bf))
                mx.eval(outs_f[-1])
                xf = dict(seen)
                seen.clear()
                mx.eval(run(bq_))
                xq = dict(seen)
                ids = {}
                for n in names:
                    key = ids.setdefault(id(xq[n]), n)
                    owner[n] = key
                    if key != n:
                        continue
                    a = np.asarray(xq[n].reshape(-1, xq[n].shape[-1]).astype(mx.float32))
                    f = np.asarray(xf[n].reshape(-1, xf[n].shape[-1]).astype(mx.float32))
                    H[key] = H.get(key, 0) + a.T @ a
                    G[key] = G.get(key, 0) + f.T @ a
        finally:
            for n in names:
                calibrate._set(model, n, modules[n])
        maps = {}
        for key in H:
            d = H[key].shape[0]
            hd = H[key].astype(np.float64) + damp * np.mean(np.diag(H[key])) * np.eye(d)
            # W' = W + W (G - H) Hd^-1: W itself where the inputs agree (damping shrinks nothing)
            dg = (G[key] - H[key]).astype(np.float64)
            maps[key] = (np.eye(d) + np.linalg.solve(hd, dg.T).T).astype(np.float32)
        for n in names:
            m = modules[n]
            w = np.asarray(m.weight.astype(mx.float32))
            if correct:
                w2 = w @ maps[owner[n]]
                if progress:
                    progress(f"{n}: |W'|/|W| {np.linalg.norm(w2) / np.linalg.norm(w):.3f}")
                m.weight = mx.array(w2).astype(m.weight.dtype)
            records[n] = quantize_one(n, "linear", mx.array(H[owner[n]]))
            records[n]["hessian"] = owner[n]
        out = calibrate.block_forward(inner.layers[i], calls[i])
        h = [out(x) for x in h]
        mx.eval(h)
        hf = outs_f
        err = sum(float(mx.sum((a - b) ** 2).item()) for a, b in zip(h, hf)) / sum(float(mx.sum(b ** 2).item()) for b in hf)
        if progress:
            progress(f"stream error after block {i + 1}: {err:.5f}")
        if blocks is not None and i + 1 >= blocks:
            return err
        if progress:
            progress(f"[block {i + 1}/{len(inner.layers)}] {len(names)} layers {time.perf_counter() - t0:.2f}s")
    rest = [n for n in kinds if n not in records]
    normed = calibrate.head_inputs(model, [inner.norm(x) for x in h]) if rest else []
    for name in rest:
        reads_norm = name.split(".")[-1] == "lm_head" or name == head
        records[name] = quantize_one(name, kinds[name], calibrate.moments(normed) if reads_norm else None)
    return [records[n] for n, _ in targets if n in records]


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--arm", required=True, choices=("fp", "seq", "asym"))
    ap.add_argument("--bits", type=int, default=2)
    ap.add_argument("--ref", required=True)
    ap.add_argument("--widths", help="JSON file of {layer: width} (the fp arm writes it beside its --out)")
    ap.add_argument("--windows", type=int, default=64)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--tune", action="store_true", help="tune the row scales as the recipe does (its auto steps)")
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    model, tok = bq.load_source(SOURCE, dtype_cast=False)
    held = held_out_windows(tok)
    teacher = teacher_of(model)
    tlogits = [teacher(held[j:j + 1]) for j in range(held.shape[0])]
    mx.eval(tlogits)
    del teacher
    t0 = time.perf_counter()
    summary = {}
    if args.arm == "fp":
        moments, fisher = stored.load(MOMENTS), stored.load_fisher(MOMENTS)
        moments = moments[0] if isinstance(moments, tuple) else moments
        config = QuantizeConfig(bits=args.bits, tune_steps="auto" if args.tune else 0, threads=args.threads,
                                calib_text="none")
        tune_tokens = calibrate.calibration_tokens(tok, "text", args.windows, 512, 0)[0] if args.tune else None
        records = quantize.quantize_model(model, config, moments=moments, fisher=fisher, tune_tokens=tune_tokens,
                                          summary=summary, progress=print)
        widths = {r["name"]: r["bits"] for r in records if r["bits"] != args.bits}
        if not args.widths:
            Path(args.out).with_suffix(".widths.json").write_text(json.dumps(widths, indent=1))
    else:
        widths = json.loads(Path(args.widths).read_text())
        rules = [{"match": "^" + n.replace(".", r"\.") + "$", "bits": b} for n, b in widths.items()]
        config = QuantizeConfig(bits=args.bits, tune_steps="auto" if args.tune else 0, threads=args.threads,
                                layer_bits=rules, sequential=True, calib_windows=args.windows)
        tokens = calibrate.calibration_tokens(tok, "text", args.windows, 512, 0)[0]
        if args.arm == "asym":
            quantize.quantize_calibrated = quantize_asymmetric
        records = quantize.quantize_model(model, config, calibration=tokens, summary=summary, progress=print)
    seconds = time.perf_counter() - t0
    held_kl = [kl(model, held[j:j + 1], tlogits[j]).item() for j in range(held.shape[0])]
    res = evaluate(model, args.ref, 20, 512)
    doc = {"arm": args.arm, "bits": args.bits, "seconds": seconds, "held_out_kl": held_kl,
           "held_out_kl_mean": float(np.mean(held_kl)), "widths": widths, "tune": summary.get("tune"), "texts": res}
    Path(args.out).write_text(json.dumps(doc, indent=1))
    print(f"{args.arm} b{args.bits}: held-out KL {np.mean(held_kl):.4f} "
          + " ".join(f"{c} KL {v['kl']['median']:.4f} ppl {v['ppl']['median']:.2f}" for c, v in res.items())
          + f" ({seconds:.0f} s)", flush=True)


if __name__ == "__main__":
    main()
