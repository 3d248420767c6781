"""Quality benchmark: vqpipe vs MLX affine quantization, measured as a user would (docs/quality.md).

Arms at each bit width, all against the same source model:
    vqpipe       the quantize stage's artifact (--quantized DIR, the pipeline's rotation), or
                 quantize_model in-process with --rotation when no artifact is given
    unrotated    the same with rotation "none"
    affine-gG    MLX's own nn.quantize (affine, group G in --affine-groups, default 32 64 128) on
                 every nn.Linear, from the source's stored dtype: scales and biases in that dtype,
                 as mlx_lm.convert stores them
    mlx-gptq, mlx-awq, mlx-dynamic, mlx-dwq, mxfp4, nvfp4
                 what users would pick instead (vqpipe/bench/competitors.py): mlx-lm's own quantizers,
                 with the calibration tokens vqpipe's calibrated arms use, and MLX's fp4 modes
On windows of real English text no method saw (vqpipe.text: the Devil's Dictionary's eval split,
and the Jargon File, another domain): perplexity, KL(source ||
arm) per token and top-1 agreement with the source, per window, median [min-max]; bits per weight
counted from what each arm stores; and greedy generations on fixed chat prompts, side by side.
Every arm runs as dense float32 layers holding its dequantized weights (``dense_copy``: the
same weights, and MLX's CPU quantized matmul is far too slow for 512-token windows).

``--timing`` also times quantization itself (``quantize_model``) per rotation in fresh
subprocesses, with each child's peak RSS against the source model's size on disk.
"""

import argparse
import json
import math
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten, tree_map

from ..bench import competitors
from ..quant import cpu_eval, recipe
from .. import text
from ..layers.fold import unfold_model
from ..quant.residual_rotation import TiedEmbedding
from ..store import record
from ..store.fsutil import atomic_dir, write_json
from ..quant.config import QuantizeConfig
from ..quant.quantize import quantize_model
from ..store.quantized import load_quantized
from ..bench.env import environment
from ..bench.harness import summarize

AFFINE_GROUPS = (32, 64, 128)
COMPETITORS = ("mlx-gptq", "mlx-awq", "mlx-dynamic", "mlx-dwq", "mxfp4", "nvfp4")
COSTLY = ("mlx-awq", "mlx-dynamic", "mlx-dwq")  # run when asked for (--arms): their CPU cost (docs/quality-smollm2.md)
TEXTS = ("devil", "jargon")  # evaluation texts (vqpipe/text.py); the first is the records' top level
PROMPTS = (
    "What is the capital of France?",
    "Explain in one sentence why the sky is blue.",
    "Write a short poem about the sea.",
)


def _fp32(model):
    model.update(tree_map(lambda a: a.astype(mx.float32) if mx.issubdtype(a.dtype, mx.floating) else a,
                          model.parameters()))
    mx.eval(model.parameters())
    return model


def load_source(path, dtype_cast=True):
    """The source model (float32 unless told otherwise); an affine-quantized source is dequantized."""
    from mlx_lm.utils import dequantize_model, load

    model, tok = load(str(path))
    model = dequantize_model(model)
    return (_fp32(model) if dtype_cast else model), tok


def source_info(path):
    """What vqpipe-source.json says about the source's own precision (a GGUF may be quantized)."""
    p = Path(path) / "vqpipe-source.json"
    info = json.loads(p.read_text()) if p.is_file() else {}
    q = (info.get("gguf") or {}).get("quantization") or {}
    quant = (info.get("synth") or {}).get("quantization")
    full = q.get("full_precision", quant is None)
    note = q.get("note") or (None if quant is None else "the source is an MLX affine 4-bit checkpoint, dequantized")
    return {"source": info.get("source"), "full_precision": full, "note": note,
            "gguf_types": q.get("types"), "license": (info.get("gguf") or {}).get("license")}


# --- the arms -----------------------------------------------------------------------------------


class SkippedArm(Exception):
    """An arm that cannot be built for this model (recorded with the reason, not measured)."""


def affine_odd_widths(model, group_size, embeddings=False):
    """Input widths of the layers affine quantization would cover that ``group_size`` does not divide."""
    kinds = (nn.Linear, nn.Embedding) if embeddings else nn.Linear
    return sorted({m.weight.shape[1] for _, m in model.named_modules()
                   if isinstance(m, kinds) and m.weight.shape[1] % group_size})


def affine_arm(path, bits, group_size, embeddings=False, dense=False):
    """(model, weight rel. MSE, bpw): MLX affine quantization of every nn.Linear (and with
    ``embeddings`` of the embedding table, a tied head with it, as mlx_lm.convert does), computed
    in float32. ``dense``: the model as :func:`dense_copy` makes it, from the dequantized weights
    the error was computed on (one dequantization, not two)."""
    from mlx_lm.utils import dequantize_model, load_model

    # lazily: a skipped arm reads no weights, and no tokenizer is needed here
    model = dequantize_model(load_model(Path(path), lazy=True)[0])
    kinds = (nn.Linear, nn.Embedding) if embeddings else nn.Linear
    odd = affine_odd_widths(model, group_size, embeddings)
    if odd:
        # mlx_lm.convert would leave these layers dense: not a g{group_size} model at all.
        raise SkippedArm(f"input widths {odd} are not multiples of the group size {group_size}")
    mx.eval(model.parameters())  # read once: quantization and the error below both use them
    weights = {n: m.weight.astype(mx.float32) for n, m in model.named_modules() if isinstance(m, kinds)}
    nn.quantize(model, group_size=group_size, bits=bits, class_predicate=lambda p, m: isinstance(m, kinds))
    mx.eval(model.parameters())
    bpw = bits_per_weight(model)  # before the cast: scales/biases as stored
    _fp32(model)
    err = tot = 0.0
    w_hats = {}
    for name, m in model.named_modules():
        if isinstance(m, (nn.QuantizedLinear, nn.QuantizedEmbedding)):
            w, w_hat = weights.pop(name), mx.dequantize(m.weight, m.scales, m.biases, m.group_size, m.bits)
            mx.eval(w, w_hat)
            # numpy's float32 dot (BLAS): MLX's elementwise passes over 135M weights took 2 s
            w_np = np.asarray(w).reshape(-1)
            d = np.subtract(np.asarray(w_hat).reshape(-1), w_np)
            err += float(np.dot(d, d))
            tot += float(np.dot(w_np, w_np))
            if dense:
                w_hats[name] = w_hat
    return (dense_copy(model, w_hats) if dense else model), err / tot, bpw


