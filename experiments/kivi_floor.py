"""bench-kivi-floor: what one ``mx.fast.cuda_kernel`` launch costs, part by part, and one prefill chunk.

The second H200 window found that a launch with the decode kernel's inputs that does no work costs
46 µs per layer at 32k, against 57.5 µs for the whole of fp16 SDPA. This splits that figure. Arms,
Llama-3-8B geometry (32 query heads, 8 KV heads, D = 128, fp16), ``--layers`` distinct caches per
step as a decode step runs them, interleaved in one process with an A/A copy of fp16 SDPA:

- ``sdpa``: ``mx.fast.scaled_dot_product_attention`` on an fp16 cache (the baseline);
- ``add``: one built-in elementwise op on the query per layer: a built-in op's floor;
- ``noop1``: a custom kernel with one input (the query) that writes zeros; ``noop1-compiled`` the
  same call inside ``mx.compile`` (the graph replayed, not rebuilt);
- ``noop11-float3``: the decode kernel's 11 inputs made per call as the second window made them
  (12-byte float32 counts) — that window's floor; ``noop11``: the same with the current 8-byte
  counts; ``noop11-fixed``: the 11 inputs made once per layer, reused every step;
- ``kivi4-float3`` / ``kivi4``: the decode kernel with each way of passing the counts;
  ``kivi4-compiled``: the current launch inside ``mx.compile``; ``kivi4-v2``: the second window's
  kernel (decode_kernel version "v2") with the current launch, ``kivi4-v2-full`` the same with its
  source unminified (comments and indentation: MLX rebuilds the source string every call);
  ``kivi4-v3`` / ``kivi4-v3-chain``, ``kivi4-v4`` / ``kivi4-v4-chain``: kernel v3 or v4 by name (``kivi4``: the default), ``kivi4-v4r-chain``
  the seventh window's v4;
- latency, as a model's layers see it: ``sdpa-chain`` / ``kivi4-chain``: each layer's query is the
  previous layer's output, so the 32 launches run one after another (in the arms above they are
  independent and the GPU overlaps them); ``sdpa-vchain`` the same over slices of buffers one
  256-token step longer, as mlx-lm's ``KVCache`` hands them over (MLX's CUDA SDPA takes another
  path for such slices: 3x faster at 32k, H200, docs/kivi.md); ``sdpa-step`` / ``kivi4-step``: the
  chain with each layer's cache update first (a new token's key and value sliced from the previous
  output; mlx-lm's ``KVCache`` against ``PackedKIVICache`` through ``attention.attend``, as the
  model calls them; caches of their own, growing one token per call, so a flush falls in every 32
  calls). ``-c1`` / ``-c2``: splits for 1 or 2 chunks per warp instead of the default shape's.

Per arm and sample: ``build`` (Python builds the step's graph, no evaluation), ``dispatch`` (build
plus ``mx.async_eval``: everything the host does before waiting) and ``total`` (through
``mx.synchronize``), per layer. ``--prefill``: one prefill chunk's attention over the packed cache
(``attend_tiles``, query length ``--chunk``) at context S, per layer, for each SCORES setting.

    python -m experiments.kivi_floor --out floor.json --contexts 32768,4096
"""

import argparse
import gc
import sys
import time

import mlx.core as mx
from mlx_lm.models.cache import KVCache

from vqpipe.bench import env, harness
from vqpipe.store.fsutil import write_json
from vqpipe.kivi import attention, decode_kernel
from vqpipe.kivi.store import PackedKIVICache

HQ, HK, D = 32, 8, 128

_NOOP = """
    const unsigned int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < (unsigned int)(q_shape[0] * q_shape[1] * q_shape[2] * q_shape[3])) {
        out[i] = static_cast<T>(0.0f);
    }
"""
_noops = {}


def _noop(names):
    key = tuple(names)
    if key not in _noops:
        _noops[key] = mx.fast.cuda_kernel(name=f"kivi_floor_{len(names)}", input_names=list(names), output_names=["out"], source=_NOOP)
    return _noops[key]


