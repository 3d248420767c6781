"""bench-kivi-latency: decode attention per layer as a model's layers see it, launch shapes x contexts.

The fifth H200 window found the op benchmark timing the wrong thing: its 32 launches per step are
independent (the GPU overlaps them) over contiguous fp16 arrays, while a model runs its layers one
after another over mlx-lm's ``KVCache`` slices. And its contiguous fp16 baseline at 32k read
158-161 us per layer in every run where a 32k row followed an 8k row in the same process, against
45-51 in runs where 32k came first. So here every context's arms run in ONE interleaved round
(A B C ... for 4k, 8k, 32k, 64k alike; no context "comes first"; ``--sequential``: the old
order, one context after another), at the Llama-3-8B geometry
(32 query heads, 8 KV heads, D = 128, fp16), ``--layers`` distinct caches per context:

- ``sdpa``: ``mx.fast.scaled_dot_product_attention`` on contiguous caches, layers independent (the
  op table's baseline); ``sdpa-chain``: the same with each layer's query the previous layer's
  output; ``sdpa-vchain``: the chain over slices of buffers one 256-token step longer, as
  ``KVCache`` hands them over (the baseline a model sees; its A/A copy gives the floor);
- ``kivi<bits>@<shape>``: the packed cache's decode kernel at a launch shape (decode_kernel.Shape,
  e.g. ``8x4:pf0:mb0``; ``8xf``: splits that fill the GPU), layers independent;
  ``kivi<bits>-chain@<shape>``: the same chained.

Per arm and sample, per layer: ``build`` (Python builds the graph), ``dispatch`` (build plus
``mx.async_eval``) and ``total`` (through ``mx.synchronize``); ``total - dispatch`` is what the
device still had to do after the host let go (a lower bound on device time).

    python -m experiments.kivi_latency --out lat.json --contexts 4096,8192,32768,65536 --shapes default,8xf,4/4xf,2/4xf:pf1
"""

import argparse
import sys

import mlx.core as mx

from vqpipe.bench import env, harness
from experiments.kivi_floor import run_parts
from vqpipe.store.fsutil import write_json
from vqpipe.kivi import decode_kernel
from vqpipe.kivi.store import PackedKIVICache

HQ, HK, D = 32, 8, 128


def _caches(s, layers, bits_list):
    """Per layer: contiguous fp16 keys/values, the same in 256-longer buffers, packed caches per bits."""
    keys = mx.random.split(mx.random.key(s), 2 * layers)
    fp, padded, packed = [], [], {b: [] for b in bits_list}
    pad = mx.zeros((1, HK, 256, D), mx.float16)
    for j in range(layers):
        k = mx.random.normal((1, HK, s, D), key=keys[2 * j]).astype(mx.float16)
        v = mx.random.normal((1, HK, s, D), key=keys[2 * j + 1]).astype(mx.float16)
        fp.append((k, v))
        padded.append((mx.concatenate([k, pad], axis=2), mx.concatenate([v, pad], axis=2)))
        for b in bits_list:
            c = PackedKIVICache(b, 32, 128)
            c.update_and_fetch(k, v)
            packed[b].append(c)
        mx.eval(fp[-1], padded[-1], [c.state[:6] for b in bits_list for c in packed[b][-1:]])
    return fp, padded, packed


def _chain(x, layers, attend):
    for layer in layers:
        x = attend(x, layer)
    return [x]


def _kivi(q, c, scale, shape):
    return decode_kernel.decode_attention(q, c, scale, warps=shape.warps, ahead=shape.ahead, minblocks=shape.minblocks,
                                          splits=_splits(c, shape), version=shape.version or "v3")


def _splits(c, shape):
    chunks = c.quantized // 32 + -(-c.nres // 32)
    return decode_kernel.default_splits(chunks, shape.warps, shape.per_warp, c.residual_buffers()[0].shape[1],
                                        decode_kernel.resident_blocks(c.kv_bits, shape))


def _shapes_for(shapes, bits):
    """The shapes of ``--shapes`` that apply at ``bits``: "SHAPE" at every width, "N/SHAPE" at N only,
    "default" the width's default v3 shape (decode_kernel.V3_SHAPES), "v4" kernel v4's (decode_kernel.V4_SHAPE;
    a shape text ending ":v4" is v4 at that shape), "v4r" the seventh window's v4 at that shape, "v4m" v4r with v4's final merge."""
    out = []
    for text in shapes:
        only, _, shape = text.rpartition("/")
        if only and int(only) != bits:
            continue
        named = {"default": "v3", "v4": "v4", "v4r": "v4r", "v4m": "v4m"}
        out.append(decode_kernel.shape_text(decode_kernel.default_shape(bits, named[shape])) if shape in named else shape)
    return list(dict.fromkeys(out))


def context_arms(s, args, qs, scale):
    """The arms of one context (names end in " S=<s>") and the packed caches they read."""
    fp, padded, packed = _caches(s, args.layers, args.bits)
    n = len(qs)
    q = lambda i, j: qs[(i + j) % n]  # noqa: E731
    tag = f" S={s}"
    arms = {
        "sdpa" + tag: lambda i: [mx.fast.scaled_dot_product_attention(q(i, j), k, v, scale=scale) for j, (k, v) in enumerate(fp)],
        "sdpa-chain" + tag: lambda i: _chain(q(i, 0), fp, lambda x, kv: mx.fast.scaled_dot_product_attention(x, *kv, scale=scale)),
        "sdpa-vchain" + tag: lambda i: _chain(q(i, 0), padded, lambda x, kv: mx.fast.scaled_dot_product_attention(
            x, kv[0][..., :s, :], kv[1][..., :s, :], scale=scale)),
    }
    for b in args.bits:
        for text in _shapes_for(args.shapes, b):
            sh = decode_kernel.parse_shape(text)
            name = decode_kernel.shape_text(sh)
            cs = packed[b]
            if not args.chain_only:
                arms[f"kivi{b}@{name}{tag}"] = lambda i, cs=cs, sh=sh: [_kivi(q(i, j), c, scale, sh) for j, c in enumerate(cs)]
            arms[f"kivi{b}-chain@{name}{tag}"] = lambda i, cs=cs, sh=sh: _chain(q(i, 0), cs, lambda x, c: _kivi(x, c, scale, sh))
    return arms, packed