def vqpipe_arm(path, bits, rotation, seed, quantized=None, embeddings=False):
    """(model, weight rel. MSE, bpw): the quantize artifact ``quantized`` if given, else quantized here
    (data-free, the embedding quantized with ``embeddings``, as the affine arms are given it).

    The one place bench-quality makes a vqpipe model: from the pipeline's artifact, its options
    are whatever the quantize rule used.
    """
    if quantized is not None:
        model, _ = load_quantized(quantized)
        records = json.loads((Path(quantized) / "quantized.json").read_text())["records"]
    else:
        model, _ = load_source(path)
        config = QuantizeConfig(bits, rotation, seed, bool(embeddings), dtype="float32", threads=1, calib_text="none")
        records = quantize_model(model, config)
    err = sum(r["squared_error"] for r in records) / sum(r["weight_sq"] for r in records)
    bpw = bits_per_weight(model)  # before the cast: float16 group scales count 16 bits, as stored
    return _fp32(model), err, bpw


def competitor_arm(path, method, bits, calib, embeddings=False, target_bpw=None, dwq_lr=competitors.DWQ_LR):
    """(model, weight rel. MSE or None, bpw, the method's settings) of one of :data:`COMPETITORS`
    at ``bits``; ``calib()`` gives the calibration tokens, called only by the calibrated methods.
    :class:`SkippedArm` where the tool refuses the width or model.

    The tools run in float32 (MLX's CPU bfloat16 matmul is ~20x slower than OpenBLAS's float32:
    mlx-lm on a bf16 source would compute in bf16), then everything is cast back to the source's
    dtype, so scales, biases and dense parameters are counted and evaluated as mlx-lm stores them."""
    from mlx_lm.utils import dequantize_model, load_model

    try:
        competitors.check(method, bits)
    except competitors.Refused as e:
        raise SkippedArm(str(e)) from None
    model, config = load_model(Path(path), lazy=True)
    model = dequantize_model(model)
    mx.eval(model.parameters())
    dtype = next(m.weight.dtype for _, m in model.named_modules() if isinstance(m, nn.Linear))
    weights = {n: m.weight for n, m in model.named_modules() if isinstance(m, (nn.Linear, nn.Embedding))}
    _fp32(model)
    try:
        if method == "mlx-gptq":
            info = competitors.gptq(model, calib, bits)
        elif method == "mlx-awq":
            info = competitors.awq(model, calib, bits, config["model_type"])
        elif method == "mlx-dynamic":
            info = competitors.dynamic(model, calib(), bits, target_bpw, dtype=dtype)
        elif method == "mlx-dwq":
            info = competitors.dwq(model, calib, bits, lr=dwq_lr)
        else:
            info = competitors.fp4(model, method, bits, embeddings)
    except competitors.Refused as e:
        raise SkippedArm(str(e)) from None
    model.set_dtype(dtype)
    mx.eval(model.parameters())
    info["embedding"] = competitors.embedding_format(model)
    bpw = bits_per_weight(model)  # before the cast: scales/biases as stored
    bpw["bpw_mlx_lm"] = competitors.mlx_lm_bpw(model)
    err = tot = 0.0
    w_hats = {}
    for name, m in model.named_modules():
        if isinstance(m, (nn.QuantizedLinear, nn.QuantizedEmbedding)):
            w_hats[name] = dequantized(m)
            w = weights[name].astype(mx.float32)
            err += mx.sum(mx.square(w_hats[name] - w)).item()
            tot += mx.sum(mx.square(w)).item()
    # AWQ moves per-channel scales into the previous layer: its weights are not the source's
    return dense_copy(_fp32(model), w_hats), (None if method == "mlx-awq" else err / tot), bpw, info


def dequantized(m):
    """The float32 weight of an MLX quantized layer (any mode: affine, mxfp4, nvfp4)."""
    return mx.dequantize(m.weight, m.scales, m.get("biases"), m.group_size, m.bits,
                         mode=getattr(m, "mode", "affine")).astype(mx.float32)


# --- bits per weight ----------------------------------------------------------------------------


def bits_per_weight(model):
    """Stored bits of every quantized layer over its weight count, by part, and what stays dense.

    vqpipe layers: what ``recipe.stored_layers`` counts (codes, row scales, codebook, a trellis table
    once per model, rotation state; ``bpw_seed_rotation`` leaves out rotation arrays, as
    persist_rotation=False stores only seeds). Affine layers: packed codes, scales and biases as stored.
    """
    parts, weights, quantized = Counter(), 0, set()
    for name, meta, bits in recipe.stored_layers(model):
        weights += meta["in_features"] * meta["out_features"]
        for k, b in bits.items():
            parts["rotation" if k.startswith(("rotation.", "head.rotation.")) else k] += b
        quantized.add(name)
    for name, m in model.named_modules():
        if isinstance(m, (nn.QuantizedLinear, nn.QuantizedEmbedding)):
            weights += m.weight.size * 32 // m.bits
            parts["codes"] += m.weight.nbytes * 8
            parts["scales"] += m.scales.nbytes * 8
            if m.get("biases") is not None:
                parts["biases"] += m.biases.nbytes * 8
            quantized.add(name)
    dense, matrix = Counter(), Counter()
    modules = dict(model.named_modules())
    for k, v in tree_flatten(model.parameters()):
        module, _, leaf = k.rpartition(".")
        if module not in quantized or leaf == "bias":
            kind = "bias" if leaf == "bias" else "norm" if "norm" in module else module.split(".")[-1]
            dense[kind] += v.size
            if leaf == "weight" and isinstance(modules.get(module), (nn.Linear, nn.Embedding)):
                matrix["weights"] += v.size
                matrix["bits"] += v.nbytes * 8
    if not weights:
        return None
    total = sum(parts.values())
    return {"bpw": total / weights, "bpw_seed_rotation": (total - parts["rotation"]) / weights,
            # every weight matrix (a dense embedding at its stored size): compares arms that
            # quantize the embedding with arms that keep it dense
            "bpw_matrices": (total + matrix["bits"]) / (weights + matrix["weights"]),
            "parts_bpw": {k: v / weights for k, v in sorted(parts.items())},
            "quantized_weights": weights, "quantized_layers": len(quantized),
            "unquantized_params": dict(sorted(dense.items())), "unquantized_total": sum(dense.values())}


