"""bench-decode: prefill and decode throughput per arm (weights x KV cache), with the roofline.

Arms are ``WEIGHTS/CACHE``: weights ``full`` (the source at the compute dtype), ``vqpipe`` (the
reservoir), ``affine4``/``affine8`` (MLX affine quantization of the source, group 64, as
``mlx_lm.convert -q`` makes it: every layer it quantizes, the embedding included);
caches ``fp`` (mlx-lm's KVCache), ``kivi-ref`` (KIVI, MLX-ops quantizer) and ``kivi-kernel`` (KIVI,
fused Metal/CUDA kernels; only where a GPU backend exists, otherwise skipped with the reason), and,
when asked for, ``compiled`` / ``compiled-split`` (an fp static KV cache decoded through
vqpipe.decode.step's compiled step, whole or split around MLX's fused attention: docs/decode.md).
KIVI arms are built for ``full`` and ``vqpipe``; ``affine*`` run with the fp caches (roofline arms).

Per prompt length, in one process: warm-up rounds (untimed), a pilot round (untimed: peak memory
per arm via ``mx.get_peak_memory``, token ids for the lossless checks, flush counts, the KIVI
reference's decode time for the Amdahl prediction, printed before anything is timed), then
``--repeats`` timed rounds through ``harness.run_interleaved`` (arms A B A B ..., plus a second
copy of the baseline arm for the A/A noise floor). Every round feeds the next of >= 20 distinct
prompts (windows of the shipped corpus) to all arms; no arm sees the same prompt twice in a row.

A generation is ``mlx_lm.generate.generate_step`` with greedy sampling, prefill in
``--prefill-step`` chunks (mlx-lm's 2048 by default). Prefill time: from the call to the first
token evaluated (mlx-lm's ``prompt_progress_callback(total, total)`` fires right after
``mx.eval`` of it); decode time: from there to the end of ``--gen-tokens`` decode steps, closed by
``mx.synchronize()``. See docs/bench-decode.md.

    vqpipe bench-decode --source SRC --reservoir RES --model NAME --out FILE.json
"""

import argparse
import gc
import hashlib
import json
import math
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import mlx.core as mx
import mlx.nn as nn

from .. import kivi
from ..store import record
from ..layers.qlinear import QuantizedLinear
from ..bench import fresh_load, harness, roofline
from ..bench.dtype import cast_floating
from ..bench.env import environment
from ..text import CORPUS, corpus_windows

WEIGHTS = ("full", "vqpipe", "affine4", "affine8")
CACHES = ("fp", "kivi-ref", "kivi-kernel", "compiled", "compiled-split")
# Caches decoded through vqpipe.decode.step (a static fp KV cache, the step compiled), by its mode;
# not run unless asked for (--caches), since mlx-lm users decode eagerly.
STEP_CACHES = {"compiled": "whole", "compiled-split": "split"}
FP_CACHES = ("fp", *STEP_CACHES)  # full-precision KV: roofline arms, no KIVI flushes
KIVI_WEIGHTS = ("full", "vqpipe")
AFFINE_GROUP = 64
_DTYPES = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}

# Settings: the full run (the issue's) and --quick (a CPU/CI smoke run of the same code paths: two
# prompt lengths, the longer crossing a 128-token prefill chunk, and KIVI flushes in both phases).
DEFAULTS = {"prompt_lengths": [512, 4096], "gen_tokens": 128, "repeats": 5, "warmup": 1, "prompts": 20,
            "kivi_bits": 4, "group_size": 32, "residual": 128, "prefill_step": 2048, "copy_mib": 256,
            "gemm": None}
QUICK = {"prompt_lengths": [32, 160], "gen_tokens": 8, "repeats": 3, "warmup": 0, "prompts": 20,
         "kivi_bits": 4, "group_size": 8, "residual": 16, "prefill_step": 128, "copy_mib": 64, "gemm": 512}


def arm_name(weights, cache):
    return f"{weights}/{cache}"


def compute_dtype(name="auto"):
    """float32 on the CPU (MLX's CPU matmul hands only fp32 to BLAS), bfloat16 on a GPU; None for
    "stored": every model as its loader gives it (mlx_lm.load, vqpipe.load), nothing cast, the
    way a user's ``generate`` runs it."""
    if name == "stored":
        return None
    if name == "auto":
        return mx.bfloat16 if mx.default_device().type == mx.gpu else mx.float32
    return getattr(mx, name)


def _dtype_name(dtype):
    return "stored" if dtype is None else str(dtype).rsplit(".", 1)[-1]


def _source_dtype(source):
    """The dtype the source's config names (torch_dtype), float32 if it names none."""
    config = json.loads((Path(source) / "config.json").read_text())
    return getattr(mx, config.get("torch_dtype") or "float32", mx.float32)


def model_bytes(model):
    from mlx.utils import tree_flatten

    return int(sum(v.nbytes for _, v in tree_flatten(model.parameters())))


def rotation_bytes(model):
    """Bytes of the rotations of vqpipe layers (signs, Kronecker factor, dense QR matrix): read on
    every forward, but not MLX parameters, so ``roofline.weight_bytes_read`` does not see them."""
    return int(sum(m.rotation.matrix_bytes() for _, m in model.named_modules() if isinstance(m, QuantizedLinear)))


def decode_weight_bytes(model):
    """Weight bytes one decode token reads: ``roofline.weight_bytes_read`` plus vqpipe rotations."""
    return roofline.weight_bytes_read(model) + rotation_bytes(model)


def _vqpipe_bits(model):
    bits = sorted({m.bits for _, m in model.named_modules() if isinstance(m, QuantizedLinear)})
    return "/".join(map(str, bits)) or "?"


def _weights_dtype(model):
    from mlx.utils import tree_flatten

    return next((v.dtype for _, v in tree_flatten(model.parameters()) if mx.issubdtype(v.dtype, mx.floating)), mx.float32)


