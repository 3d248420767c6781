"""bench-kivi-attn: decode attention over a packed KIVI cache, its memory, and end-to-end decode.

Three parts (``--parts``), each with arms interleaved in one process (vqpipe.bench.harness), warm-up
rounds untimed, the fp16 arm run twice for the A/A noise floor:

- ``op``: one decode step's attention (query length 1) at Llama-3-8B geometry (32 query heads,
  8 KV heads, D = 128, fp16), ``--layers`` distinct caches per step (one per layer, as a decode
  step of a 32-layer model runs them), a rotating pool of ``--inputs`` queries; per-layer time =
  step time / layers. Arms: ``mx.fast.scaled_dot_product_attention`` on an fp16 cache, mlx-lm's
  ``quantized_scaled_dot_product_attention`` on ``mx.quantize``d caches (group 64, as
  QuantizedKVCache), and the packed KIVI cache's fused kernel (G = 32, R = 128), at each bit width.
- ``memory``: a generation (mlx-lm's ``generate_step``, prompt of ``--memory-context`` tokens, prefill in
  ``--prefill-step`` chunks) per cache kind; its own peak = ``mx.get_peak_memory()`` minus what was
  allocated before it, and the caches' ``nbytes`` against the packed size.
- ``decode``: tokens per second of the whole model, one token per timed call (forward, argmax,
  eval), caches filled beforehand with ``--contexts`` tokens of random keys and values (a decode
  step does not depend on what the keys are). Models: the Llama-3-8B layer geometry with random
  weights (``llama3-8b``, ``--llama-layers`` layers, vocab 128256) and the synthetic qwen2.5-0.5b;
  weights fp16 or mlx affine 4-bit. Before measuring, the Amdahl prediction from the op part's
  per-layer attention times is printed and stored.

    python -m experiments.bench_kivi_attn --out results/bench/kivi_attn.json
"""

import argparse
import json
import sys
import time
from pathlib import Path

import mlx.core as mx
from mlx.utils import tree_flatten

from vqpipe.kivi import decode_kernel
from vqpipe.kivi.attention import attend_tiles
from vqpipe.kivi.cache import make_kivi_cache
from vqpipe.kivi.store import PackedKIVICache
from vqpipe.bench import env, harness, roofline
from vqpipe.store.fsutil import write_json

HQ, HK, D = 32, 8, 128
AFFINE_GROUP = 64


def _stats(times, per=1):
    return harness.summarize([t / per for t in times])


def _fmt(s, scale=1e6):
    return f"{s['median'] * scale:.1f} [{s['min'] * scale:.1f}-{s['max'] * scale:.1f}]"


# --- op ---------------------------------------------------------------------------------------


def _op_caches(s, layers, bits_list, mlx_bits, seed):
    keys = mx.random.split(mx.random.key(seed), 2 * layers)
    fp, mq, kv = [], {b: [] for b in mlx_bits}, {b: [] for b in bits_list}
    for j in range(layers):
        k = mx.random.normal((1, HK, s, D), key=keys[2 * j]).astype(mx.float16)
        v = mx.random.normal((1, HK, s, D), key=keys[2 * j + 1]).astype(mx.float16)
        fp.append((k, v))
        for b in mlx_bits:
            mq[b].append((mx.quantize(k, group_size=AFFINE_GROUP, bits=b), mx.quantize(v, group_size=AFFINE_GROUP, bits=b)))
        for b in bits_list:
            c = PackedKIVICache(b, 32, 128)
            c.update_and_fetch(k, v)
            kv[b].append(c)
        mx.eval(fp[-1], [x for b in mlx_bits for x in mq[b][-1]], [c.state[:6] for b in bits_list for c in kv[b][-1:]])
    return fp, mq, kv


_FLOOR_BODY = """
    const unsigned int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < (unsigned int)(q_shape[0] * q_shape[1] * q_shape[2] * q_shape[3])) {
        out[i] = static_cast<T>(0.0f);
    }
"""
_floor = []


