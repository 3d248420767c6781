"""The automatic recipe's bit allocation: per-layer widths chosen to a bits-per-weight budget.

Every quantized matrix starts at the model's width and may get one or two bits more. What a bit
buys is predicted from calibration data only, no quantization run:

* the loss's sensitivity to a layer's output: g_o = mean over calibration tokens of
  (dL/dy_o)^2, L the next-token NLL (the diagonal empirical Fisher of the output, one backward
  pass per window: :func:`output_fisher`); for an embedding's lookups, the same of its output
  times its rows' squared norms;
* the layer's output error at width w: with LDL pivots d_k of the (damped, rotated) input moments
  H = (I + N) D (I + N)^T, GPTQ's error feedback leaves tr(E H E^T) = sum_k d_k |r_k|^2 (r_k the
  rounding residuals of column k), and a residual of a unit-variance entry has the codebook's
  mean squared error D_w (codebook.distortion). So row o's error is D_w |w_o|^2 / d * sum_k d_k.
  H sums x x^T over the calibration's T tokens, so that is T times one token's error; an
  embedding's lookup term (one token's) is therefore counted T times too (``moment_tokens``).

The predicted loss increase of layer l at width w is sum_o g_o * that; :func:`allocate` spends the
budget on the steps with the largest predicted gain per stored bit. The cost of a width is what
the layer stores (codes, scales, codebook, rotation state), the way bench-quality counts bits.
"""

import heapq
import json

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten, tree_unflatten

from ..codec.bitpack import words_per_row
from ..codec import trellis
from ..codec.codebook import LAYER_BITS, distortion
from ..layers.qlinear import dense_weight, trellis_fits
from ..codec.gptq import DAMP, rotate_hessian
from .calibrate import tied_head

STEPS = 2  # widths above the base a layer may get
FISHER_WINDOWS = 4  # calibration windows of the backward passes (the first 4 of the 64)
LOOKUP = "#lookup"  # suffix of an embedding's lookup sensitivity (beside a tied head's output one)
EXTRA = 0.5  # default budget over the base width: MLX affine g64's float16 scale and bias per 64


def default_budget(bits):
    """Bits per weight MLX affine quantization with groups of 64 stores at ``bits``."""
    return bits + EXTRA


def check_budget(budget, bits):
    """The budget in bits per weight: None (the default), 'auto' -> :func:`default_budget`; 'none' -> None."""
    if budget is None or budget == "auto":
        return default_budget(bits)
    if budget == "none":
        return None
    if isinstance(budget, bool) or not isinstance(budget, (int, float)) or not bits <= budget <= max(LAYER_BITS) + 1:
        raise ValueError(f"budget must be auto, none or bits per weight in [{bits}, {max(LAYER_BITS) + 1}], got {budget!r}")
    return float(budget)


class _Probe(nn.Module):
    """Stands in for a linear or embedding: adds a zero probe to its output (the gradient of the
    loss with respect to the probe is the one with respect to the output)."""

    def __init__(self, inner, name, probes):
        super().__init__()
        self.inner = inner
        self._name = name
        self._probes = probes

    def __call__(self, x):
        key = self._name + LOOKUP if isinstance(self.inner, (nn.Embedding, nn.QuantizedEmbedding)) else self._name
        y = self.inner(x).astype(mx.float32)  # float32 activations whatever the stored dtype
        return y + self._probes[key] if key in self._probes else y

    def as_linear(self, x):  # a tied head
        y = self.inner.as_linear(x)
        return y + self._probes[self._name] if self._name in self._probes else y