# --- metrics ------------------------------------------------------------------------------------


def window_logprobs(model, tokens, out=None):
    """Log-probabilities [len, vocab] of one window, float32 numpy (into ``out`` if given: a
    window's 100 MB in a fresh array cost more page-fault time than the exponentials). The
    forward runs with numpy doing the exponentials and the output head (vqpipe/quant/cpu_eval.py:
    MLX's CPU exp is ~15x slower, and its logsumexp is off by up to 3e-4 over a 49k vocabulary)."""
    return cpu_eval.window_logprobs(model, tokens, out=out)


def logprobs(model, tokens):
    """:func:`window_logprobs` as an MLX array."""
    return mx.array(window_logprobs(model, tokens))


def reference(lp, path, buf=None):
    """The source's side of one window's metrics, computed once and shared by every arm:
    (file of p = exp(log p_source), float32, sum_v p log p per position, argmax per position).
    The exponential over the vocabulary is most of a metric's cost: per arm only sum_v p log q
    (one dot product a position) is left. ``buf``: an array of lp's shape to compute p in."""
    lp = np.asarray(lp, dtype=np.float32)
    p = np.exp(lp, out=buf)
    negent = np.einsum("ij,ij->i", p, lp, dtype=np.float64)
    np.save(path, p)
    return path, negent, lp.argmax(axis=-1)


def window_metrics(ref, lp, tokens):
    """(KL(source || arm) per token, top-1 agreement, NLL of the next token) for one window;
    ``ref`` from :func:`reference`. KL = sum_v p (log p - log q) per position, averaged."""
    path, negent, arg = ref
    lp = np.asarray(lp, dtype=np.float32)
    p = np.load(path, mmap_mode="r")
    kl = float(np.mean(negent - np.einsum("ij,ij->i", p, lp, dtype=np.float64)))
    top1 = float(np.mean(arg == lp.argmax(axis=-1)))
    return kl, top1, nll(lp, tokens)


def nll(lp, tokens):
    """Mean negative log-likelihood of each next token (float64 sum)."""
    lp, tokens = np.asarray(lp, dtype=np.float32), np.asarray(tokens)
    return float(-np.mean(lp[np.arange(len(tokens) - 1), tokens[1:]], dtype=np.float64))


def source_references(source, windows, tmpdir):
    """(per-window reference probabilities, per-window NLL) of the source model.

    The probabilities are float32 files in ``tmpdir`` (memory-mapped when read): in memory,
    20 x 512 x 49152 of them are 2 GB per process."""
    refs, nlls, lp, p = [], [], None, None
    for i, w in enumerate(windows):
        lp = window_logprobs(source, w, out=lp)  # one buffer each for log p and p, every window
        p = np.empty_like(lp) if p is None else p
        nlls.append(nll(lp, w))
        refs.append(reference(lp, f"{tmpdir}/ref{i}.npy", buf=p))
    return refs, nlls


def ppl_record(nlls):
    return {"ppl": summarize([math.exp(x) for x in nlls]), "ppl_mean": math.exp(sum(nlls) / len(nlls)),
            "nll_mean": sum(nlls) / len(nlls)}


def dense_copy(model, weights=None):
    """Quantized layers (vqpipe and affine) replaced by nn.Linear holding their dequantized weights
    (``weights``: {module name: float32 weight} already computed, used as given).

    The same weights; only the rounding order of the matmul differs. MLX's CPU quantized matmul
    is ~25x slower than a float32 GEMM at 512 tokens (202 s vs 7 s a window for SmolLM2), and
    vqpipe's CPU forward rebuilds its weight on every call, so every arm is evaluated this way.
    """
    from mlx.utils import tree_unflatten

    swaps = []
    for name, m in model.named_modules():
        if weights and name in weights:
            w = weights[name]
        elif hasattr(m, "dequantized_weight"):
            w = m.dequantized_weight(mx.float32)
        elif isinstance(m, (nn.QuantizedLinear, nn.QuantizedEmbedding)):
            w = dequantized(m)
        else:
            continue
        if hasattr(m, "as_linear"):  # an embedding table (a tied head calls its as_linear)
            if getattr(m, "head", None) is not None:  # a residual-rotated tied head keeps its input map
                swaps.append((name, TiedEmbedding(w, m.head)))
                continue
            emb = nn.Embedding(*w.shape)
            emb.weight = w
            swaps.append((name, emb))
            continue
        lin = nn.Linear(w.shape[1], w.shape[0], bias="bias" in m)
        lin.weight = w
        if "bias" in m:
            lin.bias = m.bias.astype(mx.float32)
        swaps.append((name, lin))
    model.update_modules(tree_unflatten(swaps))
    mx.eval(model.parameters())
    return model


def generations(model, tok, prompts, max_tokens):
    """Greedy continuations of the chat prompts, all prompts in one batch (mlx-lm's batch_generate:
    one pass over the weights per step for every prompt; greedy decoding of a 135M model on the
    CPU is bound by reading the weights, so this is 1.6x cheaper than one prompt at a time)."""
    from mlx_lm.generate import batch_generate

    if not prompts:
        return []
    ids = [tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True)
           if getattr(tok, "chat_template", None) else tok.encode(p) for p in prompts]
    return list(batch_generate(model, tok, ids, max_tokens=max_tokens).texts)