def floor_attention(queries, cache, scale):
    """A launch with the decode kernel's inputs, output and grid that only writes zeros: what a
    launch costs before the kernel does any work (host time, graph bookkeeping, the launch)."""
    if not _floor:
        _floor.append(mx.fast.cuda_kernel(name="kivi_decode_floor", input_names=decode_kernel.INPUTS,
                                          output_names=["out"], source=_FLOOR_BODY))
    inputs, spec, _ = decode_kernel.launch_args(queries, cache, scale)
    out = _floor[0](inputs=inputs, template=[("T", spec["output_dtypes"][0])], grid=(-(-queries.size // 256) * 256, 1, 1),
                    threadgroup=(256, 1, 1), output_shapes=spec["output_shapes"], output_dtypes=spec["output_dtypes"])[0]
    cache.last_out = out
    return out


def _build_seconds(arm, n, rounds=10):
    """Median host time to build one step's graph (every layer's launch) without evaluating it."""
    out = []
    for r in range(rounds):
        t0 = time.perf_counter()
        graph = arm(r % n)
        out.append(time.perf_counter() - t0)
        del graph
    return sorted(out)[len(out) // 2]


def _kivi_arm(qs, caches, scale, n, **kw):
    return lambda i: [decode_kernel.decode_attention(qs[(i + j) % n], c, scale, **kw) for j, c in enumerate(caches)]


def measure_op(s, args):
    from mlx_lm.models.base import quantized_scaled_dot_product_attention as qsdpa

    layers, n = args.layers, args.inputs
    fp, mq, kv = _op_caches(s, layers, args.bits, args.mlx_bits, seed=s)
    qs = [mx.random.normal((1, HQ, 1, D), key=mx.random.key(1000 + i)).astype(mx.float16) for i in range(n)]
    mx.eval(qs)
    scale = D**-0.5
    arms = {"fp16-sdpa": lambda i: [mx.fast.scaled_dot_product_attention(qs[(i + j) % n], k, v, scale=scale) for j, (k, v) in enumerate(fp)]}
    for b in args.mlx_bits:
        arms[f"mlx-q{b}"] = lambda i, b=b: [
            qsdpa(qs[(i + j) % n], qk, qv, scale=scale, mask=None, group_size=AFFINE_GROUP, bits=b) for j, (qk, qv) in enumerate(mq[b])
        ]
    caches = {}  # arm -> the caches it reads (for bytes and the cross-check)
    for b in args.bits:
        arms[f"kivi{b}"], caches[f"kivi{b}"] = _kivi_arm(qs, kv[b], scale, n), kv[b]
    chunks = kv[args.bits[0]][0].quantized // 32 + -(-kv[args.bits[0]][0].nres // 32)
    for version, sh in args.variants:  # other kernels and launch shapes, at every bit width
        for b in args.bits:
            ns = decode_kernel.default_splits(chunks, sh.warps, sh.per_warp, HK, decode_kernel.resident_blocks(b, sh))
            name = f"kivi{b}:{version}:w{sh.warps}c{sh.per_warp}" + (f"pf{sh.ahead}mb{sh.minblocks}" if version == "v3" else "")
            arms[name], caches[name] = _kivi_arm(qs, kv[b], scale, n, splits=ns, warps=sh.warps, version=version,
                                                 ahead=sh.ahead, minblocks=sh.minblocks), kv[b]
    for meta in args.meta_variants:  # other ways of passing scale and counts, default launch shape
        for b in args.bits:
            name = f"kivi{b}:{meta}"
            arms[name], caches[name] = _kivi_arm(qs, kv[b], scale, n, meta=meta), kv[b]
    if args.launch_floor:
        b = args.bits[0]
        arms["launch-floor"] = lambda i: [floor_attention(qs[(i + j) % n], c, scale) for j, c in enumerate(kv[b])]
    # every kernel arm against the tile path (the same cache, float32 sums in another order); an arm
    # that fails (e.g. a variant's compile) is dropped and named, the others still run
    check, failed = {}, {}
    for name, arm in list(arms.items()):
        if name in caches:
            try:
                out = arm(0)[0]
                check[name] = mx.max(mx.abs(out.astype(mx.float32) - attend_tiles(qs[0], caches[name][0], scale).astype(mx.float32))).item()
            except (RuntimeError, ValueError) as e:
                failed[name] = str(e)[-500:]
                del arms[name], caches[name]
                print(f"op S={s}: arm {name} failed, dropped: {failed[name][-200:]}", flush=True)
    nbytes = {"fp16-sdpa": fp[0][0].nbytes + fp[0][1].nbytes, "launch-floor": 0}
    nbytes.update({f"mlx-q{b}": sum(x.nbytes for t in mq[b][0] for x in t) for b in args.mlx_bits})
    nbytes.update({name: c[0].nbytes for name, c in caches.items()})
    build = {name: _build_seconds(arm, n) / layers for name, arm in arms.items()}
    times = harness.run_interleaved(harness.with_aa(arms, "fp16-sdpa"), n, args.repeats, args.warmup)
    floor = harness.aa_floor(times, "fp16-sdpa")
    row = {"S": s, "layers": layers, "arms": {}, "noise_floor": floor, "kernel_vs_tiles_max_abs": check, "failed_arms": failed,
           "cache_bytes_per_layer": nbytes, "build_seconds_per_layer": build}
    base = times["fp16-sdpa"]
    for name in arms:
        st = _stats(times[name], layers)
        row["arms"][name] = {**st, "bytes_per_s": nbytes[name] / st["median"],
                             "vs_fp16": harness.compare(base, times[name], floor)["speedup"]}
    for b in args.bits:
        if b in args.mlx_bits and f"kivi{b}" in times:
            row["arms"][f"kivi{b}"][f"vs_mlx_q{b}"] = harness.compare(times[f"mlx-q{b}"], times[f"kivi{b}"], floor)["speedup"]
    del fp, mq, kv
    mx.clear_cache()
    return row


# --- memory -----------------------------------------------------------------------------------


def _load_synth(name, root):
    from mlx_lm import load

    from vqpipe.stages.download import fetch

    return load(str(fetch(f"synth:{name}", Path(root) / name, seed=0)))


def _prompt(vocab, n, seed=0):
    return mx.random.randint(0, vocab, (n,), key=mx.random.key(seed)).tolist()


def _make(model, kind):
    from mlx_lm.models.cache import make_prompt_cache

    if kind == "fp16":
        return make_prompt_cache(model)
    return make_kivi_cache(model, int(kind.removeprefix("kivi")), 32, 128, packed=True)


def measure_memory(model, args, kinds, rows=None, save=lambda: None):
    """Fills ``rows`` (a dict, kind -> row) as each generation finishes, calling ``save`` after each."""
    from mlx_lm.generate import generate_step

    prompt = _prompt(model.args.vocab_size, args.memory_context)
    rows = {} if rows is None else rows
    for kind in kinds:
        mx.clear_cache()
        before = mx.get_active_memory()
        mx.reset_peak_memory()
        cache = _make(model, kind)
        t0 = time.perf_counter()
        for _ in generate_step(mx.array(prompt), model, max_tokens=4, prompt_cache=cache, prefill_step_size=args.prefill_step):
            pass
        peak = mx.get_peak_memory() - before
        held = sum(c.nbytes for c in cache)
        packed = sum(c.packed_nbytes() for c in cache if isinstance(c, PackedKIVICache))
        scratch = sum(sum(a.nbytes for a in c.scratch) for c in cache if getattr(c, "scratch", None))
        rows[kind] = {"peak_bytes": peak, "cache_nbytes": held, "packed_nbytes": packed or None, "scratch_nbytes": scratch,
                      "seconds": time.perf_counter() - t0}
        print(f"memory {kind}: peak {peak / 2**20:.1f} MiB, cache {held / 2**20:.1f} MiB, {rows[kind]['seconds']:.1f} s", flush=True)
        del cache
        save()
    for kind in kinds:
        rows[kind]["peak_vs_fp16"] = rows[kind]["peak_bytes"] / rows["fp16"]["peak_bytes"]
        rows[kind]["cache_vs_fp16"] = rows[kind]["cache_nbytes"] / rows["fp16"]["cache_nbytes"]
    return rows


def _kv_cache(kind):
    from mlx_lm.models.cache import KVCache

    return KVCache() if kind == "fp16" else PackedKIVICache(int(kind.removeprefix("kivi")), 32, 128)


def measure_kv_memory(args, kinds):
    """The KV side of a generation without a model, at the Llama-3-8B KV geometry: ``--kv-layers``
    caches written ``--prefill-step`` tokens at a time up to ``--memory-context`` (as prefill chunks
    write them), then ``--kv-steps`` decode steps (one token appended, attention over the cache,
    layer by layer). Peak = ``mx.get_peak_memory()`` minus what was allocated before. What it leaves
    out: weights and activations (the same for every kind) and prefill attention's transients."""
    from vqpipe.kivi.attention import attend

    s, chunk, scale = args.memory_context, args.prefill_step, D**-0.5
    rows = {}
    for kind in kinds:
        mx.clear_cache()
        before = mx.get_active_memory()
        mx.reset_peak_memory()
        caches = [_kv_cache(kind) for _ in range(args.kv_layers)]
        t0 = time.perf_counter()
        for a in range(0, s, chunk):
            n = min(chunk, s - a)
            for j, c in enumerate(caches):
                kk, vk = mx.random.split(mx.random.key(j * 1000003 + a))
                c.update_and_fetch(mx.random.normal((1, HK, n, D), key=kk).astype(mx.float16),
                                   mx.random.normal((1, HK, n, D), key=vk).astype(mx.float16))
            mx.eval([c.state[:6] if isinstance(c, PackedKIVICache) else c.state for c in caches])
        for t in range(args.kv_steps):
            for j, c in enumerate(caches):
                kq, kk, vk = mx.random.split(mx.random.key(7 + t * 1000 + j), 3)
                q = mx.random.normal((1, HQ, 1, D), key=kq).astype(mx.float16)
                k = mx.random.normal((1, HK, 1, D), key=kk).astype(mx.float16)
                v = mx.random.normal((1, HK, 1, D), key=vk).astype(mx.float16)
                if kind == "fp16":
                    keys, values = c.update_and_fetch(k, v)
                    out = mx.fast.scaled_dot_product_attention(q, keys, values, scale=scale)
                else:
                    c.update_and_fetch(k, v)
                    out = attend(q, c, scale)
                mx.eval(out)
        peak = mx.get_peak_memory() - before
        packed = sum(c.packed_nbytes() for c in caches if isinstance(c, PackedKIVICache))
        rows[kind] = {"peak_bytes": peak, "cache_nbytes": sum(c.nbytes for c in caches), "packed_nbytes": packed or None,
                      "seconds": time.perf_counter() - t0, "layers": args.kv_layers, "device": str(mx.default_device())}
        del caches
    for kind in kinds:
        rows[kind]["peak_vs_fp16"] = rows[kind]["peak_bytes"] / rows["fp16"]["peak_bytes"]
        rows[kind]["cache_vs_fp16"] = rows[kind]["cache_nbytes"] / rows["fp16"]["cache_nbytes"]
        if rows[kind]["packed_nbytes"]:
            rows[kind]["nbytes_vs_packed"] = rows[kind]["cache_nbytes"] / rows[kind]["packed_nbytes"]
    return rows


# --- end-to-end decode ------------------------------------------------------------------------


def llama3_8b(layers, dtype=mx.float16):
    """Llama-3-8B's layer geometry (and vocabulary) with random weights; ``layers`` of them."""
    from mlx_lm.models import llama

    args = llama.ModelArgs(model_type="llama", hidden_size=4096, num_hidden_layers=layers, intermediate_size=14336,
                           num_attention_heads=32, num_key_value_heads=8, rms_norm_eps=1e-5, vocab_size=128256,
                           rope_theta=500000.0, tie_word_embeddings=False)
    model = llama.Model(args)
    model.set_dtype(dtype)
    mx.eval(model.parameters())
    return model


def _head_dim(args):
    return getattr(args, "head_dim", None) or args.hidden_size // args.num_attention_heads


def _fill(model, caches, s, dtype, state):
    """s random keys and values into every cache, 4096 at a time (the same per layer for every kind);
    ``state(c)`` is what to evaluate after each cache."""
    hk, d = model.args.num_key_value_heads, _head_dim(model.args)
    for j, c in enumerate(caches):
        for a in range(0, s, 4096):
            n = min(4096, s - a)
            kk, vk = mx.random.split(mx.random.key(j * 1000003 + a))
            c.update_and_fetch(mx.random.normal((1, hk, n, d), key=kk).astype(dtype),
                               mx.random.normal((1, hk, n, d), key=vk).astype(dtype))
        mx.eval(state(c))


def _filled(model, kind, s, dtype):
    caches = _make(model, kind)
    _fill(model, caches, s, dtype, lambda c: c.state[:6] if isinstance(c, PackedKIVICache) else c.state)
    return caches


def _split_decoder(model, s, dtype, capacity):
    """decode_step's split-mode compiled step (compiled blocks around MLX's fused SDPA) over a static
    fp16 cache filled like :func:`_filled`: (decoder, [position, buffers])."""
    from vqpipe.decode.step import Decoder

    dec = Decoder(model, capacity, "split")
    caches = dec.new_cache()
    _fill(model, caches, s, dtype, lambda c: (c.keys, c.values))
    dec.position = s
    return dec, [mx.array(s, mx.int32), [(c.keys, c.values) for c in caches]]


def _decode_arms(model, s, kinds, args, dtype):
    """Per arm a function doing one greedy step: eager mlx-lm over each cache kind and, with
    ``--compiled``, ``fp16+s`` (decode_step's split mode) and ``kivi<bits>+c`` (vqpipe.kivi.compiled)."""
    from vqpipe.kivi.compiled import KIVIDecoder

    caches = {k: _filled(model, k, s, dtype) for k in kinds}
    tok = {k: mx.array([[1]]) for k in kinds}

    def step(kind):
        def fn(i):
            logits = model(tok[kind], cache=caches[kind])
            tok[kind] = mx.argmax(logits[:, -1:], axis=-1)
            return tok[kind]

        return fn

    arms = {k: step(k) for k in kinds}
    if not args.compiled:
        return arms, {}
    dec, st = _split_decoder(model, s, dtype, s + 4 * (args.decode_steps + args.warmup) + 64)
    box = {"fp16+s": mx.array([[1]], mx.int32)}

    def split_step(i):
        box["fp16+s"], st[0], st[1], _ = dec.step(box["fp16+s"], st[0], st[1])
        return box["fp16+s"]

    arms["fp16+s"] = split_step
    decoders = {}
    for k in kinds[1:]:
        decoders[k] = KIVIDecoder(model, _filled(model, k, s, dtype))
        box[k + "+c"] = mx.array([[1]])

        def kivi_step(i, k=k):
            box[k + "+c"] = decoders[k].greedy(box[k + "+c"])
            return box[k + "+c"]

        arms[k + "+c"] = kivi_step
    return arms, decoders


def measure_decode(model, s, kinds, args, dtype):
    arms, decoders = _decode_arms(model, s, kinds, args, dtype)
    times = harness.run_interleaved(harness.with_aa(arms, "fp16"), 1, args.decode_steps, args.warmup)
    floor = harness.aa_floor(times, "fp16")
    row = {"S": s, "noise_floor": floor, "arms": {},
           "compiled_steps": {k: {"traces": d.traces, "compiled": d.compiled_steps, "eager": d.eager_steps} for k, d in decoders.items()}}
    for k in arms:
        st = _stats(times[k])
        row["arms"][k] = {**st, "tok_per_s_median": 1 / st["median"], "tok_per_s_mean": len(times[k]) / sum(times[k]),
                          "vs_fp16": harness.compare(times["fp16"], times[k], floor)["speedup"]}
    del arms, decoders
    mx.clear_cache()
    return row


def amdahl(step_fp16, layers, attn_fp16, attn_kivi):
    """Predicted decode speedup of KIVI over fp16 when only attention changes:
    step / (step - layers * (fp16 attention - KIVI attention))."""
    return step_fp16 / (step_fp16 - layers * (attn_fp16 - attn_kivi))


def _nearest(rows, s):
    return min(rows, key=lambda r: abs(r["S"] - s)) if rows else None


def run_decode(args, op_rows, out, save=lambda: None):
    kinds = ["fp16"] + [f"kivi{b}" for b in args.bits]
    for model_name in args.decode_models:
        for weights in args.weights:
            if model_name == "llama3-8b":
                model, dtype = llama3_8b(args.llama_layers), mx.float16
            else:
                model, _ = _load_synth(model_name, args.work)
                dtype = next(p.dtype for _, p in tree_flatten(model.parameters()) if mx.issubdtype(p.dtype, mx.floating))
            if weights == "affine4":
                import mlx.nn as nn

                nn.quantize(model, group_size=AFFINE_GROUP, bits=4, class_predicate=lambda p, m: isinstance(m, nn.Linear))
                mx.eval(model.parameters())
            for s in args.contexts:
                try:
                    row = measure_decode(model, s, kinds, args, dtype)
                except (RuntimeError, ValueError) as e:  # e.g. out of memory at the longest context
                    out.append({"model": model_name, "weights": weights, "S": s, "error": str(e)})
                    print(f"decode {model_name}/{weights} S={s}: {e}", flush=True)
                    continue
                row.update({"model": model_name, "weights": weights, "layers": len(model.layers)})
                op = _nearest(op_rows, s) if model_name == "llama3-8b" else None
                if op is not None:
                    step = row["arms"]["fp16"]["median"]
                    row["amdahl"] = {k: amdahl(step, len(model.layers), op["arms"]["fp16-sdpa"]["median"], op["arms"][k]["median"])
                                     for k in kinds[1:]}
                    row["amdahl_op_S"] = op["S"]
                out.append(row)
                save()
                print(f"decode {model_name}/{weights} S={s}: " + "; ".join(
                    f"{k} {row['arms'][k]['tok_per_s_median']:.1f} tok/s ({row['arms'][k]['vs_fp16']:.2f}x"
                    + (f", Amdahl {row['amdahl'][k]:.2f}x" if "amdahl" in row and k in row["amdahl"] else "") + ")"
                    for k in row["arms"]) + f"; floor {row['noise_floor']:.1%}", flush=True)
            del model
            mx.clear_cache()


# --- main -------------------------------------------------------------------------------------


def _ints(text):
    return [int(x) for x in text.split(",") if x.strip()]


def _variants(text):
    """"8x2,v2:8x2,v3:4x2:pf1:mb3" -> [(version, Shape), ...]: [kernel version:]warps x chunks per
    warp[:pf loads ahead][:mb launch-bounds blocks per SM] (decode_kernel.parse_shape); version
    default v2."""
    out = []
    for x in (x.strip() for x in text.split(",")):
        if not x:
            continue
        version, shape = ("v2", x) if x.split(":")[0] not in decode_kernel.VERSIONS else x.split(":", 1)
        if not shape or shape.split(":")[0].count("x") != 1:
            raise argparse.ArgumentTypeError(f"variant {x!r}: expected [version:]WxC[:pfN][:mbN] (versions: {', '.join(decode_kernel.VERSIONS)})")
        try:
            out.append((version, decode_kernel.parse_shape(shape)))
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None
    return out


def parse_args(argv):
    p = argparse.ArgumentParser(prog="python -m experiments.bench_kivi_attn", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--parts", nargs="+", default=["op", "decode", "memory"], choices=("op", "memory", "kvmemory", "decode"))
    p.add_argument("--op-contexts", type=_ints, default=[4096, 8192, 16384, 32768, 65536])
    p.add_argument("--bits", type=_ints, default=[4, 2])
    p.add_argument("--mlx-bits", type=_ints, default=[8, 4, 2])
    p.add_argument("--variants", type=_variants, default=[],
                   help="extra kernels and launch shapes timed as arms at every bit width, e.g. 4x2,v2:8x2,v3:4x2:pf1:mb3 "
                   "([version:]warps x chunks per warp[:pf loads ahead][:mb launch-bounds blocks]; version default v2)")
    p.add_argument("--meta-variants", nargs="*", default=[], choices=decode_kernel.META_MODES,
                   help="also time the kernel with these ways of passing scale and counts (decode_kernel.META_MODES)")
    p.add_argument("--launch-floor", action="store_true",
                   help="also time a launch with the kernel's inputs that only writes zeros (what a launch costs before any work)")
    p.add_argument("--op-from", help="a bench-kivi-attn JSON whose op rows feed the decode part's Amdahl prediction "
                   "(when the op part ran in another process)")
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--inputs", type=int, default=20)
    p.add_argument("--repeats", type=int, default=25)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--memory-models", nargs="+", default=["qwen2.5-0.5b", "llama3-8b"])
    p.add_argument("--memory-context", type=int, default=32768)
    p.add_argument("--prefill-step", type=int, default=512)
    p.add_argument("--kv-layers", type=int, default=32, help="kvmemory: caches (layers) at the 8B KV geometry")
    p.add_argument("--kv-steps", type=int, default=2, help="kvmemory: decode steps after the fill")
    p.add_argument("--decode-models", nargs="+", default=["llama3-8b", "qwen2.5-0.5b"])
    p.add_argument("--llama-layers", type=int, default=32)
    p.add_argument("--weights", nargs="+", default=["full"], choices=("full", "affine4"))
    p.add_argument("--contexts", type=_ints, default=[8192, 32768, 65536])
    p.add_argument("--decode-steps", type=int, default=24)
    p.add_argument("--compiled", action="store_true", help="decode: also fp16 through decode_step's split mode (fp16+s) "
                   "and each KIVI width through vqpipe.kivi.compiled (kivi<bits>+c)")
    p.add_argument("--work", default="/tmp/vqpipe-kivi-attn", help="where synthetic models are built")
    p.add_argument("--quick", action="store_true", help="a small CPU run of every part")
    args = p.parse_args(argv)
    if args.quick:
        args.op_contexts, args.layers, args.inputs, args.repeats, args.warmup = [256], 2, 2, 2, 1
        args.memory_models, args.memory_context, args.prefill_step, args.kv_layers = ["tiny"], 300, 128, 2
        args.decode_models, args.contexts, args.decode_steps, args.mlx_bits = ["tiny"], [300], 2, [4]
    return args


def _save(result, path):
    """Write the result so far (atomically): a run cut short keeps its finished rows."""
    write_json(path, result)


def main(argv=None):
    args = parse_args(sys.argv[1:] if argv is None else argv)
    result = {"kind": "bench-kivi-attn", "environment": env.environment_or_error(),
              "config": {k: v for k, v in vars(args).items() if k != "out"},
              "kernel": decode_kernel.active(None), "op": [], "memory": {}, "decode": []}
    if "op" in args.parts:
        if not decode_kernel.active(None):
            print("bench-kivi-attn: op part needs the decode kernel (a GPU); skipped", flush=True)
        else:
            result["copy_bandwidth"] = roofline.measure_copy_bandwidth(1 << 30, repeats=5, warmup=2)
            for s in args.op_contexts:
                row = measure_op(s, args)
                result["op"].append(row)
                _save(result, args.out)
                print(f"op S={s} (us per layer, median [min-max], n={args.repeats}, floor {row['noise_floor']:.1%}): " + "; ".join(
                    f"{k} {_fmt(a)} {a['bytes_per_s'] / 1e12:.2f} TB/s {a['vs_fp16']:.2f}x" for k, a in row["arms"].items()), flush=True)
    if "decode" in args.parts:
        op_rows = result["op"]
        if args.op_from and not op_rows:
            op_rows = json.loads(Path(args.op_from).read_text())["op"]
            result["op_from"] = args.op_from
        run_decode(args, op_rows, result["decode"], lambda: _save(result, args.out))
    if "memory" in args.parts:
        kinds = ["fp16"] + [f"kivi{b}" for b in args.bits]
        for name in args.memory_models:
            model = llama3_8b(args.llama_layers) if name == "llama3-8b" else _load_synth(name, args.work)[0]
            rows = result["memory"].setdefault(name, {})
            measure_memory(model, args, kinds, rows, lambda: _save(result, args.out))
            _save(result, args.out)
            print(f"memory {name} S={args.memory_context}: " + "; ".join(
                f"{k} peak {r['peak_bytes'] / 2**20:.1f} MiB ({r['peak_vs_fp16']:.3f}x), cache {r['cache_nbytes'] / 2**20:.1f} MiB ({r['cache_vs_fp16']:.3f}x)"
                for k, r in rows.items()), flush=True)
            del model
    if "kvmemory" in args.parts:
        rows = measure_kv_memory(args, ["fp16"] + [f"kivi{b}" for b in args.bits])
        result["kv_memory"] = rows
        print(f"kvmemory S={args.memory_context} layers={args.kv_layers}: " + "; ".join(
            f"{k} peak {r['peak_bytes'] / 2**20:.1f} MiB ({r['peak_vs_fp16']:.3f}x), cache {r['cache_nbytes'] / 2**20:.1f} MiB "
            f"({r['cache_vs_fp16']:.3f}x)" + (f", nbytes {r['nbytes_vs_packed']:.3f}x packed" if "nbytes_vs_packed" in r else "")
            for k, r in rows.items()), flush=True)
    _save(result, args.out)
    print(f"bench-kivi-attn: wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