def output_fisher(model, tokens, names, progress=None, moment_tokens=1):
    """{name: float32 [out]} mean over predicted tokens of (dL/dy)^2 for the outputs of the layers
    ``names`` (linears and embeddings: a table's output as a tied head, and under name + LOOKUP its
    lookups' mean (dL/dh)^2 |e_token|^2 / d, a scalar, times ``moment_tokens``); L the summed
    next-token NLL of ``tokens`` [n, len], one window per backward pass. The model is unchanged.

    ``moment_tokens``: how many tokens the layers' input moments H sum over (the calibration's
    windows x length). :func:`plan` weighs an output's g by the pivots of that summed H, T times a
    token's error; the lookup term, a token's, is scaled by T to count the same way (without it the
    lookups of SmolLM2's tied table weighed 32,768 times too little, and the table stayed at the
    model's width)."""
    kept = tree_flatten(model.parameters())
    model.set_dtype(mx.float32)  # bf16 on the CPU is ~10x slower (the stored arrays come back after)
    modules = dict(model.named_modules())
    shapes = _output_shapes(model, names, tokens.shape[1] - 1)
    tables = {}
    probes = {}
    wrapped = {n: _Probe(modules[n], n, probes) for n in names}
    model.update_modules(tree_unflatten(list(wrapped.items())))
    sums = {}
    try:
        for i in range(tokens.shape[0]):
            x = tokens[i : i + 1]
            zeros = {k: mx.zeros(s, dtype=mx.float32) for k, s in shapes.items()}

            def loss(ps):
                probes.clear()
                probes.update(ps)
                logits = model(x[:, :-1]).astype(mx.float32)
                return nn.losses.cross_entropy(logits, x[:, 1:], reduction="sum")

            grads = mx.grad(loss)(zeros)
            probes.clear()
            for k, g in grads.items():
                if k.endswith(LOOKUP):  # (dL/dh_t)^2 summed over dims, times |e_{token_t}|^2 / d
                    name = k[: -len(LOOKUP)]
                    if name not in tables:
                        tables[name] = _dense_table(modules[name])
                    table = tables[name]
                    rows = table[x[0, :-1]]
                    s = mx.sum(mx.sum(g[0] * g[0], axis=-1) * mx.sum(rows * rows, axis=-1)) / table.shape[1]
                else:
                    s = mx.sum(g.reshape(-1, g.shape[-1]) ** 2, axis=0)
                mx.eval(s)
                sums[k] = sums.get(k, 0) + np.asarray(s, dtype=np.float64)
            if progress:
                progress(f"[fisher {i + 1}/{tokens.shape[0]}]")
    finally:
        model.update_modules(tree_unflatten([(n, modules[n]) for n in names]))
        model.load_weights(kept, strict=False)
    count = tokens.shape[0] * (tokens.shape[1] - 1)
    return {k: (v / count * (moment_tokens if k.endswith(LOOKUP) else 1)).astype(np.float32) for k, v in sums.items()}


def sensitive_layers(model):
    """Names of the layers :func:`output_fisher` measures: every linear and embedding."""
    kinds = (nn.Linear, nn.QuantizedLinear, nn.Embedding, nn.QuantizedEmbedding)
    return [n for n, m in model.named_modules() if isinstance(m, kinds)]


def _dense_table(module):
    if isinstance(module, nn.QuantizedEmbedding):
        return mx.dequantize(module.weight, module.scales, module.get("biases"), module.group_size,
                             module.bits).astype(mx.float32)
    return module.weight.astype(mx.float32)


def _output_shapes(model, names, n):
    """{probe key: output shape} for windows of ``n`` predicted tokens."""
    modules = dict(model.named_modules())
    head = tied_head(model)
    shapes = {}
    for name in names:
        m = modules[name]
        if isinstance(m, (nn.Embedding, nn.QuantizedEmbedding)):
            vocab, dim = _dense_table(m).shape
            shapes[name + LOOKUP] = (1, n, dim)
            if head:
                shapes[name] = (1, n, vocab)
        else:
            shapes[name] = (1, n, m.weight.shape[0])
    return shapes


def pivot_sum(h, rotation, damp):
    """sum_k d_k: the LDL pivots of ``rotation``'s R H R^T damped as gptq.ldl_factor damps it
    (GPTQ's column order: the factor of the reversed matrix)."""
    rev = np.array(rotate_hessian(h, rotation), dtype=np.float32)[::-1, ::-1].copy()
    diag = rev.diagonal().copy()
    dead = diag <= 0
    mean = float(np.mean(np.where(dead, 0, diag))) or 1.0
    np.fill_diagonal(rev, diag + dead + np.float32(damp * mean))
    # MLX's LAPACK (the OpenBLAS preload) on the CPU stream: several times faster than numpy's here
    low = mx.linalg.cholesky(mx.array(rev), stream=mx.cpu)
    return float(mx.sum(mx.diagonal(low).astype(mx.float32) ** 2).item())


TRELLIS_TABLE_BITS = (1 << trellis.L_DEFAULT) * 32  # the 2^L float32 state values, one blob per file