def load_models(source, reservoir, weights, dtype, progress=print):
    """``({weights: model}, {weights: precision label}, tokenizer)``; the tokenizer is the source's."""
    from mlx_lm.utils import load

    from ..store.reservoir import load as load_reservoir_dir

    models, precision, configs, tokenizer = {}, {}, {}, None
    for w in weights:
        t0 = time.perf_counter()
        if w == "vqpipe":
            from ..kernels import ext

            model, _ = load_reservoir_dir(reservoir)
            # the path a CPU decode step takes by default (vqpipe/ext.py): the compiled extension
            path = "" if mx.default_device().type == mx.gpu else \
                ", compiled extension" if ext.available() else ", dense path (vqpipe._ext not built)"
            precision[w] = f"vqpipe {_vqpipe_bits(model)}-bit{path}"
        else:
            model, tok = load(str(source))
            tokenizer = tokenizer or tok
            if w == "full":
                stored = _dtype_name(_weights_dtype(model))
                precision[w] = (f"the {stored} source (as stored)" if dtype is None
                                else _DTYPES.get(_dtype_name(dtype), _dtype_name(dtype)))
            else:
                bits = int(w.removeprefix("affine"))
                precision[w] = f"mlx affine {bits}-bit" + (f" g{AFFINE_GROUP} (mlx_lm.convert -q)" if dtype is None else "")
        if dtype is not None:
            cast_floating(model, dtype)
        if w.startswith("affine"):
            from mlx_lm.utils import load_config, quantize_model

            # mlx_lm.convert's own quantization: every layer whose width the group divides
            model, configs[w] = quantize_model(model, load_config(Path(source)), AFFINE_GROUP, bits)
            mx.eval(model.parameters())
        models[w] = model
        progress(f"loaded {w} ({precision[w]}): {model_bytes(model) / 2**20:.1f} MiB of parameters, "
                 f"{time.perf_counter() - t0:.1f}s")
    if tokenizer is None:
        from mlx_lm.utils import load_tokenizer

        tokenizer = load_tokenizer(Path(source))
    return models, precision, configs, tokenizer


def fresh_loads(b, progress):
    """Time to a usable model in a fresh process per weights arm (vqpipe/bench/fresh_load.py): the
    reservoir through vqpipe.load, the source and the affine arms (saved as mlx_lm.convert would)
    through mlx_lm.load. Sets ``result["fresh_load"]``."""
    from mlx_lm.utils import save

    with tempfile.TemporaryDirectory(prefix="vqpipe-fresh-load-") as tmp:
        arms = {}
        for w in b.args.weights:
            if w == "vqpipe":
                arms[w] = ("vqpipe", b.args.reservoir)
            elif w == "full":
                arms[w] = ("mlx_lm", b.args.source)
            else:
                save(Path(tmp) / w, b.args.source, b.models[w], b.tokenizer, b.configs[w], donate_model=False)
                arms[w] = ("mlx_lm", Path(tmp) / w)
        records, comparisons, floor = fresh_load.measure(arms, b.args.load_repeats, progress)
    for r in records:
        r["precision"] = b.precision[r["arm"]]
        r["path"] = r["path"] if r["arm"] in ("vqpipe", "full") else f"(mlx_lm.convert -q of the source, {r['arm']})"
    b.result["fresh_load"] = {"records": records, "comparisons": comparisons, "noise_floor": floor,
                              "repeats": b.args.load_repeats}


def build_prompts(tokenizer, n, length):
    """``n`` distinct windows of ``length`` tokens of the shipped corpus (``text.corpus_windows``)."""
    windows = corpus_windows(tokenizer, n, length)
    if len({tuple(w.tolist()) for w in windows}) != n:
        raise ValueError(f"the corpus does not give {n} distinct {length}-token windows")
    return windows


# --- one generation ------------------------------------------------------------------------


def greedy(logprobs):
    return mx.argmax(logprobs, axis=-1)


def generate_once(model, prompt, cache, max_tokens, prefill_step):
    """One greedy generation through ``mlx_lm.generate.generate_step`` with ``cache``.

    Returns ``{"prefill_s", "decode_s", "ids"}``: prefill = call to first token evaluated (the
    callback fires right after mlx-lm's ``mx.eval`` of it), decode = ``max_tokens`` decode steps
    from there, closed by ``mx.synchronize()`` (the last step computes one token mlx-lm drops).
    """
    from mlx_lm.generate import generate_step

    marks = {}
    total = int(prompt.size)

    def progress(done, n):
        if done == n == total and "first" not in marks:
            marks["first"] = time.perf_counter()

    mx.synchronize()
    t0 = time.perf_counter()
    ids = [int(t) for t, _ in generate_step(prompt, model, max_tokens=max_tokens, sampler=greedy,
                                            prompt_cache=cache, prefill_step_size=prefill_step,
                                            prompt_progress_callback=progress)]
    mx.synchronize()
    t1 = time.perf_counter()
    return {"prefill_s": marks["first"] - t0, "decode_s": t1 - marks["first"], "ids": ids}


def make_cache(model, cache, bits, group_size, residual):
    from mlx_lm.models.cache import make_prompt_cache

    if cache == "fp":
        return make_prompt_cache(model)
    return kivi.make_kivi_cache(model, bits, group_size, residual, use_kernels=cache == "kivi-kernel",
                                packed=False)


def kv_stats(cache_list, kv_per_position):
    """KV bytes after a generation, labelled: resident (allocated now), compressed (what a packed
    KIVI store would take; for the fp cache the same as used) and uncompressed (used positions at
    the cache dtype), plus KIVI's token and flush counts."""
    st = kivi.cache_stats(cache_list)
    offset = max((c.offset for c in cache_list if hasattr(c, "offset")), default=0)
    if st:
        return {"offset": st["offset"], "resident_bytes": st["resident_nbytes"],
                "compressed_bytes": st["compressed_nbytes"], "uncompressed_bytes": st["uncompressed_nbytes"],
                "quantized_tokens": st["quantized_tokens"], "residual_tokens": st["residual_tokens"],
                "flushes": st["flushes"], "layers": st["layers"]}
    used = kv_per_position * offset
    return {"offset": offset, "resident_bytes": int(sum(c.nbytes for c in cache_list)),
            "compressed_bytes": used, "uncompressed_bytes": used, "flushes": 0}


# --- KIVI schedule and the Amdahl prediction -----------------------------------------------