def _noop_call(inputs, q):
    kern = _noop(decode_kernel.INPUTS[: len(inputs)] if len(inputs) > 1 else ["q"])
    return kern(inputs=inputs, template=[("T", q.dtype)], grid=(-(-q.size // 256) * 256, 1, 1), threadgroup=(256, 1, 1),
                output_shapes=[q.shape], output_dtypes=[q.dtype])[0]


_compiled = {}


def _compiled_call(kern, spec, inputs):
    """``kern`` on ``inputs`` inside mx.compile, one compiled function per launch spec."""
    key = (id(kern), repr(spec))
    if key not in _compiled:
        _compiled[key] = mx.compile(lambda *xs: kern(inputs=list(xs), **spec)[0])
    return _compiled[key](*inputs)


def _kivi(q, c, scale, meta=None, compiled=False, version=None, minify=True):
    inputs, spec, shape = decode_kernel.launch_args(q, c, scale, meta=meta, version=version)
    kern = decode_kernel._kernel("cuda", shape.version, meta, shape.warps, shape.minblocks, minify)  # the version launch_args picked
    out = _compiled_call(kern, spec, inputs) if compiled else kern(inputs=inputs, **spec)[0]
    c.last_out = out
    return out


def _noop11(q, c, scale, meta=None):
    inputs = decode_kernel.launch_args(q, c, scale, meta=meta)[0]
    out = _noop_call(inputs, q)
    c.last_out = out
    return out


def _caches(s, layers):
    keys = mx.random.split(mx.random.key(s), 2 * layers)
    fp, kv = [], []
    for j in range(layers):
        k = mx.random.normal((1, HK, s, D), key=keys[2 * j]).astype(mx.float16)
        v = mx.random.normal((1, HK, s, D), key=keys[2 * j + 1]).astype(mx.float16)
        c = PackedKIVICache(4, 32, 128)
        c.update_and_fetch(k, v)
        mx.eval(k, v, c.state[:6])
        fp.append((k, v))
        kv.append(c)
    return fp, kv


def _chain(x, layers, attend):
    """The layers' attention one after another: each query the previous output (a model's order)."""
    for layer in layers:
        x = attend(x, layer)
    return [x]


def _splits(c, per_warp):
    """Splits for ``per_warp`` chunks per warp at the default warp count (the -cN arms)."""
    chunks = c.quantized // 32 + -(-c.nres // 32)
    return decode_kernel.default_splits(chunks, decode_kernel.default_shape(4).warps, per_warp)


def _step_caches(fp, names):
    """Caches of their own for the step arms (they grow), filled with the same keys and values."""
    steps = {}
    packed = lambda: PackedKIVICache(4, 32, 128)  # noqa: E731
    for name, make in (("sdpa-step", KVCache), ("kivi4-step", packed), ("kivi4-step-c1", packed)):
        if name in names:
            steps[name] = [make() for _ in fp]
            for c, (k, v) in zip(steps[name], fp):
                c.update_and_fetch(k, v)
            mx.eval([c.state[:6] if isinstance(c, PackedKIVICache) else c.state for c in steps[name]])
    if "sdpa-vchain" in names:  # buffers one 256-token step longer, read through slices as KVCache returns them
        pad = mx.zeros((1, HK, 256, D), mx.float16)
        steps["sdpa-vchain"] = [(mx.concatenate([k, pad], axis=2), mx.concatenate([v, pad], axis=2)) for k, v in fp]
        mx.eval(steps["sdpa-vchain"])
    return steps


def _arms(fp, kv, qs, scale, names):
    n = len(qs)
    steps = _step_caches(fp, names)
    s_len = fp[0][0].shape[2]
    q = lambda i, j: qs[(i + j) % n]  # noqa: E731
    fixed = [decode_kernel.launch_args(qs[0], c, scale)[0] for c in kv]
    mx.eval(fixed)
    one = mx.array(1.0, mx.float16)
    arms = {
        "sdpa": lambda i: [mx.fast.scaled_dot_product_attention(q(i, j), k, v, scale=scale) for j, (k, v) in enumerate(fp)],
        "add": lambda i: [q(i, j) * one for j in range(len(fp))],
        "noop1": lambda i: [_noop_call([q(i, j)], q(i, j)) for j in range(len(kv))],
        "noop1-compiled": lambda i: [_compiled_call(_noop(["q"]), _noop_spec(q(i, j)), [q(i, j)]) for j in range(len(kv))],
        "noop11-float3": lambda i: [_noop11(q(i, j), c, scale, "float3") for j, c in enumerate(kv)],
        "noop11": lambda i: [_noop11(q(i, j), c, scale) for j, c in enumerate(kv)],
        "noop11-fixed": lambda i: [_noop_call([q(i, j)] + fixed[j][1:], q(i, j)) for j in range(len(kv))],
        "kivi4-float3": lambda i: [_kivi(q(i, j), c, scale, "float3") for j, c in enumerate(kv)],
        "kivi4": lambda i: [_kivi(q(i, j), c, scale) for j, c in enumerate(kv)],
        "kivi4-v2": lambda i: [_kivi(q(i, j), c, scale, version="v2") for j, c in enumerate(kv)],
        "kivi4-c1": lambda i: [decode_kernel.decode_attention(q(i, j), c, scale, splits=_splits(c, 1)) for j, c in enumerate(kv)],
        "kivi4-chain-c1": lambda i: _chain(q(i, 0), kv, lambda x, c: decode_kernel.decode_attention(x, c, scale, splits=_splits(c, 1))),
        "kivi4-chain-c2": lambda i: _chain(q(i, 0), kv, lambda x, c: decode_kernel.decode_attention(x, c, scale, splits=_splits(c, 2))),
        "kivi4-step-c1": lambda i: _chain(q(i, 0), steps["kivi4-step-c1"], lambda x, c: decode_kernel.decode_attention(
            x, c.update_and_fetch(x[:, :HK], x[:, HK : 2 * HK])[0], scale, splits=_splits(c, 1))),
        "sdpa-chain": lambda i: _chain(q(i, 0), fp, lambda x, kv_: mx.fast.scaled_dot_product_attention(x, *kv_, scale=scale)),
        "kivi4-chain": lambda i: _chain(q(i, 0), kv, lambda x, c: decode_kernel.decode_attention(x, c, scale)),
        "kivi4-v3": lambda i: [_kivi(q(i, j), c, scale, version="v3") for j, c in enumerate(kv)],
        "kivi4-v3-chain": lambda i: _chain(q(i, 0), kv, lambda x, c: decode_kernel.decode_attention(x, c, scale, version="v3")),
        "kivi4-v4": lambda i: [_kivi(q(i, j), c, scale, version="v4") for j, c in enumerate(kv)],
        "kivi4-v4-chain": lambda i: _chain(q(i, 0), kv, lambda x, c: decode_kernel.decode_attention(x, c, scale, version="v4")),
        "kivi4-v4r-chain": lambda i: _chain(q(i, 0), kv, lambda x, c: decode_kernel.decode_attention(x, c, scale, version="v4r")),
        "sdpa-vchain": lambda i: _chain(q(i, 0), steps["sdpa-vchain"], lambda x, kv_: mx.fast.scaled_dot_product_attention(
            x, kv_[0][..., :s_len, :], kv_[1][..., :s_len, :], scale=scale)),
        "sdpa-step": lambda i: _chain(q(i, 0), steps["sdpa-step"], lambda x, c: mx.fast.scaled_dot_product_attention(
            x, *c.update_and_fetch(x[:, :HK], x[:, HK : 2 * HK]), scale=scale)),
        "kivi4-step": lambda i: _chain(q(i, 0), steps["kivi4-step"], lambda x, c: attention.attend(
            x, c.update_and_fetch(x[:, :HK], x[:, HK : 2 * HK])[0], scale, None)),
        "kivi4-v2-full": lambda i: [_kivi(q(i, j), c, scale, version="v2", minify=False) for j, c in enumerate(kv)],
        "kivi4-compiled": lambda i: [_kivi(q(i, j), c, scale, compiled=True) for j, c in enumerate(kv)],
    }
    return {k: v for k, v in arms.items() if k in names}


def _noop_spec(q):
    return {"template": [("T", q.dtype)], "grid": (-(-q.size // 256) * 256, 1, 1), "threadgroup": (256, 1, 1),
            "output_shapes": [q.shape], "output_dtypes": [q.dtype]}


def run_parts(arms, n, repeats, warmup):
    """Interleaved rounds; per arm the lists of build, dispatch and total seconds per step."""
    out = {a: {"build": [], "dispatch": [], "total": []} for a in arms}
    gc.collect()
    gc.disable()
    try:
        for r in range(warmup + repeats):
            for name, fn in arms.items():
                mx.synchronize()
                t0 = time.perf_counter()
                res = fn(r % n)
                t1 = time.perf_counter()
                mx.async_eval(res)
                t2 = time.perf_counter()
                mx.synchronize()
                t3 = time.perf_counter()
                if r >= warmup:
                    for k, t in (("build", t1 - t0), ("dispatch", t2 - t0), ("total", t3 - t0)):
                        out[name][k].append(t)
                del res
    finally:
        gc.enable()
    return out


def measure(s, args):
    fp, kv = _caches(s, args.layers)
    qs = [mx.random.normal((1, HQ, 1, D), key=mx.random.key(1000 + i)).astype(mx.float16) for i in range(args.inputs)]
    mx.eval(qs)
    scale = D**-0.5
    arms = _arms(fp, kv, qs, scale, args.arms)
    failed = {}
    for name in list(arms):  # one call each first: an arm that cannot run is reported, not fatal
        try:
            mx.eval(arms[name](0))
        except Exception as e:  # noqa: BLE001 - e.g. mx.compile refusing a custom kernel
            failed[name] = f"{type(e).__name__}: {e}"
            del arms[name]
    check = {}
    for name in ("kivi4-float3", "kivi4-compiled"):
        if name in arms and "kivi4" in arms:
            check[name] = bool(mx.array_equal(arms[name](0)[0], arms["kivi4"](0)[0]).item())
    times = run_parts(harness.with_aa(arms, "sdpa"), args.inputs, args.repeats, args.warmup)
    floor = harness.noise_floor(times["sdpa"]["total"], times["sdpa" + harness.AA_SUFFIX]["total"])
    row = {"S": s, "layers": args.layers, "noise_floor": floor, "failed": failed, "same_output_as_kivi4": check, "arms": {}}
    for name, parts in times.items():
        row["arms"][name] = {k: harness.summarize([t / args.layers for t in v]) for k, v in parts.items()}
    del fp, kv
    mx.clear_cache()
    return row


def measure_prefill(s, args):
    """One prefill chunk (``--chunk`` queries at the end of an S-token context) over packed caches,
    per layer, at each SCORES setting: the time and the peak memory of the attention alone."""
    rows, before = [], attention.SCORES
    try:
        for geometry in ((HQ, HK, D, "llama3-8b"), (14, 2, 64, "qwen2.5-0.5b")):
            rows += _prefill_rows(s, args, *geometry)
    finally:
        attention.SCORES = before
    return rows


def _prefill_rows(s, args, hq, hk, d, label):
    """measure_prefill's rows for one geometry (hq query heads, hk KV heads, head dim d)."""
    rows = []
    k = mx.random.normal((1, hk, s, d)).astype(mx.float16)
    v = mx.random.normal((1, hk, s, d)).astype(mx.float16)
    caches = []
    for bits in (4, 2):
        c = PackedKIVICache(bits, 32, 128)
        c.update_and_fetch(k, v)
        mx.eval(c.state[:6])
        caches.append(c)
    del k, v
    q = mx.random.normal((1, hq, args.chunk, d)).astype(mx.float16)
    mx.eval(q)
    for scores in args.scores:
        attention.SCORES = scores
        for c in caches:
            out = attention.attend_tiles(q, c, d**-0.5, "causal")
            mx.eval(out)  # warm-up
            mx.synchronize()
            mx.reset_peak_memory()
            base = mx.get_active_memory()
            ts = []
            for _ in range(args.prefill_repeats):
                t0 = time.perf_counter()
                mx.eval(attention.attend_tiles(q, c, d**-0.5, "causal"))
                mx.synchronize()
                ts.append(time.perf_counter() - t0)
            row = {"model": label, "S": s, "chunk": args.chunk, "bits": c.kv_bits, "scores": scores,
                   "seconds": harness.summarize(ts), "transient_peak_bytes": mx.get_peak_memory() - base,
                   "tiles": -(-c.quantized // max(32, min(attention.TILE, scores // (hq * args.chunk)) // 32 * 32)) + 1}
            rows.append(row)
            print(f"prefill {label} S={s} chunk={args.chunk} {c.kv_bits}-bit SCORES=2^{scores.bit_length() - 1}: "
                  f"{row['seconds']['median'] * 1e3:.1f} ms [{row['seconds']['min'] * 1e3:.1f}-{row['seconds']['max'] * 1e3:.1f}] "
                  f"n={len(ts)}, {row['tiles']} tiles, transient {row['transient_peak_bytes'] / 2**20:.1f} MiB", flush=True)
    del caches
    mx.clear_cache()
    return rows


ARMS = ("sdpa", "add", "noop1", "noop1-compiled", "noop11-float3", "noop11", "noop11-fixed", "kivi4-float3", "kivi4", "kivi4-v2", "kivi4-v3", "kivi4-v3-chain", "kivi4-v4", "kivi4-v4-chain", "kivi4-v4r-chain",
        "kivi4-v2-full", "kivi4-compiled", "kivi4-c1", "sdpa-chain", "sdpa-vchain", "kivi4-chain", "kivi4-chain-c1", "kivi4-chain-c2", "sdpa-step",
        "kivi4-step", "kivi4-step-c1")


def parse_args(argv):
    p = argparse.ArgumentParser(prog="python -m experiments.kivi_floor", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--contexts", type=lambda t: [int(x) for x in t.split(",") if x], default=[32768, 4096])
    p.add_argument("--arms", type=lambda t: [x for x in t.split(",") if x], default=list(ARMS))
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--inputs", type=int, default=20)
    p.add_argument("--repeats", type=int, default=25)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--prefill", type=lambda t: [int(x) for x in t.split(",") if x], default=[],
                   help="contexts at which to time one prefill chunk's attention (tile path)")
    p.add_argument("--chunk", type=int, default=512)
    p.add_argument("--scores", type=lambda t: [1 << int(x) for x in t.split(",") if x], default=[1 << 23],
                   help="log2 of the tile path's SCORES settings to time, e.g. 22,23,24")
    p.add_argument("--prefill-repeats", type=int, default=3)
    args = p.parse_args(argv)
    unknown = set(args.arms) - set(ARMS)
    if unknown:
        p.error(f"unknown arms {sorted(unknown)} (known: {', '.join(ARMS)})")
    if "sdpa" not in args.arms:
        args.arms.insert(0, "sdpa")
    return args


def main(argv=None):
    args = parse_args(sys.argv[1:] if argv is None else argv)
    result = {"kind": "bench-kivi-floor", "environment": env.environment_or_error(),
              "config": {k: v for k, v in vars(args).items() if k != "out"}, "op": [], "prefill": []}
    if decode_kernel.active(None) and decode_kernel.gpu.backend() == "cuda":
        for s in args.contexts:
            row = measure(s, args)
            result["op"].append(row)
            write_json(args.out, result)
            print(f"floor S={s} (us per layer, median [min-max], n={args.repeats}, A/A floor {row['noise_floor']:.1%}):", flush=True)
            for name, a in row["arms"].items():
                print("  " + f"{name:<16}" + "  ".join(f"{k} {a[k]['median'] * 1e6:7.1f} [{a[k]['min'] * 1e6:.1f}-{a[k]['max'] * 1e6:.1f}]"
                                                      for k in ("build", "dispatch", "total"))
                      + f"  device~ {(a['total']['median'] - a['dispatch']['median']) * 1e6:.1f}", flush=True)
            if row["failed"]:
                print(f"  failed: {row['failed']}", flush=True)
            print(f"  same output as kivi4: {row['same_output_as_kivi4']}", flush=True)
    else:
        print("bench-kivi-floor: the launch arms need MLX's CUDA backend; skipped", flush=True)
    for s in args.prefill:
        result["prefill"] += measure_prefill(s, args)
        write_json(args.out, result)
    write_json(args.out, result)
    print(f"bench-kivi-floor: wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
