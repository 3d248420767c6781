"""Where does the quantization loss come from, and where do extra bits pay? (issue 11)

    PYTHONPATH=$PWD python scripts/bits_sweep.py cache --source DIR --moments DIR --bits 3 4 5 6 8 --out CACHE
    PYTHONPATH=$PWD python scripts/bits_sweep.py eval --source DIR --cache CACHE --windows 4 \\
        --arm all4=4 head-only=fp,embed_tokens=4 head8=4,embed_tokens=8 ...

``cache`` quantizes every layer of the model at each width (GPTQ with the stored full-precision
moments, group-64 scales, the tied head calibrated: the default SmolLM2 options) and keeps, per
layer and width, the dequantized weight, its stored bits (codes, scales, codebook, rotation: what
bench-quality counts) and its H-weighted output error tr(E H E^T). With full-precision moments a
layer's codes do not depend on the other layers' widths, so any mixed allocation is the
assembly of cached layers: one forward pass per arm, no quantization.

``eval`` assembles arms and measures them on windows of the eval split (``--split eval``) or of
the calibration split (``--split calibration``, another seed than the moments': for choosing an
allocation without looking at the evaluation text). An arm is ``NAME=BASE[,REGEX=BITS...]``:
BASE is a width or ``fp`` (the source's weights) or ``WIDTH@DIR`` (from the cache in DIR, e.g. one
made with other moments), each REGEX (re.search on the layer name) sets
the width of the layers it matches, later ones win. Bits per weight are over every weight matrix.
"""

import argparse
import json
import math
import re
import sys
import time
from pathlib import Path

import mlx.core as mx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from vqpipe import text  # noqa: E402
from vqpipe.bench.harness import summarize  # noqa: E402
from vqpipe.stages.bench_quality import load_source, logprobs, source_references, window_metrics  # noqa: E402


def stored_bits(layer):
    """What bench-quality's bits_per_weight counts for one layer (every to_state array but the bias)."""
    _, arrays = layer.to_state()
    return sum(v.nbytes * 8 for k, v in arrays.items() if k != "bias")


def cache(args):
    from vqpipe.quant.config import QuantizeConfig
    from vqpipe.quant.quantize import quantize_model
    from vqpipe.store import calibration

    stored, _ = calibration.load(args.moments)
    args.group_size = args.group_size or None
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for bits in args.bits:
        t0 = time.perf_counter()
        model, _ = load_source(args.source)
        layer_bits = None
        if bits not in (2, 3, 4):  # a width only a layer may have: every layer gets it
            layer_bits = [{"match": ".", "bits": bits}]
        config = QuantizeConfig(4 if layer_bits else bits, dtype="float32", group_size=args.group_size, fuse=False,
                                layer_bits=layer_bits, threads=1)
        records = quantize_model(model, config, moments=stored)
        modules = dict(model.named_modules())
        weights, info = {}, {}
        for r in records:
            layer = modules[r["name"]]
            w = layer.dequantized_weight(mx.float32)
            weights[r["name"]] = w
            info[r["name"]] = {"bits": layer.bits, "stored_bits": stored_bits(layer),
                               "weights": layer.in_features * layer.out_features, "rel_mse": r["rel_mse"]}
        # H-weighted error from the source weights, in float32 MLX (fast)
        src, _ = load_source(args.source)
        smods = dict(src.named_modules())
        for name, w in weights.items():
            _, h = stored[name]
            e = smods[name].weight.astype(mx.float32) - w
            eh = mx.sum((e @ h) * e).item()
            wh = mx.sum((smods[name].weight.astype(mx.float32) @ h) * smods[name].weight.astype(mx.float32)).item()
            info[name].update({"h_err": eh, "h_rel": eh / max(wh, 1e-30)})
        mx.save_safetensors(str(out / f"b{bits}.safetensors"), weights)
        (out / f"b{bits}.json").write_text(json.dumps(info, indent=1))
        print(f"cached {bits} bits: {len(weights)} layers in {time.perf_counter() - t0:.1f}s", flush=True)
        del model, weights, src