def quantized_tokens(t, residual, group_size):
    """Tokens quantized after ``t`` tokens: ``G * floor(max(0, t - R) / G)`` (docs/kivi.md)."""
    return group_size * (max(0, t - residual) // group_size)


def flush_schedule(prompt_len, gen_tokens, residual, group_size, prefill_step):
    """Per layer, the sizes S (tokens) of the flush launches of one generation, by phase.

    mlx-lm's prefill runs the first ``prompt_len - 1`` tokens in ``prefill_step`` chunks, then the
    last prompt token; the decode phase adds ``gen_tokens`` tokens one at a time. A cache update
    flushes, in one launch, every whole group beyond the newest R tokens (docs/kivi.md).
    """
    ends, t = [], 0
    while prompt_len - t > 1:
        t += min(prefill_step, prompt_len - 1 - t)
        ends.append(t)
    ends.append(prompt_len)
    decode_ends = [prompt_len + k for k in range(1, gen_tokens + 1)]
    out, prev = {"prefill": [], "decode": []}, 0
    for phase, points in (("prefill", ends), ("decode", decode_ends)):
        for t in points:
            q = quantized_tokens(t, residual, group_size)
            if q > prev:
                out[phase].append(q - prev)
            prev = q
    return out


def load_kivi_ops(path):
    """Per-flush times from a bench-kivi JSON: ``{"rows": [{"S", "mode", "reference", "kernel"}],
    "environment", "config"}`` for whole flushes (keys + values), seconds (median): the
    "cache_flush" rows (x_hat only, what the cache runs) when the file has them, else "flush"."""
    doc = json.loads(Path(path).read_text())
    rows = []
    results = doc.get("results") or []
    kind = "cache_flush" if any(r.get("kind") == "cache_flush" for r in results) else "flush"
    for r in results:  # bench-kivi's own shape (vqpipe/stages/bench_kivi.py)
        if r.get("kind") == kind and "arms" in r:
            arms = r["arms"]
            rows.append({"S": r["S"], "mode": r.get("mode", "isolated"),
                         "reference": arms.get("reference", {}).get("median"),
                         "kernel": (arms.get("kernel") or {}).get("median")})
    if not rows:  # the report's record shape: {"op", "arm", "S", "median", ...}
        by = {}
        for r in doc.get("records") or []:
            if r.get("op") in ("flush", "kv") and r.get("arm") in ("reference", "kernel"):
                by.setdefault((r["S"], r.get("mode", "isolated")), {})[r["arm"]] = r.get("median")
        rows = [{"S": s, "mode": m, "reference": v.get("reference"), "kernel": v.get("kernel")} for (s, m), v in by.items()]
    return {"path": str(path), "rows": rows, "environment": doc.get("environment"), "config": doc.get("config")}


def op_time(ops, size):
    """The bench-kivi flush row nearest to ``size`` tokens (log scale), in-graph mode preferred
    (one flush per layer inside a decode step's graph, as the cache runs them)."""
    rows = [r for r in ops["rows"] if r["reference"] and r["kernel"]]
    if not rows:
        return None
    modes = {r["mode"] for r in rows}
    mode = "in_graph" if "in_graph" in modes else sorted(modes)[0]
    rows = [r for r in rows if r["mode"] == mode]
    best = min(rows, key=lambda r: (abs(math.log(r["S"] / size)), r["S"]))
    return {"S": best["S"], "mode": mode, "reference_s": best["reference"], "kernel_s": best["kernel"]}


def predict_saving(launches, layers, ops):
    """Seconds a generation phase saves with kernels: every launch (per layer) of size S saves
    t_ref(S) - t_kernel(S) from the op-level benchmark. ``None`` without kernel figures."""
    used, saving = [], 0.0
    for s in launches:
        t = op_time(ops, s)
        if t is None:
            return None
        saving += layers * (t["reference_s"] - t["kernel_s"])
        used.append(t)
    return {"saving_s": saving, "launches_per_layer": len(launches), "layers": layers,
            "flushed_tokens_per_layer": int(sum(launches)), "op_rows": _dedupe(used)}


def _dedupe(rows):
    out = []
    for r in rows:
        if r not in out:
            out.append(r)
    return out


def amdahl_speedup(baseline_s, saving_s):
    """Upper bound on the speedup when ``saving_s`` of ``baseline_s`` goes away (Amdahl)."""
    if baseline_s is None or saving_s is None or baseline_s <= 0:
        return None
    rest = baseline_s - saving_s
    return baseline_s / rest if rest > 0 else math.inf


# --- lossless checks -----------------------------------------------------------------------


def first_difference(a, b):
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def compare_outputs(runs_a, runs_b, tokenizer, must_match):
    """Token ids and decoded text of two arms on every prompt both ran (pilot and timed rounds).

    ``runs_*``: ``{prompt_index: [ids, ...]}``. ``identical``: every pair byte-identical.
    """
    pairs = [(p, a, b) for p in sorted(set(runs_a) & set(runs_b)) for a in runs_a[p] for b in runs_b[p]]
    if not pairs:
        return {"pairs": 0, "identical": None, "must_match": must_match}
    same_ids = [a == b for _, a, b in pairs]
    same_text = [tokenizer.decode(a).encode() == tokenizer.decode(b).encode() for _, a, b in pairs]
    diffs = [first_difference(a, b) for _, a, b in pairs]
    agree = [sum(x == y for x, y in zip(a, b)) / max(len(a), 1) for _, a, b in pairs]
    out = {
        "pairs": len(pairs),
        "prompts": sorted({p for p, _, _ in pairs}),
        "identical": all(same_ids) and all(same_text),
        "identical_ids": sum(same_ids),
        "identical_text": sum(same_text),
        "token_agreement": summary_or_none(agree),
        "first_difference": summary_or_none([d for d in diffs if d is not None]),
        # Distinct token ids per generation: a model stuck in a 1-2 token loop (random synthetic
        # weights do that) makes any two arms agree easily; read the verdicts with this beside them.
        "distinct_tokens": summary_or_none([len(set(x)) for _, a, b in pairs for x in (a, b)]),
        "must_match": must_match,
    }
    if must_match:
        out["verdict"] = "byte-identical" if out["identical"] else "DIFFERENT"
    else:
        out["verdict"] = f"{out['identical_text']}/{len(pairs)} identical (not required)"
    return out


def lossless_verdict(chk, deterministic):
    """Set ``conclusive`` and the verdict of a must-match check, given the A/A determinism check:
    a difference is conclusive only where the baseline run twice gave identical text."""
    if not chk["must_match"] or chk["identical"] is None:
        return chk
    chk["conclusive"] = bool(chk["identical"] or deterministic)
    if not chk["identical"] and deterministic:
        chk["verdict"] = (f"DIFFERENT on {chk['pairs'] - chk['identical_text']}/{chk['pairs']} prompts (first difference "
                          f"at token {chk['first_difference']['min']}); the baseline's A/A pair agreed")
    if not chk["identical"] and not deterministic:
        chk["verdict"] = ("DIFFERENT, inconclusive: the baseline's A/A pair also differs, so generation is not "
                          "run-to-run deterministic on this device (kernel bit-exactness: tests/test_kivi_kernels.py)")
    return chk


def summary_or_none(xs):
    return harness.summarize(xs) if xs else None


# --- the run -------------------------------------------------------------------------------


class Progress:
    def __init__(self, out=print):
        self.t0 = time.perf_counter()
        self.out = out

    def __call__(self, msg):
        self.out(f"[{time.strftime('%H:%M:%S')} +{time.perf_counter() - self.t0:6.1f}s] {msg}")


def plan_arms(weights, caches):
    """``(arms, skipped)``: arms as ``[(name, weights, cache)]``; skipped as ``[{arm, reason}]``."""
    arms, skipped = [], []
    for w in weights:
        for c in caches:
            name = arm_name(w, c)
            if c not in FP_CACHES and w not in KIVI_WEIGHTS:
                continue  # affine weights are roofline arms: fp cache only
            if c == "kivi-kernel" and not kivi.kernels_active(None):
                dev = mx.default_device()
                reason = (f"no fused KIVI kernels here: they need MLX's Metal or CUDA backend on the default "
                          f"device, and it is {dev}" + ("" if dev.type == mx.gpu else " (CPU)")
                          + "; kivi-ref runs the MLX-ops reference quantizer instead")
                if kivi.backend() is not None:  # a GPU backend, switched off
                    reason = "KIVI kernels disabled (VQPIPE_KIVI_KERNELS=0 or kernels.set_enabled(False))"
                skipped.append({"arm": name, "reason": reason})
                continue
            arms.append((name, w, c))
    return arms, skipped


def _pairs(arms, baseline):
    """Comparisons: the baseline against every arm; per KIVI weights, fp vs kivi-ref and kivi-ref vs
    kivi-kernel; full/fp vs vqpipe/fp; affine4/fp vs vqpipe/fp (the issue-12 target, side by side)."""
    names = [a[0] for a in arms]
    pairs = [(baseline, n) for n in names if n != baseline]
    extra = [("full/fp", "vqpipe/fp"), ("affine4/fp", "vqpipe/fp")]
    for c in STEP_CACHES:  # what compiling buys each weight arm, and the ratios once compiled
        extra += [(arm_name(w, "fp"), arm_name(w, c)) for w in WEIGHTS]
        extra += [(arm_name("full", c), arm_name("vqpipe", c)), (arm_name("affine4", c), arm_name("vqpipe", c))]
    for w in KIVI_WEIGHTS:
        extra += [(arm_name(w, "fp"), arm_name(w, "kivi-ref")), (arm_name(w, "kivi-ref"), arm_name(w, "kivi-kernel"))]
    pairs += [(a, b) for a, b in extra if a in names and b in names and (a, b) not in pairs]
    return pairs


def run(args, progress=None):
    progress = progress or Progress()
    t_start = time.perf_counter()
    b = _setup(args, progress)
    for P in args.prompt_lengths:
        _bench_length(b, P, progress)
    if args.load_repeats:
        fresh_loads(b, progress)
    result = _finish(b)
    result["wall_s"] = time.perf_counter() - t_start
    _print_roofline(result, progress)
    return result


def _setup(args, progress):
    """Everything before the first prompt length: the result's header, the roofs (measured in this
    run), the models, the KIVI op figures and the arms. Returns the run's state (a namespace)."""
    dtype = compute_dtype(args.dtype)
    dev = mx.default_device()
    progress(f"bench-decode {args.model}: device {dev}, compute dtype {_dtype_name(dtype)}, "
             f"prompt lengths {args.prompt_lengths}, {args.gen_tokens} generated tokens, "
             f"{args.warmup} warm-up ({args.warmup_tokens} tokens) + 1 pilot + {args.repeats} timed rounds, "
             f"{args.prompts} distinct prompts")
    result = {
        "kind": "bench-decode",
        "model": args.model,
        "source": str(args.source),
        "reservoir": str(args.reservoir) if args.reservoir else None,
        "environment": environment(),
        "loadavg_start": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
        "settings": {k: v for k, v in vars(args).items() if k not in ("out", "source", "reservoir")},
        "compute_dtype": _dtype_name(dtype),
    }
    result["settings"]["kivi_ops"] = str(args.kivi_ops) if args.kivi_ops else None
    b = SimpleNamespace(args=args, result=result, records=[], comparisons=[], amdahl=[], checks=[], runs=[],
                        floors=[], generations=[], decoders={})
    _roofs_and_models(b, dtype, dev, progress)
    b.ops = None
    if args.kivi_ops:
        b.ops = load_kivi_ops(args.kivi_ops)
        ops_env = b.ops.get("environment") or {}
        result["kivi_ops"] = {"path": b.ops["path"], "config": b.ops["config"], "backend": ops_env.get("backend"),
                              "gpu_name": ops_env.get("gpu_name"),
                              "same_device": ops_env.get("backend") == result["environment"]["backend"]
                              and ops_env.get("gpu_name") == result["environment"].get("gpu_name")}
    # vqpipe's weights with the fp cache decode as `vqpipe generate` does by default: through the
    # compiled step where decode.step.default_mode takes it (mlx-lm's arms: its eager loop, as
    # mlx_lm.generate runs them)
    b.vqpipe_mode = None
    if "vqpipe" in b.models:
        from ..decode.step import default_mode, model_problem

        mode = default_mode(dev)
        if mode and model_problem(b.models["vqpipe"], mode) is None:
            b.vqpipe_mode = mode
            b.precision["vqpipe"] += f", compiled step ({mode})"
    b.arms, b.skipped = plan_arms(args.weights, args.caches)
    for s in b.skipped:
        progress(f"skipped arm {s['arm']}: {s['reason']}")
    if not b.arms:
        raise ValueError("no arms to run")
    b.baseline = b.arms[0][0]
    b.aa_name = b.baseline + harness.AA_SUFFIX
    result.update(arms=[{"arm": n, "weights": w, "cache": c, "precision": b.precision[w]} for n, w, c in b.arms],
                  skipped_arms=b.skipped, baseline_arm=b.baseline)
    return b


def _roofs_and_models(b, dtype, dev, progress):
    """Copy bandwidth and GEMM rate first (measured in this run), then the models and what one
    decode token reads; sets ``result["roofline"]``."""
    args = b.args
    b.copy = copy = roofline.measure_copy_bandwidth(args.copy_mib << 20)
    progress(f"copy bandwidth ({copy['method']}, {args.copy_mib} MiB): median {copy['median'] / 1e9:.2f} GB/s "
             f"[{copy['min'] / 1e9:.2f}-{copy['max'] / 1e9:.2f}], n={copy['n']}")
    gemm = args.gemm or (8192 if dev.type == mx.gpu else 1024)
    gemm_dtype = _dtype_name(dtype or mx.float32)
    b.flops = flops = roofline.matmul_flops(gemm, gemm, gemm, gemm_dtype)
    progress(f"{gemm_dtype} GEMM {gemm}^3: median {flops['median'] / 1e9:.1f} GFLOP/s "
             f"[{flops['min'] / 1e9:.1f}-{flops['max'] / 1e9:.1f}], n={flops['n']}")

    b.models, b.precision, b.configs, b.tokenizer = load_models(args.source, args.reservoir, args.weights, dtype, progress)
    from mlx_lm.utils import load_config, load_model

    b.config = load_config(Path(args.source))
    lazy_source, _ = load_model(Path(args.source), lazy=True)  # parameter count only; nothing evaluated
    b.n_matmul = roofline.matmul_params(lazy_source)
    del lazy_source
    # stored: the source's dtype (the KV cache of a float32-computing arm is twice this)
    b.kvpp = roofline.kv_bytes_per_position(b.config, (dtype or _source_dtype(args.source)).size)
    b.weights_info = {w: {"precision": b.precision[w], "weight_bytes": decode_weight_bytes(m),
                          "rotation_bytes": rotation_bytes(m), "model_bytes": model_bytes(m)} for w, m in b.models.items()}
    b.result["roofline"] = {"copy_bandwidth": copy, "matmul_flops": flops, "matmul_params": b.n_matmul,
                            "kv_bytes_per_position": b.kvpp, "weights": b.weights_info}
    for w, info in b.weights_info.items():
        progress(f"weights read per decode token, {w} ({info['precision']}): {info['weight_bytes'] / 2**20:.2f} MiB")


def _bench_length(b, P, progress):
    """One prompt length: warm-up and pilot rounds, flush counts, the Amdahl prediction, the timed
    rounds, then records, comparisons, measured-vs-predicted and the text checks."""
    args = b.args
    L = SimpleNamespace(P=P, N=args.gen_tokens, prompts=build_prompts(b.tokenizer, args.prompts, P),
                        sched=flush_schedule(P, args.gen_tokens, args.residual, args.group_size, args.prefill_step),
                        log=[])  # log: every call: arm, prompt index, round, times, ids
    _warmup_and_pilot(b, L, progress)
    _check_flushes(b, L, progress)
    _predict(b, L, progress)
    _timed_rounds(b, L, progress)
    _length_records(b, L)
    for a, o in _pairs(b.arms, b.baseline):
        for phase in ("prefill", "decode"):
            cmp = harness.compare(L.samples[a][phase], L.samples[o][phase], L.floor[phase])
            b.comparisons.append({"model": args.model, "phase": phase, "context": P, "baseline_arm": a, "other_arm": o, **cmp})
            progress(f"  P={P} {phase}: {o} vs {a}: {cmp['text']}")
    _measured_vs_predicted(b, L, progress)
    _text_checks(b, L, progress)
    for e in L.log:
        b.runs.append({k: e[k] for k in ("arm", "context", "prompt", "round", "prefill_s", "decode_s", "flushes")}
                      | {"ids_sha1": hashlib.sha1(json.dumps(e["ids"]).encode()).hexdigest()[:16], "n_ids": len(e["ids"])})
    del L.log
    mx.clear_cache()


def _call(b, L, name, w, c, k, rnd):
    """One generation of arm ``name`` on prompt ``k``, logged with its KV statistics."""
    args = b.args
    model = b.models[w]
    n = args.warmup_tokens if rnd == "warmup" else L.N
    mode = STEP_CACHES.get(c) or (b.vqpipe_mode if (w, c) == ("vqpipe", "fp") else None)
    if mode:
        out, kv, kv_dtype = _call_compiled(b, L, name, model, mode, k, n)
    else:
        cache = make_cache(model, c, args.kivi_bits, args.group_size, args.residual)
        out = generate_once(model, L.prompts[k], cache, n, args.prefill_step)
        kv = kv_stats(cache, b.kvpp)
        kv_dtype = _dtype_name(cache[0].keys.dtype) if getattr(cache[0], "keys", None) is not None else None
    L.log.append({"arm": name, "context": L.P, "prompt": k, "round": rnd, "prefill_s": out["prefill_s"],
                  "decode_s": out["decode_s"], "flushes": kv["flushes"], "ids": out["ids"], "kv": kv, "kv_dtype": kv_dtype})
    return mx.array(out["ids"])


def _call_compiled(b, L, name, model, mode, k, n):
    """A generation through decode_step in ``mode``; one Decoder (one trace) per arm and prompt length."""
    from ..decode.step import Decoder

    key = (name.removesuffix(harness.AA_SUFFIX), L.P)
    if key not in b.decoders:
        b.decoders[key] = Decoder(model, L.P + max(L.N, b.args.warmup_tokens), mode)
    dec = b.decoders[key]
    out = dec.generate(L.prompts[k], n, b.args.prefill_step)
    used = b.kvpp * (L.P + n)
    kv = {"offset": L.P + n, "resident_bytes": b.kvpp * dec.capacity, "compressed_bytes": used,
          "uncompressed_bytes": used, "flushes": 0}
    return out, kv, _dtype_name(dec.layout()[0][1])


def _warmup_and_pilot(b, L, progress):
    # Rounds use prompts 0, 1, 2, ... in order (warm-up, pilot, timed): consecutive calls of an
    # arm always get different prompts, and within a round every arm gets the same one.
    args, P, N = b.args, L.P, L.N
    for r in range(args.warmup):
        progress(f"P={P}: warm-up round {r + 1}/{args.warmup} (prompt {r % args.prompts})")
        for name, w, c in b.arms:
            _call(b, L, name, w, c, r % args.prompts, "warmup")
    k_pilot = args.warmup % args.prompts
    progress(f"P={P}: pilot round (prompt {k_pilot}): peak memory, token ids, flush counts")
    L.peaks = {}
    for name, w, c in b.arms:
        # Collect the previous calls' cyclic garbage first: freed during this call, it would
        # make the call's own peak come out below what was allocated before it.
        gc.collect()
        mx.synchronize()
        start = mx.get_active_memory()
        peak = harness.measure_peak(lambda: _call(b, L, name, w, c, k_pilot, "pilot"))
        e = L.log[-1]
        L.peaks[name] = {"peak_memory_bytes": peak, "active_before_bytes": int(start), "peak_over_start_bytes": int(peak - start)}
        progress(f"  {name}: prefill {P / e['prefill_s']:.1f} tok/s, decode {N / e['decode_s']:.1f} tok/s "
                 f"(pilot, untimed), peak {peak / 2**20:.1f} MiB ({start / 2**20:.1f} MiB allocated before + "
                 f"{(peak - start) / 2**20:.1f} MiB), KV {e['kv']['resident_bytes'] / 2**20:.2f} MiB resident / "
                 f"{e['kv']['compressed_bytes'] / 2**20:.2f} MiB compressed, flushes {e['flushes']}")
    L.pilot = {e["arm"]: e for e in L.log if e["round"] == "pilot"}


def _check_flushes(b, L, progress):
    """The measured flush totals must follow the cache's schedule."""
    args = b.args
    L.layers = {}
    for name, w, c in b.arms:
        if c not in FP_CACHES:
            kv = L.pilot[name]["kv"]
            L.layers[w] = kv["layers"]
            want = kv["layers"] * (quantized_tokens(L.P + L.N, args.residual, args.group_size) // args.group_size)
            if kv["flushes"] != want:
                progress(f"  WARNING {name}: {kv['flushes']} flushes measured, the schedule says {want}")


def _predict(b, L, progress):
    """Amdahl, printed before anything end to end is timed."""
    P, N, ops = L.P, L.N, b.ops
    L.predictions = {}
    for w in KIVI_WEIGHTS:
        ref = arm_name(w, "kivi-ref")
        if ref not in L.pilot:
            continue
        pred = {"model": b.args.model, "weights": w, "context": P, "gen_tokens": N,
                "baseline_arm": ref, "other_arm": arm_name(w, "kivi-kernel"),
                "flushes_per_layer": {ph: {"launches": len(s), "tokens": int(sum(s))} for ph, s in L.sched.items()},
                "layers": L.layers.get(w)}
        if ops is None:
            pred["reason"] = "no --kivi-ops: no op-level kernel figures"
        else:
            for phase, toks, base_s in (("decode", N, L.pilot[ref]["decode_s"]), ("prefill", P, L.pilot[ref]["prefill_s"])):
                sv = predict_saving(L.sched[phase], L.layers[w], ops)
                if sv is None:
                    pred["reason"] = f"{ops['path']} has no kernel figures (no GPU backend where it ran)"
                    break
                per_tok = sv["saving_s"] / toks
                bound = amdahl_speedup(base_s, sv["saving_s"])
                pred[phase] = {**sv, "saving_s_per_token": per_tok, "pilot_reference_s": base_s,
                               "predicted_speedup_max": bound}
                rows = ", ".join(f"S={r['S']} {r['mode']}: ref {r['reference_s'] * 1e6:.1f} us, kernel "
                                 f"{r['kernel_s'] * 1e6:.1f} us" for r in sv["op_rows"]) or "no flushes"
                progress(f"  Amdahl {w} {phase} @P={P}: {sv['launches_per_layer']} flush launches x "
                         f"{sv['layers']} layers per generation ({rows}) -> saving {per_tok * 1e6:.2f} us/token; "
                         f"predicted {phase} speedup <= {bound:.4f}x (Amdahl, pilot kivi-ref "
                         f"{base_s / toks * 1e3:.3f} ms/token)")
        if "reason" in pred:
            progress(f"  Amdahl {w} @P={P}: no prediction: {pred['reason']}")
        L.predictions[w] = pred


def _timed_rounds(b, L, progress):
    """The timed rounds, interleaved, with the A/A copy of the baseline; per-arm samples and floors."""
    args, P = b.args, L.P
    offset = args.warmup + 1
    timed = {name: (lambda i, name=name, w=w, c=c: _call(b, L, name, w, c, (offset + i) % args.prompts, "timed"))
             for name, w, c in b.arms}
    timed = harness.with_aa(timed, b.baseline)
    bw, bc = next((w, c) for n, w, c in b.arms if n == b.baseline)
    timed[b.aa_name] = lambda i: _call(b, L, b.aa_name, bw, bc, (offset + i) % args.prompts, "timed")
    progress(f"P={P}: timed rounds: {len(timed)} arms (A/A: {b.aa_name}) x {args.repeats}")
    L.totals = harness.run_interleaved(timed, args.prompts, args.repeats, warmup=0)
    progress(f"P={P}: timed rounds done")

    L.samples = {}
    for e in L.log:
        if e["round"] == "timed":
            s = L.samples.setdefault(e["arm"], {"prefill": [], "decode": []})
            s["prefill"].append(e["prefill_s"])
            s["decode"].append(e["decode_s"])
    L.floor = {ph: harness.noise_floor(L.samples[b.baseline][ph], L.samples[b.aa_name][ph]) for ph in ("prefill", "decode")}
    b.floors += [{"context": P, "phase": ph, "noise_floor": f} for ph, f in L.floor.items()]


def _length_records(b, L):
    """One record per arm and phase: tok/s, memory, KV bytes; flushes (KIVI arms) or the roofline
    (fp-cache arms); then the harness's own samples (a whole generation each)."""
    for name, w, c in b.arms:
        for phase, toks in (("prefill", L.P), ("decode", L.N)):
            rate = harness.summarize([toks / s for s in L.samples[name][phase]])
            rec = {"model": b.args.model, "arm": name, "weights": w, "cache": c, "precision": b.precision[w],
                   "phase": phase, "context": L.P, "tokens": toks, "unit": "tok/s", **rate,
                   "seconds": harness.summarize(L.samples[name][phase]), "noise_floor": L.floor[phase],
                   **L.peaks[name], "model_bytes": b.weights_info[w]["model_bytes"],
                   "kv_bytes": {**L.pilot[name]["kv"], "dtype": L.pilot[name]["kv_dtype"]}}
            if c not in FP_CACHES:
                _flush_fields(b, L, rec, phase, toks)
            else:  # the roofline arms: one per weight precision, fp KV cache
                _roofline_fields(b, L, rec, w, phase, rate)
            b.records.append(rec)
    b.generations += [{"arm": name, "context": L.P, "unit": "s", **harness.summarize(t)} for name, t in L.totals.items()]


def _flush_fields(b, L, rec, phase, toks):
    kv, g = rec["kv_bytes"], b.args.group_size
    rec["flushes"] = {ph: kv["layers"] * sum(L.sched[ph]) // g for ph in ("prefill", "decode")}
    rec["flushes"].update(total_measured=kv["flushes"], layers=kv["layers"], launches_per_layer=len(L.sched[phase]),
                          unit="groups of group_size tokens, summed over layers")
    rec["flushes"]["per_token"] = rec["flushes"][phase] / toks


def _roofline_fields(b, L, rec, w, phase, rate):
    rec["weight_bytes"] = b.weights_info[w]["weight_bytes"]
    rec["kv_bytes_per_position"] = b.kvpp
    if phase == "decode":
        mean_ctx = L.P + (L.N + 1) / 2  # positions attended, averaged over the decode steps
        rec["mean_context"] = mean_ctx
        rec["bytes_per_token"] = roofline.decode_bytes_per_token(rec["weight_bytes"], b.kvpp, mean_ctx)
        rec["flops_per_token"] = roofline.flops_per_token(b.n_matmul, b.config, mean_ctx)
        rec["achieved"] = {k: roofline.achieved(rec["bytes_per_token"], rate[k], b.copy["median"])
                           for k in ("median", "min", "max")}
    else:
        rec["flops_per_token"] = roofline.flops_per_token(b.n_matmul, b.config, (L.P + 1) / 2)
        rec["achieved_flops"] = {k: {"flops_per_s": rec["flops_per_token"] * rate[k],
                                     "percent_of_peak": 100.0 * rec["flops_per_token"] * rate[k] / b.flops["median"]}
                                 for k in ("median", "min", "max")}


def _measured_vs_predicted(b, L, progress):
    """The Amdahl predictions beside the measured kernel-vs-reference speedups."""
    for w, pred in L.predictions.items():
        other = pred["other_arm"]
        if other not in L.samples:
            pred["measured"] = f"not measured: arm {other} did not run"
            b.amdahl.append(pred)
            continue
        ref_samples = L.samples[pred["baseline_arm"]]
        for phase, toks in (("decode", L.N), ("prefill", L.P)):
            cmp = harness.compare(ref_samples[phase], L.samples[other][phase], L.floor[phase])
            m = {"speedup": cmp["speedup"], "verdict": cmp["verdict"], "floor": cmp["floor"],
                 "reference_s_per_token": harness.summarize([s / toks for s in ref_samples[phase]]),
                 "kernel_s_per_token": harness.summarize([s / toks for s in L.samples[other][phase]])}
            if phase in pred:
                ref_med = statistics.median(ref_samples[phase])
                m["predicted_speedup_max_with_measured_reference"] = amdahl_speedup(ref_med, pred[phase]["saving_s"])
                m["measured_saving_s_per_token"] = (ref_med - statistics.median(L.samples[other][phase])) / toks
                pred[phase]["measured"] = m
            else:
                pred.setdefault("measured", {})[phase] = m
            bound = pred.get(phase, {}).get("predicted_speedup_max")
            progress(f"  Amdahl {w} {phase} @P={L.P}: predicted <= "
                     + (f"{bound:.4f}x" if bound else "n/a") + f" | measured {cmp['text']}")
        b.amdahl.append(pred)


def _check_pairs(b):
    pairs = [(b.baseline, b.aa_name, True, "A/A: the baseline run twice (determinism)")]
    # text of the weight arms against the full-precision one (lossy: recorded, not required)
    pairs += [(arm_name("full", "fp"), arm_name(w, "fp"), False, "full vs quantized weights (lossy)")
              for w in WEIGHTS if w != "full"]
    for w in KIVI_WEIGHTS:
        pairs += [(arm_name(w, "kivi-ref"), arm_name(w, "kivi-kernel"), True, "kernels on vs off (lossless)"),
                  (arm_name(w, "fp"), arm_name(w, "kivi-ref"), False, "fp cache vs KIVI (lossy)")]
    # Same weights, same arithmetic but for fused elementwise rounding (identical in float32, tested in
    # tests/test_decode_step.py); recorded, not required, since bf16 fusion may round differently.
    pairs += [(arm_name(w, "fp"), arm_name(w, c), False, "eager mlx-lm vs the compiled step (same weights)")
              for c in STEP_CACHES for w in WEIGHTS]
    return pairs


def _text_checks(b, L, progress):
    """Lossless and agreement checks on every prompt two arms both ran (pilot + timed rounds)."""
    by_arm = {}
    for e in L.log:
        if e["round"] != "warmup":  # warm-up generations may be shorter
            by_arm.setdefault(e["arm"], {}).setdefault(e["prompt"], []).append(e["ids"])
    deterministic = None
    for a, o, must, what in _check_pairs(b):
        if a in by_arm and o in by_arm:
            chk = {"context": L.P, "a": a, "b": o, "what": what, **compare_outputs(by_arm[a], by_arm[o], b.tokenizer, must)}
            if o == b.aa_name:
                deterministic = chk["identical"]
                chk["verdict"] = ("byte-identical (generation is deterministic here)" if deterministic else
                                  "DIFFERENT: generation is not run-to-run deterministic on this device")
            else:
                lossless_verdict(chk, deterministic)
        elif must and o.endswith("kivi-kernel") and a in by_arm:
            chk = {"context": L.P, "a": a, "b": o, "what": what, "must_match": True, "identical": None,
                   "verdict": "skipped: " + next((s["reason"] for s in b.skipped if s["arm"] == o), "arm not run")}
        else:
            continue
        b.checks.append(chk)
        distinct = (f" (distinct tokens per generation: median {chk['distinct_tokens']['median']:g} of {L.N})"
                    if chk.get("distinct_tokens") else "")
        progress(f"  check P={L.P} {o} vs {a} ({what}): {chk['verdict']}{distinct}")


def _finish(b):
    """The run's lists into the result, the lossless verdict, prompts and the closing load."""
    result, checks = b.result, b.checks
    result.update(records=b.records, comparisons=b.comparisons, amdahl=b.amdahl, checks=checks, runs=b.runs,
                  generation_seconds=b.generations,
                  noise_floors=b.floors, noise_floor=max(f["noise_floor"] for f in b.floors))
    required = [c for c in checks if c["must_match"] and c["b"].endswith("kivi-kernel")]
    ran = [c for c in required if c["identical"] is not None]
    result["lossless"] = {
        "kernels_on_vs_off": required,
        # True: every kernels-on text byte-identical to kernels-off; False: a conclusive difference;
        # None: not run (no GPU backend) or inconclusive (nondeterministic generation, see the A/A check).
        "verdict": (None if not ran else True if all(c["identical"] for c in ran)
                    else False if any(c.get("conclusive") and not c["identical"] for c in ran) else None),
        "deterministic": [{"context": c["context"], "identical": c["identical"]} for c in checks if c["b"].endswith(harness.AA_SUFFIX)],
    }
    result["prompts"] = {"corpus": CORPUS.name, "n": b.args.prompts, "how": "text.corpus_windows: distinct windows spread over the corpus"}
    result["loadavg_end"] = list(os.getloadavg()) if hasattr(os, "getloadavg") else None
    return result


def _print_roofline(result, progress):
    roof = result["roofline"]
    bw, fl = roof["copy_bandwidth"]["median"], roof["matmul_flops"]["median"]
    progress(f"roofline: copy {bw / 1e9:.2f} GB/s, GEMM {fl / 1e9:.1f} GFLOP/s (medians, this run); "
             "decode: achieved bandwidth = bytes/token x tok/s; prefill: FLOP/s against the GEMM roof")
    recs = [r for r in result["records"] if "weight_bytes" in r]
    for r in recs:
        if r["phase"] == "decode":
            a = r["achieved"]
            progress(f"  {r['precision']:>18} decode  @{r['context']:>5}: {r['median']:9.1f} tok/s [{r['min']:.1f}-{r['max']:.1f}], "
                     f"{r['bytes_per_token'] / 2**20:8.2f} MiB/token -> {a['median']['bytes_per_s'] / 1e9:7.2f} GB/s = "
                     f"{a['median']['percent_of_peak']:5.1f}% of copy [{a['min']['percent_of_peak']:.1f}-{a['max']['percent_of_peak']:.1f}%]")
        else:
            a = r["achieved_flops"]
            progress(f"  {r['precision']:>18} prefill @{r['context']:>5}: {r['median']:9.1f} tok/s [{r['min']:.1f}-{r['max']:.1f}], "
                     f"{a['median']['flops_per_s'] / 1e9:8.1f} GFLOP/s = {a['median']['percent_of_peak']:5.1f}% of GEMM "
                     f"[{a['min']['percent_of_peak']:.1f}-{a['max']['percent_of_peak']:.1f}%]")


def _positive(text):
    v = int(text)
    if v < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {v}")
    return v


def parse_args(argv):
    p = argparse.ArgumentParser(prog="vqpipe bench-decode", description=__doc__.split("\n\n")[0])
    p.add_argument("--source", required=True, help="source model directory (download stage output)")
    p.add_argument("--reservoir", help="reservoir directory (pack stage output); needed for the vqpipe arms")
    p.add_argument("--model", help="model name recorded in the output (default: the source directory's name)")
    p.add_argument("--out", required=True, help="output JSON")
    p.add_argument("--prompt-lengths", type=_positive, nargs="+", help=f"prompt lengths in tokens (default {DEFAULTS['prompt_lengths']})")
    p.add_argument("--gen-tokens", type=_positive, help=f"decode steps per generation (default {DEFAULTS['gen_tokens']})")
    p.add_argument("--repeats", type=_positive, help=f"timed rounds per prompt length (default {DEFAULTS['repeats']})")
    p.add_argument("--warmup", type=int, help=f"untimed warm-up rounds before the pilot (default {DEFAULTS['warmup']}; "
                   "on a GPU keep >= 1: the first calls JIT-compile)")
    p.add_argument("--warmup-tokens", type=_positive,
                   help="decode steps of a warm-up generation (default: min(gen-tokens, 32); the prompt is full length, "
                   "so prefill chunks, flushes and decode steps all compile)")
    p.add_argument("--prompts", type=int, help=f"distinct prompts per length, >= 20 (default {DEFAULTS['prompts']})")
    p.add_argument("--kivi-bits", type=int, choices=(2, 4, 8))
    p.add_argument("--group-size", type=_positive, help=f"KIVI group size G (default {DEFAULTS['group_size']})")
    p.add_argument("--residual", type=int, help=f"KIVI residual length R (default {DEFAULTS['residual']})")
    p.add_argument("--prefill-step", type=_positive, help=f"prefill chunk (default {DEFAULTS['prefill_step']}, mlx-lm's)")
    p.add_argument("--kivi-ops", help="bench-kivi JSON with per-flush kernel and reference times (for the Amdahl prediction)")
    p.add_argument("--weights", nargs="+", choices=WEIGHTS, default=list(WEIGHTS),
                   help="weight arms; the first with the fp cache is the baseline (default: all)")
    p.add_argument("--caches", nargs="+", choices=CACHES, default=[c for c in CACHES if c not in STEP_CACHES],
                   help="KV-cache arms (default: all but the compiled-step ones: " + ", ".join(STEP_CACHES) + ")")
    p.add_argument("--dtype", default="auto", choices=("auto", "stored", "float32", "bfloat16", "float16"),
                   help="compute dtype (auto: float32 on the CPU, bfloat16 on a GPU; stored: every model as its "
                   "loader gives it, nothing cast, as a user's generate runs it)")
    p.add_argument("--copy-mib", type=_positive, help="buffer of the copy-bandwidth measurement (default 256)")
    p.add_argument("--gemm", type=_positive, help="n of the n^3 GEMM roof (default 1024 on the CPU, 8192 on a GPU)")
    p.add_argument("--load-repeats", type=int, default=3,
                   help="fresh-process loads per weights arm, interleaved, after one untimed round (0: none; "
                   "vqpipe/bench/fresh_load.py)")
    p.add_argument("--quick", action="store_true",
                   help="CPU/CI smoke settings for any option not given: " + ", ".join(f"{k}={v}" for k, v in QUICK.items()))
    args = p.parse_args(argv)
    for k, v in (QUICK if args.quick else DEFAULTS).items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    if args.prompts < 20:
        p.error("--prompts must be >= 20 (distinct prompts rotate through the rounds)")
    if args.warmup < 0 or args.residual < 0 or args.load_repeats < 0:
        p.error("--warmup, --residual and --load-repeats must be >= 0")
    if min(args.prompt_lengths) < 2:
        p.error("--prompt-lengths must be >= 2")
    if "vqpipe" in args.weights and not args.reservoir:
        p.error("the vqpipe arm needs --reservoir")
    if "fp" not in args.caches:
        p.error("--caches must include fp (the baseline and the roofline arms)")
    args.warmup_tokens = args.warmup_tokens or min(args.gen_tokens, 32)
    args.weights = list(dict.fromkeys(args.weights))
    args.caches = [c for c in CACHES if c in args.caches]
    args.model = args.model or Path(args.source).name
    return args


def main(argv=None):
    args = parse_args(sys.argv[1:] if argv is None else argv)
    if not (Path(args.source) / "config.json").is_file():
        print(f"vqpipe bench-decode: error: {args.source} has no config.json", file=sys.stderr)
        return 2
    try:
        result = run(args)
    except ValueError as e:
        print(f"vqpipe bench-decode: error: {e}", file=sys.stderr)
        return 2
    record.write(args.out, "bench-decode", result, inputs={"source": args.source, "reservoir": args.reservoir, "kivi_ops": args.kivi_ops})
    v = result["lossless"]["verdict"]
    print(f"bench-decode: wrote {args.out} ({result['wall_s']:.0f}s); kernels on vs off: "
          + {True: "byte-identical", False: "DIFFERENT", None: "not run or inconclusive (see checks)"}[v])
    return 0


if __name__ == "__main__":
    sys.exit(main())
