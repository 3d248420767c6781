"""Calibrated quantization: GPTQ with input second moments collected block by block.

The model runs on calibration tokens one transformer block at a time. For block l we record
H = X^T X for the input X of every linear layer of the block (the block running in full precision
on the output of the already quantized blocks 0..l-1), quantize the block's linears with their H
(vqpipe/codec/gptq.py), and run the quantized block to get block l+1's input. Later blocks therefore see
the earlier blocks' quantization error, as in GPTQ. Linears reading the same activation (q/k/v,
gate/up) share one H; layers outside the blocks get theirs from the same pass: an lm_head reads
the final norm, and so does a tied embedding table (it is the head), which is quantized last with
that H; an untied embedding (a lookup only) is quantized data-free.

Needs an mlx-lm decoder: ``model.model`` with ``embed_tokens``, ``layers`` and ``norm``. What enters
each block comes from the decoder itself (:func:`decoder_inputs`): it runs once over the tokens
with its blocks standing aside, so block 0's hidden state has whatever the model does to the
embedding (Gemma's sqrt(hidden) scale) and each block gets the mask the model builds for it (causal,
or a sliding window's where the window is shorter than the calibration windows).
"""

import itertools
import json
import time
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_unflatten

from .. import text as corpus
from ..codec.gptq import Rotated
from . import selfgen
from .cpu_eval import numpy_exponentials

BATCH_TOKENS = 4096  # tokens per forward batch: bounds the activations and attention scores


class _Recorder(nn.Module):
    """Stands in for a linear during a calibration pass: adds x^T x to its H, then runs it."""

    def __init__(self, inner, name, record):
        super().__init__()
        self.inner = inner
        self._name = name
        self._record = record

    def __call__(self, x):
        self._record(self._name, x)
        return self.inner(x)


def block_forward(layer, calls):
    """``run(x)``: the block on x, its attention and SwiGLU exponentials in numpy while the graph
    is built (vqpipe/quant/cpu_eval.py; MLX's CPU exp costs ~15 ns an element, numpy's ~1, and causal
    attention skips the masked half): SmolLM2's moments of 8 x 512 tokens, 32 -> 19 CPU-s, the
    moments within 6e-7 relative of MLX's forward. ``calls``: per batch, in order, the other
    arguments (args, kwargs) the decoder passes this block (:func:`decoder_inputs`); ``run`` is
    called once per batch in the same order (and again from the first for another pass)."""
    order = itertools.cycle(calls)

    def run(x):
        args, kwargs = next(order)
        with numpy_exponentials():
            return layer(x, *args, **kwargs)

    return run


class _Standin:
    """Stands in for a decoder block while the decoder runs: records the hidden state and the
    other arguments it is given (the mask the model builds for this block, cache=None) and returns
    the hidden state unchanged. Attributes are the block's (a model may read them)."""

    def __init__(self, block, seen):
        self.block, self.seen = block, seen

    def __getattr__(self, name):
        return getattr(self.block, name)

    def __call__(self, x, *args, **kwargs):
        self.seen.append((x, args, kwargs))
        return x


def decoder_inputs(model, batches):
    """(hidden states entering block 0, one per batch; per block, the [(args, kwargs)] the decoder
    passes it besides the hidden state, one per batch): the decoder runs on each token batch with
    every block replaced by a :class:`_Standin` (an embedding lookup and the masks: no block runs)."""
    inner = decoder(model)
    blocks = inner.layers
    seen = [[] for _ in blocks]
    inner.layers = [_Standin(b, s) for b, s in zip(blocks, seen)]
    try:
        for b in batches:
            inner(b)
    finally:
        inner.layers = blocks
    if not blocks or any(len(s) != len(batches) for s in seen):
        raise ValueError(f"calibration: {type(inner).__name__} did not call each of its {len(blocks)} blocks once "
                         "per forward; its blocks' inputs cannot be recorded")
    first = [x for x, _, _ in seen[0]]
    return first, [[(args, kwargs) for _, args, kwargs in s] for s in seen]


def decoder(model, purpose="calibration"):
    """``model.model`` of an mlx-lm decoder; ValueError naming ``purpose`` for anything else."""
    inner = getattr(model, "model", None)
    if inner is None or not all(hasattr(inner, a) for a in ("embed_tokens", "layers", "norm")):
        raise ValueError(f"{purpose} needs an mlx-lm decoder (model.model with embed_tokens, layers, norm); "
                         f"{type(model).__name__} has none")
    return inner


def _set(model, name, module):
    model.update_modules(tree_unflatten([(name, module)]))