def parse_arm(spec):
    name, _, body = spec.partition("=")
    base, *rules = body.split(",")
    return name, base, [(re.compile(r), b) for r, b in (x.rsplit("=", 1) for x in rules)]


def assign(names, base, rules):
    out = {}
    for n in names:
        b = base
        for rx, bb in rules:
            if rx.search(n):
                b = bb
        out[n] = b
    return out


def windows_for(tok, args):
    if args.split == "eval":
        allw = text.eval_windows(tok, 20, args.length)
        idx = [round(i * 20 / args.windows) for i in range(args.windows)]
        return [allw[i] for i in idx]
    t = text.calibration_tokens(tok, args.windows, args.length, args.seed)
    return [t[i] for i in range(t.shape[0])]


def evaluate(args):
    import tempfile

    cdir = Path(args.cache)
    source, tok = load_source(args.source)
    wins = windows_for(tok, args)
    tmp = tempfile.TemporaryDirectory(prefix="bits-sweep-")
    refs, src_nll = source_references(source, wins, tmp.name)
    print(f"source: ppl {math.exp(sum(src_nll) / len(src_nll)):.2f} ({len(wins)} {args.split} windows x {args.length})",
          flush=True)
    infos = {int(p.stem[1:]): json.loads(p.read_text()) for p in cdir.glob("b*.json")}
    names = list(next(iter(infos.values())))
    mods = dict(source.named_modules())
    orig = {n: mods[n].weight for n in names}
    total_w = sum(v["weights"] for v in next(iter(infos.values())).values())
    loaded = {}
    rows = []
    for spec in args.arm:
        name, base, rules = parse_arm(spec)
        bits = assign(names, base, rules)
        upd, stored = [], 0.0
        for n, b in bits.items():
            if b == "fp":
                upd.append((n + ".weight", orig[n]))
                stored += 16 * infos[4][n]["weights"]
                continue
            b, _, where = b.partition("@")  # WIDTH@DIR: that width from another cache
            b, where = int(b), Path(where) if where else cdir
            if (b, where) not in loaded:
                loaded[b, where] = (mx.load(str(where / f"b{b}.safetensors")),
                                    json.loads((where / f"b{b}.json").read_text()))
            upd.append((n + ".weight", loaded[b, where][0][n]))
            stored += loaded[b, where][1][n]["stored_bits"]
        source.load_weights(upd, strict=False)
        t0 = time.perf_counter()
        kls, top1s, nlls = zip(*(window_metrics(r, logprobs(source, w), w) for r, w in zip(refs, wins)))
        row = {"arm": name, "spec": spec, "bpw": stored / total_w, "ppl": math.exp(sum(nlls) / len(nlls)),
               "kl": summarize(kls), "kl_mean": sum(kls) / len(kls), "top1": sum(top1s) / len(top1s),
               "per_window": {"kl": list(kls), "nll": list(nlls)}}
        rows.append(row)
        print(f"{name:28s} bpw {row['bpw']:.3f}  ppl {row['ppl']:7.2f}  KL {row['kl']['median']:.4f} "
              f"[{row['kl']['min']:.4f}-{row['kl']['max']:.4f}] mean {row['kl_mean']:.4f}  top1 {row['top1']:.3f}"
              f"  ({time.perf_counter() - t0:.0f}s)", flush=True)
        if args.out:  # after every arm: a long sweep stopped early keeps what it measured
            Path(args.out).write_text(json.dumps({"split": args.split, "windows": len(wins), "length": args.length,
                                                  "source_nll": src_nll, "rows": rows}, indent=1))
    source.load_weights([(n + ".weight", w) for n, w in orig.items()], strict=False)