def splits_table(packed, shapes):
    """Per bits and shape: (splits, blocks) at this context."""
    out = {}
    for b, cs in packed.items():
        c = cs[0]
        for text in _shapes_for(shapes, b):
            sh = decode_kernel.parse_shape(text)
            ns = _splits(c, sh)
            out[f"kivi{b}@{decode_kernel.shape_text(sh)}"] = {"splits": ns, "blocks": ns * HK}
    return out


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m experiments.kivi_latency", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--contexts", type=lambda t: [int(x) for x in t.split(",") if x], default=[4096, 8192, 32768, 65536])
    p.add_argument("--shapes", type=lambda t: [x for x in t.split(",") if x], default=["default", "8xf", "4xf"],
                   help="launch shapes (decode_kernel.parse_shape), N/SHAPE for bits N only, default: each width's default")
    p.add_argument("--bits", type=lambda t: [int(x) for x in t.split(",") if x], default=[4, 2])
    p.add_argument("--chain-only", action="store_true", help="no independent-layer KIVI arms")
    p.add_argument("--sequential", action="store_true",
                   help="time the contexts one after another (each interleaved within itself) instead of all in one interleave")
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--inputs", type=int, default=20)
    p.add_argument("--repeats", type=int, default=25)
    p.add_argument("--warmup", type=int, default=5)
    args = p.parse_args(sys.argv[1:] if argv is None else argv)
    for b in args.bits:
        for text in _shapes_for(args.shapes, b):
            decode_kernel.parse_shape(text)  # a bad shape fails here, before any cache is built
    result = {"kind": "bench-kivi-latency", "environment": env.environment_or_error(),
              "config": {k: v for k, v in vars(args).items() if k != "out"},
              "multiprocessors": decode_kernel.multiprocessors(), "registers": {f"{b}:pf{a}": r for (b, a), r in decode_kernel.V3_REGISTERS.items()}}
    if not decode_kernel.active(None):
        print("bench-kivi-latency: needs the decode kernel (a GPU); skipped", flush=True)
        write_json(args.out, result)
        return 0
    qs = [mx.random.normal((1, HQ, 1, D), key=mx.random.key(1000 + i)).astype(mx.float16) for i in range(args.inputs)]
    mx.eval(qs)
    scale = D**-0.5
    arms, splits, failed = {}, {}, {}
    for s in args.contexts:
        got, packed = context_arms(s, args, qs, scale)
        splits[s] = splits_table(packed, args.shapes)
        for name in list(got):  # one call each (JIT compiles here): an arm that cannot run is reported
            try:
                mx.eval(got[name](0))
            except (RuntimeError, ValueError) as e:
                failed[name] = f"{type(e).__name__}: {str(e)[-300:]}"
                del got[name]
        arms.update(got)
        arms[f"sdpa-vchain S={s}" + harness.AA_SUFFIX] = got[f"sdpa-vchain S={s}"]
    if args.sequential:  # the old probe's order: each context's rounds after the previous context's
        times = {}
        for s in args.contexts:
            times.update(run_parts({k: f for k, f in arms.items() if k.split(harness.AA_SUFFIX)[0].endswith(f" S={s}")},
                                   args.inputs, args.repeats, args.warmup))
    else:
        times = run_parts(arms, args.inputs, args.repeats, args.warmup)
    rows = {}
    for s in args.contexts:
        base = f"sdpa-vchain S={s}"
        floor = harness.noise_floor(times[base]["total"], times[base + harness.AA_SUFFIX]["total"])
        row = {"S": s, "noise_floor": floor, "splits": splits[s], "arms": {}}
        for name, parts in times.items():
            if not name.split(harness.AA_SUFFIX)[0].endswith(f" S={s}"):
                continue
            st = {k: harness.summarize([t / args.layers for t in v]) for k, v in parts.items()}
            st["vs_sdpa_vchain"] = harness.compare(times[base]["total"], parts["total"], floor)["speedup"]
            st["vs_sdpa"] = harness.compare(times[f"sdpa S={s}"]["total"], parts["total"], floor)["speedup"]
            row["arms"][name.replace(f" S={s}", "")] = st
        rows[s] = row
        print(f"latency S={s} (us per layer, median [min-max], n={args.repeats}, A/A floor {floor:.1%} on sdpa-vchain):", flush=True)
        for name, a in row["arms"].items():
            print(f"  {name:<28}" + "  ".join(f"{k} {a[k]['median'] * 1e6:7.1f} [{a[k]['min'] * 1e6:.1f}-{a[k]['max'] * 1e6:.1f}]"
                                              for k in ("build", "dispatch", "total"))
                  + f"  after-dispatch {(a['total']['median'] - a['dispatch']['median']) * 1e6:6.1f}"
                  + f"  vs vchain {a['vs_sdpa_vchain']:.2f}x vs sdpa {a['vs_sdpa']:.2f}x", flush=True)
    result.update({"rows": [rows[s] for s in args.contexts], "failed": failed})
    if failed:
        print(f"failed arms: {failed}", flush=True)
    write_json(args.out, result)
    print(f"bench-kivi-latency: wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