def _batches(x):
    per = max(1, BATCH_TOKENS // x.shape[1])
    return [x[i : i + per] for i in range(0, x.shape[0], per)]


def collect(model, names, run, inputs, rotation=None):
    """({name: (H key, H)}, outputs) for the linears ``names``: ``run(batch)`` is called on each
    input batch with the linears replaced by recorders; outputs are what it returned. Linears fed
    the same array share the H key.

    ``rotation(name, dim)`` (optional) gives the rotation a linear is quantized in; its H is then
    R X^T X R^T, summed from the rotated activations X R^T, and comes as gptq.Rotated. That is
    cheaper than rotating a d x d H on both sides afterwards (a 4864-wide input of 1,024 tokens:
    1.30 -> 0.33 CPU-s, moments included; docs/gptq.md). Linears sharing an input share its
    rotation (vqpipe/layers/fused.py: one seed per input), which gptq.rotate_hessian checks.
    """
    modules = dict(model.named_modules())
    sums, owner, rotations = {}, {}, {}
    seen = {}

    def record(name, x):
        # x is held with its key: a freed array's id is reused by a later one (without the
        # reference, gate/up found o_proj's freed input's id and took its moments).
        key, _ = seen.get(id(x), (None, None))
        if key is None:
            key = owner.get(name, name)
            seen[id(x)] = (key, x)
            flat = x.reshape(-1, x.shape[-1]).astype(mx.float32)
            if rotation is not None:
                if key not in rotations:
                    rotations[key] = rotation(name, flat.shape[-1])
                flat = rotations[key].apply(flat)
            prod = gram(flat)
            if key in sums:
                sums[key] += prod
            else:
                sums[key] = prod
        owner.setdefault(name, key)

    for name in names:
        _set(model, name, _Recorder(modules[name], name, record))
    outs = []
    try:
        for batch in inputs:
            seen.clear()
            outs.append(run(batch))
            mx.eval(outs[-1])
    finally:
        for name in names:
            _set(model, name, modules[name])
    if rotation is None:
        hs = {key: mx.array(s) for key, s in sums.items()}
    else:  # kept in numpy: the factorisation reads it there (no 95 MB copy per 4864-wide input)
        hs = {key: Rotated(s, rotations[key]) for key, s in sums.items()}
    return {name: (owner[name], hs[owner[name]]) for name in names if name in owner}, outs


def gram(flat):
    """flat^T flat (float32 numpy, exactly symmetric) of a [tokens, d] mx array. numpy runs
    ``a.T @ a`` on one buffer as a symmetric rank-k update (BLAS syrk): half the flops of MLX's
    general matmul, which computed both triangles (4864 wide, 1,024 tokens: 0.55 -> 0.31 CPU-s;
    1536 wide, 4,096 tokens: 0.20 -> 0.11). The sums differ from the matmul's in rounding only.
    np.asarray reads the MLX buffer in place (no copy: ~26 ms saved per 4096 x 1536 in a loop of
    its own; a whole calibrate run of 8 x 512 tokens: 24.0 with the copy, 24.9 without, n = 2: noise)."""
    import numpy as np

    a = np.asarray(flat.astype(mx.float32))
    return a.T @ a


def quantize_calibrated(model, tokens, quantize_one, targets, progress=None, sequential=True, rotation=None):
    """Quantize ``targets`` [(name, kind)] of ``model`` in place with calibration ``tokens`` [n, len].

    ``quantize_one(name, kind, hessian)`` replaces one layer and returns its record (the caller's
    per-layer logic: rotation, seed, bits, group size). Returns the records in target order.
    ``sequential`` false: every H comes from the full-precision model (block l's input is the
    full-precision output of block l - 1), so H depends neither on the bit width nor on the
    rotation, and one forward pass per block is saved. ``rotation(name, dim)``: the rotation
    quantize_one will give a linear; its moments are then summed in that basis (see collect).
    """
    inner = decoder(model)
    kinds = dict(targets)
    records = {}
    prefix = {id(m): n for n, m in model.named_modules()}
    head = prefix[id(inner.embed_tokens)] if tied_head(model) else None
    for name, kind in targets:  # embeddings first: the calibration inputs come from the stored table
        if kind != "linear" and not (name == head and kind == "embedding"):
            records[name] = quantize_one(name, kind, None)
    block_names = [prefix[id(layer)] for layer in inner.layers]
    # float32 activations: the blocks then compute in float32 whatever the stored dtype (a bf16
    # matmul on the CPU is several times slower than a float32 one, and less accurate)
    h, calls = decoder_inputs(model, _batches(tokens))
    h = [x.astype(mx.float32) for x in h]
    mx.eval(h)
    pending = []  # (name, H key, complete) of the block before

    def complete(jobs):
        for name, key, done in jobs:
            records[name] = done()
            if key is not None:
                records[name]["hessian"] = key

    for i, (layer, bname) in enumerate(zip(inner.layers, block_names)):
        t0 = time.perf_counter()
        names = [n for n in kinds if kinds[n] == "linear" and n.startswith(bname + ".")]
        stats, outs = collect(model, names, block_forward(layer, calls[i]), h, rotation)
        jobs = [(name, stats[name][0], quantize_one(name, "linear", stats[name][1], defer=True)) for name in names]
        # Block i's numpy work (vqpipe/parallel.py) runs while block i + 1's forward and factors
        # are computed here; block i - 1's is waited for now, so two blocks at most are in flight.
        complete(pending)
        pending = jobs
        if sequential:  # the next block's input from the quantized block
            complete(pending)
            pending = []
            run = block_forward(inner.layers[i], calls[i])
            outs = [run(x) for x in h]
            mx.eval(outs)
        h = outs
        if progress:
            progress(f"[block {i + 1}/{len(inner.layers)}] {len(names)} layers {time.perf_counter() - t0:.2f}s")
    rest = [n for n in kinds if n not in records and n not in {name for name, _, _ in pending}]
    normed = head_inputs(model, [inner.norm(x) for x in h]) if rest else []
    for name in rest:
        # An lm_head, untied or tied (the embedding table itself), reads the final norm's output;
        # anything else goes data-free. The tied table is quantized last: until then every block's
        # calibration input came from the dense table.
        reads_norm = name.split(".")[-1] == "lm_head" or name == head
        pending.append((name, "final norm" if reads_norm else None,
                        quantize_one(name, kinds[name], moments(normed) if reads_norm else None, defer=True)))
        complete(pending[:-1])
        pending = pending[-1:]
    complete(pending)
    return [records[n] for n, _ in targets if n in records]


def tied_head(model):
    """True when the output head is the embedding table (no lm_head module): mlx-lm's tied models
    call ``embed_tokens.as_linear`` on the final norm's output."""
    if any(n.split(".")[-1] == "lm_head" for n, _ in model.named_modules()):
        return False
    return getattr(getattr(model, "args", None), "tie_word_embeddings", True) is not False


def head_inputs(model, ys):
    """What the head reads of the final norm's outputs ``ys``: themselves, or a residual-rotated
    tied head's map of them (vqpipe/quant/residual_rotation.py ``Head``; only a tied table carries one)."""
    head = getattr(decoder(model).embed_tokens, "head", None)
    return ys if head is None else [head(y) for y in ys]


def moments(xs):
    """sum of x^T x over a list of [..., d] arrays (float32 mx array; gram's syrk)."""
    total = None
    for x in xs:
        prod = gram(x.reshape(-1, x.shape[-1]).astype(mx.float32))
        if total is None:
            total = prod
        else:
            total += prod
    return mx.array(total)


HEAD = "final norm"


def full_precision_moments(model, tokens, progress=None):
    """({name: key}, {key: H}) for every nn.Linear of ``model``'s blocks and its head (an
    lm_head, or the embedding table when it is tied), from one pass of the full-precision model."""
    import mlx.nn as nn

    inner = decoder(model)
    prefix = {id(m): n for n, m in model.named_modules()}
    linears = [n for n, m in model.named_modules() if isinstance(m, (nn.Linear, nn.QuantizedLinear))]
    names, sums = {}, {}
    h, calls = decoder_inputs(model, _batches(tokens))
    h = [x.astype(mx.float32) for x in h]
    mx.eval(h)
    for i, layer in enumerate(inner.layers):
        t0 = time.perf_counter()
        block = prefix[id(layer)] + "."
        stats, h = collect(model, [n for n in linears if n.startswith(block)], block_forward(layer, calls[i]), h)
        for name, (key, hess) in stats.items():
            names[name], sums[key] = key, hess
        if progress:
            progress(f"[block {i + 1}/{len(inner.layers)}] {len(stats)} layers {time.perf_counter() - t0:.2f}s")
    heads = [n for n in linears if n.split(".")[-1] == "lm_head"]
    if tied_head(model):
        heads.append(prefix[id(inner.embed_tokens)])
    if heads:
        sums[HEAD] = moments(head_inputs(model, [inner.norm(x) for x in h]))
        mx.eval(sums[HEAD])
        names.update({n: HEAD for n in heads})
    return names, sums


CALIBRATION_TEXTS = ("none", "text", "self")


def auto_calibration(source):
    """The recipe's calibration text for a download-stage ``source``: ``text``, or ``none`` for a
    synthetic model (random weights: no text says what they compute; as the config's ``auto``)."""
    path = Path(source) / "vqpipe-source.json"
    spec = json.loads(path.read_text()).get("source", "") if path.is_file() else ""
    return "none" if spec.startswith("synth:") else "text"


def calibration_tokens(tokenizer, text="none", windows=64, length=512, seed=0, model=None):
    """(tokens [windows, length] or None, provenance dict or None) for a calibration spec.

    ``text``: ``none`` (data-free quantization), ``text`` (the calibration split of the real
    English text in vqpipe/text.py, disjoint from the evaluation split) or ``self`` (text the
    source ``model`` writes itself from a few seed requests, vqpipe/quant/selfgen.py).
    """
    if text not in CALIBRATION_TEXTS:
        raise ValueError(f"unknown calibration text {text!r}; choose one of {', '.join(CALIBRATION_TEXTS)}")
    if text == "none":
        return None, None
    if windows < 1 or length < 2:
        raise ValueError(f"calibration needs at least 1 window of 2 tokens, got {windows} x {length}")
    spec = {"text": text, "windows": windows, "length": length, "seed": seed}
    if text == "self":
        if model is None:
            raise ValueError("self-generated calibration needs the source model")
        return selfgen.self_tokens(model, tokenizer, windows, length, seed), {**spec, "provenance": selfgen.provenance(tokenizer)}
    tokens = corpus.calibration_tokens(tokenizer, windows, length, seed)
    return tokens, {**spec, "provenance": corpus.provenance()}