TYPES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def plan(args):
    """Rules for ``layer_bits`` from measured gains: the KL saved by +1 bit on every layer of one
    type (arms named after the type, e.g. ``v_proj``), on every layer of one block (``blkL``) and
    on the head (``head``), each against the arm ``all{base}``. A (type, block) layer's gain is
    modelled as separable, G_type * B_block / sum(B): the per-type and per-block measurements are
    its margins (37 arms instead of 210). A second extra bit is worth ``decay`` times the first
    (KL falls about 3.8x per bit, measured: docs/results/2026-12-05-logs/quality-history.md). Greedy on gain per bit."""
    from vqpipe.codec import allocate

    saved = {}  # arm -> KL saved against the all{base} arm of the same file (same windows)
    for f in args.gains:
        rows = {r["arm"]: r for r in json.loads(Path(f).read_text())["rows"]}
        ref = rows[f"all{args.base}"]["kl_mean"]
        saved.update({a: ref - r["kl_mean"] for a, r in rows.items()})
        base = ref
    info = json.loads((Path(args.cache) / f"b{args.base}.json").read_text())
    gain_t = {t: saved[t] for t in TYPES}
    blocks = sorted(int(k[3:]) for k in saved if re.fullmatch(r"blk\d+", k))
    gain_b = {b: max(saved[f"blk{b}"], 0.0) for b in blocks}
    total_b = sum(gain_b.values())
    weights = {n: v["weights"] for n, v in info.items()}
    all_w = sum(weights.values())
    gains, costs, unit = {}, {}, {}
    for n, w in weights.items():
        m = re.search(r"layers\.(\d+)\..*\.(\w+)$", n)
        if m:
            g = gain_t[m.group(2)] * gain_b[int(m.group(1))] / total_b
        elif "head" in saved and n.endswith("embed_tokens"):
            g = saved["head"]
        else:
            continue
        for k in range(1, args.max_add + 1):
            gains[n, k] = g * args.decay ** (k - 1)
            costs[n, k] = w / all_w  # one more bit on these weights, in bits per weight of the model
            unit[n, k] = n
    chosen = allocate.greedy(gains, costs, args.budget)
    add = {}
    for n, k in chosen:  # a second bit is only taken after the first (its gain is smaller)
        add[n] = max(add.get(n, 0), k)
    rules = []
    for k in sorted(set(add.values())):
        for t in TYPES:
            ls = sorted(int(re.search(r"layers\.(\d+)\.", n).group(1)) for n, a in add.items() if a == k and n.endswith(t))
            if ls:
                rules.append({"match": rf"layers\.({'|'.join(map(str, ls))})\..*{t}$", "add": k})
        if any(a == k and n.endswith("embed_tokens") for n, a in add.items()):
            rules.append({"match": "embed_tokens", "add": k})
    spent = sum(costs[c] for c in chosen)
    print(f"predicted KL saved {sum(gains[c] for c in chosen):.4f} of {base:.4f} for {spent:.4f} extra bits per weight")
    print(json.dumps(rules))


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("cache")
    c.add_argument("--source", required=True)
    c.add_argument("--moments", required=True)
    c.add_argument("--bits", type=int, nargs="+", default=[3, 4, 5, 6, 8])
    c.add_argument("--group-size", type=int, default=64, help="0: one scale per row")
    c.add_argument("--out", required=True)
    e = sub.add_parser("eval")
    e.add_argument("--source", required=True)
    e.add_argument("--cache", required=True)
    e.add_argument("--arm", nargs="+", required=True)
    e.add_argument("--windows", type=int, default=4)
    e.add_argument("--length", type=int, default=512)
    e.add_argument("--split", choices=("eval", "calibration"), default="eval")
    e.add_argument("--seed", type=int, default=1, help="calibration split: window seed (the moments use 0)")
    e.add_argument("--out", default=None)
    a = sub.add_parser("plan")
    a.add_argument("--gains", nargs="+", required=True, help="eval JSONs with the all{base}, type, blkL (and head) arms")
    a.add_argument("--cache", required=True)
    a.add_argument("--base", type=int, default=4)
    a.add_argument("--budget", type=float, required=True, help="extra bits per weight to spend")
    a.add_argument("--max-add", type=int, default=2)
    a.add_argument("--decay", type=float, default=1 / 3.8)
    args = p.parse_args(argv)
    {"cache": cache, "eval": evaluate, "plan": plan}[args.cmd](args)


if __name__ == "__main__":
    main()