def shard_windows(n_windows, shard):
    """Indices of the evaluation windows of ``shard`` = (i, n): the i-th of n contiguous slices."""
    i, n = shard
    if not 0 <= i < n or n > n_windows:
        raise ValueError(f"shard {i}/{n} of {n_windows} windows: need 0 <= i < n <= windows")
    return list(range(i * n_windows // n, (i + 1) * n_windows // n))


def source_record(path, source, nlls, index, length):
    return {"method": "source", **ppl_record(nlls), "per_window": {"index": index, "nll": nlls},
            "bpw": bits_per_weight(source), **source_info(path), "tokens": len(index) * length}


def check_arms(arms, affine_groups):
    """[(method, group or None)] of the arm names ``arms`` (default: every arm but :data:`COSTLY`),
    in record order."""
    every = [("vqpipe", None), ("unrotated", None)] + [(f"affine-g{g}", g) for g in affine_groups] + \
        [(m, None) for m in COMPETITORS]
    unknown = sorted(set(arms or ()) - {m for m, _ in every})
    if unknown:
        raise ValueError(f"unknown arms {unknown}; choose from {', '.join(m for m, _ in every)}")
    return [(m, g) for m, g in every if (m in arms if arms else m not in COSTLY)]


def quality(path, bits_list, n_windows=20, length=512, seed=0, rotation="auto", quantized=None,
            affine_groups=AFFINE_GROUPS, prompts=PROMPTS, gen_tokens=32, progress=print, arms=None,
            shard=(0, 1), texts=TEXTS, options=None):
    """(records, source record, generations). ``quantized``: {(bits, rotation): artifact dir}.

    ``arms``: the arm names to run (default all), to split one measurement over processes.
    ``shard`` (i, n): only the i-th of n slices of the windows (:func:`merge_shards` joins them;
    generations are shard 0's). Every record keeps its per-window values in ``per_window``.
    ``texts``: the evaluation texts; the first is the records' top level, every one is in ``texts``.
    ``options``: the competitor arms' settings (:func:`arm_options`).
    """
    arms = check_arms(arms, affine_groups)
    texts = check_texts(texts)
    source, tok = load_source(path)
    index = shard_windows(n_windows, shard)
    prompts = prompts if shard[0] == 0 else ()
    tmp = tempfile.TemporaryDirectory(prefix="vqpipe-quality-")
    evals, per_text = {}, {}
    for corpus in texts:
        every = text.eval_windows(tok, n_windows, length, corpus=corpus)  # tokenizes the whole text: once
        windows = [every[i] for i in index]
        Path(tmp.name, corpus).mkdir()
        refs, nlls = source_references(source, windows, f"{tmp.name}/{corpus}")
        evals[corpus] = (refs, windows)
        per_text[corpus] = source_record(path, source, nlls, index, length)
    src = with_texts(per_text, texts)
    progress(f"source perplexity {src['ppl']['median']:.2f} (median of {n_windows} windows x {length})")
    gens = {"prompts": list(prompts), "max_tokens": gen_tokens, "arms": []}
    if prompts:
        gens["arms"].append({"arm": "source", "texts": generations(source, tok, prompts, gen_tokens)})
    del source
    records, outs = measure_arms(path, lambda: (tok, evals), bits_list, arms, index, quantized or {},
                                 rotation, seed, prompts, gen_tokens, progress=progress, options=options)
    gens["arms"] += outs
    tmp.cleanup()
    return records, src, gens


def check_texts(texts):
    texts = list(texts or TEXTS)
    unknown = sorted(set(texts) - set(text.CORPORA))
    if unknown or len(set(texts)) != len(texts):
        raise ValueError(f"texts {texts}: choose distinct ones of {', '.join(text.CORPORA)}")
    return texts


def with_texts(per_text, texts):
    """One record from per-text records: the first text's at the top level (what the report and
    earlier artifacts read), and every text's metrics under ``texts``."""
    first = per_text[texts[0]]
    keep = ("kl", "kl_mean", "top1", "top1_mean", "ppl", "ppl_mean", "nll_mean", "per_window", "tokens")
    return {**first, "texts": {c: {k: r[k] for k in keep if k in r} for c, r in per_text.items()}}


def arm_options(calib_windows=64, calib_length=512, calib_seed=0, gptq_windows=None, awq_windows=None,
                dynamic_windows=None, dynamic_bpw=None, dwq_windows=None, dwq_lr=competitors.DWQ_LR):
    """The competitor arms' settings. Calibration: ``calib_windows`` x ``calib_length`` tokens of the
    calibration text at ``calib_seed`` (what the calibrate stage gives vqpipe); ``gptq_windows``,
    ``awq_windows``, ``dynamic_windows``, ``dwq_windows``: fewer of those windows, spread evenly over
    them, for a method (their cost on a CPU). ``dynamic_bpw``: dynamic_quant's budget (default: the
    vqpipe artifact's bits per weight over every matrix at that width). ``dwq_lr``: DWQ's Adam rate."""
    if not dwq_lr > 0:
        raise ValueError(f"dwq_lr must be positive, got {dwq_lr}")
    given = {"calib_windows": calib_windows, "gptq_windows": gptq_windows, "awq_windows": awq_windows,
             "dynamic_windows": dynamic_windows, "dwq_windows": dwq_windows}
    for k, v in given.items():
        if v is not None and v < 1:
            raise ValueError(f"{k} must be at least 1, got {v}")
    return {**given, "calib_length": calib_length, "calib_seed": calib_seed, "dynamic_bpw": dynamic_bpw,
            "dwq_lr": dwq_lr}


def calibration(tok, options, n=None):
    """The mlx-lm arms' calibration tokens: the calibrate stage's draw (``options``' calib_windows x
    calib_length at calib_seed); ``n`` fewer: rows spread evenly over that draw (over the book)."""
    t = text.calibration_tokens(tok, options["calib_windows"], options["calib_length"], options["calib_seed"])
    if n is None or n >= len(t):
        return t
    return t[mx.array(np.linspace(0, len(t) - 1, n).round().astype(np.int32))]


def measure_arms(path, data, bits_list, arms, index, quantized, rotation, seed, prompts, gen_tokens,
                 embeddings=None, progress=print, options=None):
    """(records, generation arms) of ``arms`` [(method, group)] at each of ``bits_list``; ``data()``
    gives (tokenizer, {text: (source references, windows)}), called once, when the first arm is
    measured (a job of skipped arms reads none of it). ``embeddings``: whether the affine and fp4
    arms quantize the embedding (default: as the vqpipe artifact of that width does); the mlx-lm
    methods treat it as the tool does and record how."""
    options = options or arm_options()
    records, texts, loaded = [], [], []

    def tokenizer():
        if not loaded:
            loaded.extend(data())
        return loaded[0]

    def calib(n):
        return lambda: calibration(tokenizer(), options, n)

    for bits in bits_list:
        emb = artifact_embeddings(quantized.get((bits, rotation)))
        if embeddings is not None and (bits, rotation) in quantized and embeddings != emb:
            raise ValueError(f"--{'' if embeddings else 'no-'}embeddings, but the {bits}-bit artifact "
                             f"{'keeps its embedding dense' if embeddings else 'quantizes its embedding'}")
        emb = emb if embeddings is None else embeddings
        for method, group in arms:
            t0 = time.perf_counter()
            info = None
            try:
                if method in COMPETITORS:
                    n = options.get(f"{method.removeprefix('mlx-')}_windows") or options["calib_windows"]
                    target = dynamic_budget(options["dynamic_bpw"], quantized.get((bits, rotation)), bits) \
                        if method == "mlx-dynamic" else None
                    model, werr, bpw, info = competitor_arm(path, method, bits, calib(n), emb, target,
                                                           options.get("dwq_lr", competitors.DWQ_LR))
                elif group is None:
                    rot = rotation if method == "vqpipe" else "none"
                    model, werr, bpw = vqpipe_arm(path, bits, rot, seed, quantized.get((bits, rot)), emb)
                else:
                    # the embedding as the vqpipe artifact has it: both quantized, or both dense
                    model, werr, bpw = affine_arm(path, bits, group, emb, dense=True)
            except SkippedArm as e:
                rec = {"bits": bits, "method": method, "skipped": str(e)}
                records.append({**rec, "group_size": group} if group else rec)
                progress(f"{bits}-bit {method}: skipped ({e})")
                continue
            build_s = time.perf_counter() - t0
            # and the plain mlx-lm modules again: fold.py's sign-folding wrappers (a loaded vqpipe
            # model's norms and MLPs) fall back to the plain forward once their layers are swapped,
            # but check their children on every call and run the MLP's SwiGLU outside cpu_eval's
            # numpy patch: 0.45 CPU-s more per SmolLM2 window than the affine arms
            unfold_model(dense_copy(model))
            tok = tokenizer()
            evals = loaded[1]
            rec = {"bits": bits, "method": method, "weight_rel_mse": werr, "bpw": bpw,
                   **with_texts(text_metrics(model, evals, index), list(evals))}
            if method in COMPETITORS:
                rec["settings"] = info
                rec["build_seconds"] = build_s
                if method in competitors.FP4:
                    rec["embeddings"] = emb
            elif group is None:
                rec["rotation"] = rot
                rec["artifact"] = str(quantized[(bits, rot)]) if (bits, rot) in quantized else None
                rec["embeddings"] = artifact_embeddings(quantized.get((bits, rot)))
            else:
                rec["group_size"] = group
                rec["embeddings"] = emb
            records.append(rec)
            if prompts:
                texts.append({"arm": f"{bits}-bit {method}", "texts": generations(model, tok, prompts, gen_tokens)})
            progress(arm_line(rec, build_s, time.perf_counter() - t0))
            del model
    return records, texts


def text_metrics(model, evals, index):
    """{text: KL, top-1 and perplexity of ``model`` against the source} over each text's windows."""
    per_text = {}
    for corpus, (refs, windows) in evals.items():
        lp, per = None, []
        for r, w in zip(refs, windows):
            lp = window_logprobs(model, w, out=lp)  # one buffer for every window
            per.append(window_metrics(r, lp, w))
        kls, top1s, nlls = zip(*per)
        per_text[corpus] = {"kl": summarize(kls), "kl_mean": sum(kls) / len(kls),
                            "top1": summarize(top1s), "top1_mean": sum(top1s) / len(top1s),
                            **ppl_record(nlls), "tokens": len(windows) * len(windows[0]),
                            "per_window": {"index": index, "kl": list(kls), "top1": list(top1s), "nll": list(nlls)}}
    return per_text


def arm_line(rec, build_s, all_s):
    """One progress line for an arm's record."""
    bpw = rec["bpw"]
    return (f"{rec['bits']}-bit {rec['method']:11s} bpw {bpw['bpw']:.3f} (matrices {bpw['bpw_matrices']:.3f})  "
            f"ppl {rec['ppl']['median']:.2f}  KL {rec['kl']['median']:.4f}  top-1 {rec['top1']['median']:.3f}  "
            + "  ".join(f"{c}: KL {r['kl']['median']:.4f} ppl {r['ppl']['median']:.2f}"
                        for c, r in list(rec["texts"].items())[1:])
            + f"  [build {build_s:.1f}s, all {all_s:.1f}s]")


def dynamic_budget(dynamic_bpw, artifact, bits):
    """mlx-dynamic's bits-per-weight budget: ``dynamic_bpw`` if given, else what the vqpipe artifact
    of this width stores over every weight matrix."""
    if dynamic_bpw is not None:
        return dynamic_bpw
    if artifact is None:
        raise ValueError(f"mlx-dynamic at {bits} bits needs a budget: the vqpipe artifact of that width "
                         "(--quantized) or --dynamic-bpw")
    model, _ = load_quantized(artifact)
    return bits_per_weight(model)["bpw_matrices"]


# --- the source's side in its own job: one reference, every arm job reads it -------------------
# The pipeline runs the source once (--reference-out) and each arm in a job of its own
# (--reference): arms that need no quantize artifact (affine) start before quantization ends.

def write_reference(path, out, n_windows, length, prompts=PROMPTS, gen_tokens=32, progress=print, texts=TEXTS):
    """A directory with the source's side of every window of every text, in a folder per text
    (probabilities ref{i}.npy, float32, memory-mapped by the arm jobs; per-position entropy and
    argmax; the window tokens) and reference.json (the source record, its generations, the texts
    and settings)."""
    texts = check_texts(texts)
    source, tok = load_source(path)
    with atomic_dir(out) as tmp:
        per_text = {}
        for corpus in texts:
            windows = text.eval_windows(tok, n_windows, length, corpus=corpus)
            d = tmp / corpus
            d.mkdir()
            refs, nlls = source_references(source, windows, d)
            per_text[corpus] = source_record(path, source, nlls, list(range(n_windows)), length)
            np.save(d / "tokens.npy", np.stack([np.asarray(w) for w in windows]))
            np.save(d / "negent.npy", np.stack([r[1] for r in refs]))
            np.save(d / "argmax.npy", np.stack([r[2] for r in refs]))
        src = with_texts(per_text, texts)
        progress(f"source perplexity {src['ppl']['median']:.2f} (median of {n_windows} windows x {length})")
        gens = {"prompts": list(prompts), "max_tokens": gen_tokens,
                "arms": [{"arm": "source", "texts": generations(source, tok, prompts, gen_tokens)}] if prompts else []}
        write_json(tmp / "reference.json", {"windows": n_windows, "length": length, **provenances(texts),
                                            "source": src, "generations": gens})


def provenances(texts):
    """The artifact's ``text`` (the first text's provenance, the records' top level) and ``texts``."""
    return {"text": text.provenance(texts[0]), "texts": {c: text.provenance(c) for c in texts}}


def reference_doc(refdir, n_windows, length, texts=None):
    """reference.json of a --reference-out directory, checked against the settings of this run."""
    refdir = Path(refdir)
    if not (refdir / "reference.json").is_file():
        raise FileNotFoundError(f"{refdir}: not a bench-quality reference (no reference.json)")
    doc = json.loads((refdir / "reference.json").read_text())
    if (doc["windows"], doc["length"]) != (n_windows, length):
        raise ValueError(f"{refdir} holds {doc['windows']} windows x {doc['length']} tokens, not {n_windows} x {length}")
    if texts is not None and list(doc.get("texts") or {}) != check_texts(texts):
        raise ValueError(f"{refdir} holds the texts {list(doc.get('texts') or {})}, not {check_texts(texts)}")
    return doc


def read_reference(refdir, tok, n_windows, length):
    """(reference.json, {text: (refs as :func:`reference` returns them, windows)}) of a
    --reference-out directory, checked against the windows this run would evaluate."""
    refdir = Path(refdir)
    doc = reference_doc(refdir, n_windows, length)
    evals = {}
    for corpus in doc["texts"]:
        d = refdir / corpus
        windows = text.eval_windows(tok, n_windows, length, corpus=corpus)
        if not np.array_equal(np.load(d / "tokens.npy"), np.stack([np.asarray(w) for w in windows])):
            raise ValueError(f"{refdir}: its {corpus} windows are not this source's (another tokenizer or text)")
        negent, argmax = np.load(d / "negent.npy"), np.load(d / "argmax.npy")
        evals[corpus] = ([(str(d / f"ref{i}.npy"), negent[i], argmax[i]) for i in range(n_windows)], windows)
    return doc, evals


def arm_part(path, refdir, bits_list, n_windows=20, length=512, seed=0, rotation="auto", quantized=None,
             affine_groups=AFFINE_GROUPS, arms=None, embeddings=None, progress=print, texts=None, options=None):
    """(records, source record, generations, text provenances) of ``arms`` against the reference in
    ``refdir``; the prompts and texts are the reference's. :func:`merge_parts` joins the parts."""
    from mlx_lm.utils import load_tokenizer

    arms = check_arms(arms, affine_groups)
    doc = reference_doc(refdir, n_windows, length, texts)

    def data():
        tok = load_tokenizer(Path(path))
        return (tok, read_reference(refdir, tok, n_windows, length)[1])

    gens = doc["generations"]
    records, outs = measure_arms(path, data, bits_list, arms, list(range(n_windows)), quantized or {}, rotation,
                                 seed, gens["prompts"], gens["max_tokens"], embeddings, progress, options)
    return records, doc["source"], {**gens, "arms": gens["arms"] + outs}, {k: doc[k] for k in ("text", "texts")}


# --- the synthetic presets' own checks (tests/test_download.py) ---------------------------------


def load_fp32(path):
    return load_source(path)


def agreement(ref_lp, lp):
    """(mean KL(ref || q) over tokens, top-1 agreement) for one window."""
    ref_lp, lp = mx.array(ref_lp), mx.array(lp)
    kl = mx.mean(mx.sum(mx.exp(ref_lp) * (ref_lp - lp), axis=-1))
    top1 = mx.mean(mx.argmax(ref_lp, axis=-1) == mx.argmax(lp, axis=-1))
    mx.eval(kl, top1)
    return kl.item(), top1.item()


def quantize_method(path, method, bits, seed):
    """(model, weight rel. MSE) for 'rotated' (vqpipe, auto), 'unrotated' or 'affine' (group 64)."""
    if method == "affine":
        return affine_arm(path, bits, 64)[:2]
    return vqpipe_arm(path, bits, "auto" if method == "rotated" else "none", seed)[:2]


_CHILD = """
import json, resource, sys, time
from mlx_lm.utils import load
from vqpipe.quant.config import QuantizeConfig
from vqpipe.quant.quantize import quantize_model
model, _ = load(sys.argv[1], lazy=True)
t0 = time.perf_counter()
quantize_model(model, QuantizeConfig(int(sys.argv[2]), sys.argv[3], dtype="float32", threads=1, calib_text="none"))
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


def parse_shard(spec):
    if spec is None:
        return (0, 1)
    try:
        i, n = (int(x) for x in spec.split("/"))
    except ValueError:
        raise ValueError(f"--shard {spec!r}: expected I/N, e.g. 0/2") from None
    if not 0 <= i < n:
        raise ValueError(f"--shard {spec!r}: need 0 <= I < N")
    return (i, n)


def merge_shards(docs):
    """One bench-quality document from shard documents (``--shard``): per-window values joined in
    window order and summarised again, as one process over every window would have."""
    docs = sorted(docs, key=lambda d: d["shard"][0])
    n = docs[0]["shard"][1]
    if [d["shard"] for d in docs] != [[i, n] for i in range(n)]:
        raise ValueError(f"shards {[d['shard'] for d in docs]} are not 0..{n - 1} of {n}")
    for key in ("model", "windows", "length", "text", "texts"):
        if any(d.get(key) != docs[0].get(key) for d in docs):
            raise ValueError(f"shards disagree on {key!r}")
    if any(len(d["records"]) != len(docs[0]["records"]) for d in docs):
        raise ValueError("shards have different arms")

    def joined(recs):
        per = {k: [x for r in recs for x in r["per_window"][k]] for k in recs[0]["per_window"]}
        out = {**recs[0], "per_window": per, "tokens": sum(r["tokens"] for r in recs)}
        out.update(ppl_record(per["nll"]))
        for k in ("kl", "top1"):
            if k in per:
                out[k], out[f"{k}_mean"] = summarize(per[k]), sum(per[k]) / len(per[k])
        if "texts" in recs[0]:
            out["texts"] = {c: joined([r["texts"][c] for r in recs]) for c in recs[0]["texts"]}
        return out

    records = []
    for recs in zip(*(d["records"] for d in docs)):
        if len({(r["bits"], r["method"]) for r in recs}) != 1:
            raise ValueError("shards list their arms in different orders")
        records.append(recs[0] if "skipped" in recs[0] else joined(recs))
    out = {**docs[0], "source": joined([d["source"] for d in docs]), "records": records}
    out.pop("shard")
    return out


def refusal(method, bits):
    """Why the tool behind arm ``method`` refuses ``bits`` whatever the model (its own words), or None."""
    if method in COMPETITORS:
        try:
            competitors.check(method, bits)
        except competitors.Refused as e:
            return str(e)
    return None


def parse_expect(specs):
    """[(bits, arm)] of ``BITS:ARM`` strings (--expect)."""
    out = []
    for spec in specs or ():
        bits, sep, arm = spec.partition(":")
        if not sep or not bits.isdigit() or not arm:
            raise ValueError(f"--expect {spec!r}: want BITS:ARM, e.g. 4:affine-g64")
        out.append((int(bits), arm))
    return out


def merge_parts(docs, expect=None):
    """One bench-quality document from arm parts (``--reference``), in the order given: their
    records and generations concatenated after the one source record they share.

    ``expect``: every (bits, arm) the run asks for, in record order. An arm the pipeline did not
    schedule because its tool refuses that width for any model (MLX's fp4 modes at 2 and 3 bits)
    has no part: it is recorded as skipped with the tool's reason, asked here (:func:`refusal`);
    one with neither a part nor a refusal, or a part not expected, is an error."""
    first = docs[0]
    for d in docs[1:]:
        for key in ("model", "windows", "length", "text", "texts", "source"):
            if json.dumps(d.get(key), sort_keys=True) != json.dumps(first.get(key), sort_keys=True):
                raise ValueError(f"parts disagree on {key!r} (not made from one reference)")
        if {k: v for k, v in d["generations"].items() if k != "arms"} != \
                {k: v for k, v in first["generations"].items() if k != "arms"}:
            raise ValueError("parts disagree on the generation prompts")
    records = [r for d in docs for r in d["records"]]
    arms = [(r["bits"], r["method"]) for r in records]
    if len(set(arms)) != len(arms):
        raise ValueError(f"an arm is in several parts: {sorted(a for a in set(arms) if arms.count(a) > 1)}")
    emb = {}
    for r in records:  # affine arms were told what the vqpipe artifact of their width does
        if "embeddings" in r and emb.setdefault(r["bits"], r["embeddings"]) != r["embeddings"]:
            raise ValueError(f"{r['bits']}-bit arms disagree on whether the embedding is quantized")
    if expect is not None:
        records = _expected_order(records, expect)
    gens = [a for d in docs for a in d["generations"]["arms"] if a["arm"] != "source"]
    source = [a for a in first["generations"]["arms"] if a["arm"] == "source"]
    out = {**first, "records": records, "generations": {**first["generations"], "arms": source + gens}}
    out.pop("part")
    return out


def _expected_order(records, expect):
    """``records`` in the order of ``expect`` [(bits, arm)], the refused arms without a part added."""
    by = {(r["bits"], r["method"]): r for r in records}
    extra = sorted(set(by) - set(expect))
    if extra:
        raise ValueError(f"parts hold arms the run did not ask for: {extra}")
    out = []
    for bits, arm in expect:
        if (bits, arm) in by:
            out.append(by[(bits, arm)])
            continue
        reason = refusal(arm, bits)
        if reason is None:
            raise ValueError(f"no part for the {bits}-bit {arm} arm, and its tool does not refuse {bits} bits")
        out.append({"bits": bits, "method": arm, "skipped": reason})
    return out


def merge(docs, expect=None):
    """:func:`merge_shards` or :func:`merge_parts`, by what the documents are."""
    kinds = {"shard" if "shard" in d else "part" if "part" in d else None for d in docs}
    if kinds == {"shard"}:
        if expect:
            raise ValueError("--expect goes with arm parts (--reference), not window shards")
        return merge_shards(docs)
    if kinds == {"part"}:
        return merge_parts(docs, expect)
    raise ValueError("--merge takes either window shards (--shard) or arm parts (--reference), not " +
                     ("both" if kinds >= {"shard", "part"} else "whole runs"))


def artifact_embeddings(path):
    """Whether a quantize artifact quantized its embedding table (False without an artifact:
    the in-process vqpipe arm keeps it dense)."""
    if path is None:
        return False
    return any(m.get("class") == "QuantizedEmbedding"
               for m in json.loads((Path(path) / "quantized.json").read_text())["layers"].values())


def artifacts(dirs):
    """{(bits, rotation): dir} from quantize-stage artifact directories."""
    out = {}
    for d in dirs or []:
        info = json.loads((Path(d) / "quantized.json").read_text())
        out[(int(info["bits"]), info["rotation"])] = Path(d)
    return out


def parser():
    p = argparse.ArgumentParser(prog="vqpipe bench-quality", description=__doc__.split("\n")[0])
    p.add_argument("--source", help="source model directory")
    p.add_argument("--model", default=None, help="model name recorded in the output")
    p.add_argument("--bits", type=int, nargs="+", default=[2, 3, 4])
    p.add_argument("--quantized", nargs="*", default=[], metavar="DIR",
                   help="quantize-stage artifacts to measure (else the vqpipe arms are quantized here)")
    p.add_argument("--rotation", default="auto", help="rotation of the vqpipe arm (default auto)")
    p.add_argument("--affine-groups", type=int, nargs="+", default=list(AFFINE_GROUPS))
    p.add_argument("--arms", nargs="+", default=None,
                   help=f"run only these arms (default: all but {' and '.join(COSTLY)}, which cost more on a CPU)")
    p.add_argument("--windows", type=int, default=20, help="distinct evaluation windows (>= 20)")
    p.add_argument("--length", type=int, default=512, help="tokens per window")
    p.add_argument("--gen-prompts", type=int, default=len(PROMPTS), help=f"fixed chat prompts generated (0-{len(PROMPTS)})")
    p.add_argument("--gen-tokens", type=int, default=32, help="greedy tokens per generation")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timing", nargs="*", default=None, metavar="ROTATION",
                   help="also time quantize_model for these rotations (e.g. auto qr)")
    p.add_argument("--timing-bits", type=int, default=4)
    p.add_argument("--timing-repeats", type=int, default=3)
    p.add_argument("--shard", default=None, metavar="I/N",
                   help="measure only the I-th of N slices of the windows (0-based); --merge joins them")
    p.add_argument("--merge", nargs="+", default=None, metavar="JSON",
                   help="join shard outputs (--shard) or arm parts (--reference) into --out instead of measuring")
    p.add_argument("--expect", nargs="+", default=None, metavar="BITS:ARM",
                   help="with --merge of arm parts: every arm the run asks for, in record order; one without a "
                   "part must be refused by its tool at that width (recorded as skipped, with the reason)")
    p.add_argument("--reference-out", default=None, metavar="DIR",
                   help="only run the source: write its side of every window to DIR, for --reference jobs")
    p.add_argument("--reference", default=None, metavar="DIR",
                   help="measure the arms against the source reference in DIR (from --reference-out)")
    p.add_argument("--embeddings", action=argparse.BooleanOptionalAction, default=None,
                   help="whether the affine arms quantize the embedding table (default: as the vqpipe "
                   "artifact of their width does; dense without one)")
    p.add_argument("--texts", nargs="+", default=list(TEXTS), choices=list(text.CORPORA),
                   help="evaluation texts (vqpipe/text.py); the first is the records' top level")
    p.add_argument("--calib-windows", type=int, default=64,
                   help="calibration windows of the mlx-lm methods (the calibrate stage's, by default)")
    p.add_argument("--calib-length", type=int, default=512, help="tokens per calibration window")
    p.add_argument("--calib-seed", type=int, default=0)
    p.add_argument("--gptq-windows", type=int, default=None,
                   help="calibration windows for mlx-gptq, spread over --calib-windows (default all)")
    p.add_argument("--awq-windows", type=int, default=None,
                   help="calibration windows for mlx-awq, spread over --calib-windows (default all)")
    p.add_argument("--dynamic-windows", type=int, default=None,
                   help="calibration windows for mlx-dynamic's sensitivities, spread over --calib-windows (default all)")
    p.add_argument("--dynamic-bpw", type=float, default=None,
                   help="mlx-dynamic's budget (default: the vqpipe artifact's bits per weight over every matrix)")
    p.add_argument("--dwq-windows", type=int, default=None,
                   help="calibration windows for mlx-dwq (4 held out for its validation loss), spread over "
                   "--calib-windows (default all)")
    p.add_argument("--dwq-lr", type=float, default=competitors.DWQ_LR, help="mlx-dwq's Adam learning rate")
    p.add_argument("--out", default=None, help="output JSON (required unless --reference-out)")
    return p


def main(argv=None):
    args = parser().parse_args(argv)
    try:
        if args.out is None and args.reference_out is None:
            raise ValueError("--out is required (unless --reference-out)")
        if args.merge:
            record.write(args.out, "bench-quality", merge([record.read(f) for f in args.merge], parse_expect(args.expect)
                                                          if args.expect else None),
                         inputs={"parts": args.merge})
            return 0
        if not args.source:
            raise ValueError("--source is required (unless --merge)")
        prompts = PROMPTS[: max(0, args.gen_prompts)]
        if args.reference_out:
            write_reference(args.source, args.reference_out, args.windows, args.length, prompts, args.gen_tokens,
                            texts=args.texts)
            return 0
        options = arm_options(args.calib_windows, args.calib_length, args.calib_seed, args.gptq_windows,
                              args.awq_windows, args.dynamic_windows, args.dynamic_bpw, args.dwq_windows,
                              args.dwq_lr)
        shard = parse_shard(args.shard)
        if args.reference:
            if args.shard:
                raise ValueError("--shard and --reference: a reference covers every window; choose one")
            records, src, gens, provenance = arm_part(
                args.source, args.reference, args.bits, args.windows, args.length, args.seed, args.rotation,
                artifacts(args.quantized), args.affine_groups, args.arms, args.embeddings, texts=args.texts,
                options=options)
        else:
            records, src, gens = quality(args.source, args.bits, args.windows, args.length, args.seed, args.rotation,
                                         artifacts(args.quantized), args.affine_groups, prompts, args.gen_tokens,
                                         arms=args.arms, shard=shard, texts=args.texts, options=options)
            provenance = provenances(check_texts(args.texts))
        result = {"kind": "bench-quality", "model": args.model or Path(args.source).name,
                  "environment": environment(), **provenance,
                  "windows": args.windows, "length": args.length,
                  "source": src, "records": records, "generations": gens}
        if args.shard:
            result["shard"] = list(shard)
        if args.reference:
            result["part"] = {"bits": args.bits, "arms": [m for m, _ in check_arms(args.arms, args.affine_groups)]}
        if args.timing:
            result["timing"] = timing(args.source, args.timing_bits, args.timing, args.timing_repeats)
    except (ValueError, FileNotFoundError) as e:
        print(f"vqpipe bench-quality: error: {e}", file=sys.stderr)
        return 2
    record.write(args.out, "bench-quality", result, inputs={"source": args.source, "quantized": args.quantized})
    return 0