def stored_bits(out_features, in_features, width, group_size, rotation, codes="scalar"):
    """Bits a quantized layer of this shape stores at ``width``, as bench-quality counts them:
    packed codes, scales (float32 per row or float16 per group), codebook, rotation state. A trellis
    layer's codebook (the 2^L state values) is one blob for every trellis layer of a file: counted
    once per model (:func:`model_bits`), not here."""
    if codes == "trellis":
        state = sum(v.nbytes for v in rotation.to_state()[1].values()) * 8
        return out_features * in_features * width + out_features * 32 + state
    codes = out_features * words_per_row(in_features, width) * 32
    scales = out_features * 32 if group_size is None else out_features * (in_features // group_size) * 16
    state = sum(v.nbytes for v in rotation.to_state()[1].values()) * 8
    return codes + scales + (1 << width) * 32 + state


def layer_table(shape, width_range, group_size, rotation, sensitivity, codes="scalar"):
    """{width: (stored bits, predicted loss increase)} of one layer of ``shape`` [out, in]:
    ``sensitivity`` is the loss increase per unit of codebook distortion (sum over its outputs and
    lookups of g times the error variance of a unit-distortion codebook). ``codes`` "trellis": the
    trellis's distortion at the widths where the layer takes trellis codes."""
    out_features, d = shape

    def kind(w):
        return "trellis" if codes == "trellis" and trellis_fits(w, out_features, d, group_size) else "scalar"

    return {w: (stored_bits(out_features, d, w, group_size, rotation, kind(w)), distortion(w, d, kind(w)) * sensitivity)
            for w in width_range}


def widths(bits):
    """The widths a layer of a ``bits``-wide model may get."""
    return [w for w in LAYER_BITS if bits <= w <= bits + STEPS]


def allocate(tables, budget_bits):
    """({name: width}, bits spent): every layer at its table's smallest width, then the step up with
    the largest predicted gain per stored bit, one at a time, while the total fits in
    ``budget_bits``; a step that does not fit ends that layer's steps (a smaller one of another
    layer may still fit). Ties go by name: the result is deterministic. ``tables`` are
    {name: {width: (stored bits, predicted loss increase)}}."""
    choice = {n: min(t) for n, t in tables.items()}
    spent = sum(tables[n][w][0] for n, w in choice.items())
    heap = []

    def push(name):
        t = tables[name]
        up = [w for w in sorted(t) if w > choice[name]]
        if not up:
            return
        cost = t[up[0]][0] - t[choice[name]][0]
        gain = t[choice[name]][1] - t[up[0]][1]
        if gain > 0 and cost > 0:
            heapq.heappush(heap, (-gain / cost, name, up[0], cost))

    for name in sorted(tables):
        push(name)
    while heap:
        _, name, width, cost = heapq.heappop(heap)
        if spent + cost <= budget_bits:
            choice[name] = width
            spent += cost
            push(name)
    return choice, spent


def plan(model, bits, targets, moments, fisher, budget, rotation_of, group_size=None, damp=None, codes="scalar"):
    """({name: width}, tables, weights): the widths of ``targets`` [(name, kind)] of ``model`` (before
    quantization) within ``budget`` bits per weight over every quantized matrix. ``moments``
    {name: (key, H)}, ``fisher`` from :func:`output_fisher`, ``rotation_of(name, dim)`` the
    rotation quantize gives the layer, ``group_size`` and ``damp`` quantize's. Where a layer may
    take trellis codes, the budget keeps the trellis table's bits (one per model, :func:`model_bits`)."""
    modules = dict(model.named_modules())
    tables, spreads, weights, table_bits = {}, {}, 0, 0
    for name, kind in targets:
        if kind == "dense-embedding":
            continue
        weight = dense_weight(modules[name], mx.float32)
        out_features, d = weight.shape
        key, h = moments.get(name, (None, None))
        r = rotation_of(name, d)
        sens = 0.0
        if name in fisher:  # the output: sum_o g_o |w_o|^2 / d * sum_k d_k
            ident = (key, r.kind, r.dim, r.seed)
            if ident not in spreads:  # shared by siblings (q/k/v, gate/up): one factorisation
                spreads[ident] = pivot_sum(h, r, DAMP if damp is None else damp) if h is not None else 0.0
            rows = np.asarray(mx.sum(weight * weight, axis=1), dtype=np.float64)
            sens += float(np.dot(fisher[name].astype(np.float64), rows)) / d * spreads[ident]
        sens += float(fisher.get(name + LOOKUP, 0.0))
        gs = group_size if kind == "linear" or h is not None else None
        tables[name] = layer_table((out_features, d), widths(bits), gs, r, sens, codes)
        weights += out_features * d
        if codes == "trellis" and any(trellis_fits(w, out_features, d, gs) for w in widths(bits)):
            table_bits = TRELLIS_TABLE_BITS
    choice, _ = allocate(tables, budget * weights - table_bits)
    return choice, tables, weights


def stored_layers(model):
    """(name, meta, {array: bits}) of every vqpipe-quantized layer of ``model``: what a reservoir
    stores of it, the bias left out (bench-quality counts it as dense), a trellis table only at the
    first layer that uses it (one blob in a file, once per model)."""
    tables = set()
    for name, m in model.named_modules():
        if not hasattr(m, "to_state"):
            continue
        meta, arrays = m.to_state()
        bits = {k: v.nbytes * 8 for k, v in arrays.items() if k != "bias"}
        if "codes" in meta:
            table = json.dumps(meta["codes"], sort_keys=True)
            if table in tables:
                del bits["codebook"]
            tables.add(table)
        yield name, meta, bits


def model_bits(model):
    """(stored bits, weights) of every vqpipe-quantized layer of ``model``, as bench-quality's
    bits_per_weight counts them (:func:`stored_layers`)."""
    total = weights = 0
    for _, meta, bits in stored_layers(model):
        weights += meta["in_features"] * meta["out_features"]
        total += sum(bits.values())
    return total, weights
