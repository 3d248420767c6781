"""End-to-end tuning of a quantized model's row scales against its source (issue 34).

After quantization a layer computes y = s * (C[q] R x) + b: the codes C[q] were chosen layer by
layer, each to its own calibration objective. Tuning keeps every code and trains, for the model as
a whole, a factor g per output row of every quantized layer (stored as s * g: the same bits), to
minimise KL(source || quantized) of the next-token distribution on calibration windows, one window
per Adam step. It is the knob mlx-lm's DWQ turns for affine scales; QuIP# and QTIP tune more
(every unquantized parameter, layer by layer first) for their 2-bit models. Training the norms'
weights too did worse on held-out calibration windows (docs/quantize.md, "Tuning"). A few
calibration pieces the steps do not read, measured every few steps, decide which step's factors
are kept (none, if no step beat the untuned model) and when to stop.

For the duration the quantized layers are dense float32 weights (rebuilt once) and the rest of the
model is float32; afterwards the layers are the same QuantizedLinear objects with new scales and the
rest is back in its dtypes, unchanged. A tied embedding's factor scales its table's rows, so the
lookup and the head both see it.
"""

import copy
import time

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np
from mlx.utils import tree_flatten, tree_map, tree_unflatten

from ..layers.qlinear import QuantizedEmbedding, QuantizedLinear

LR = 1e-3
FINAL = 0.1  # the rate decays to FINAL x LR over the steps (a cosine): 3-bit KL 0.973x in 20/20 windows
STEPS = 32  # Adam steps ("auto") at 3 bits: 64 moved SmolLM2's held-out KL by 0.2 % (docs/tried.md)
LOW_STEPS = 64  # at 2 bits: SmolLM2's held-out KL still fell 4 % from step 32 to 64 (docs/quantize.md)
# At 4 bits and above "auto" does not tune: SmolLM2's held-out KL moved by -3 % and +0.04 % in the
# two runs measured, within what the four held-out pieces resolve (docs/quantize.md, "Tuning").
HELD = 4  # windows the steps do not read: the checks
CHECK = 8  # steps between two measurements of the held-out windows


class _Scaled(nn.Module):
    """A quantized layer's dense weight with a trainable factor per output row, 1 + step * d: d is
    trained from 0, ``step`` = 2^(2 - width), so Adam moves a row's factor by about as much as the
    layer's quantization step allows (at 4 bits a quarter of what it does at 2; one rate for all
    overshot the 3- and 4-bit models: docs/quantize.md, "Tuning")."""

    def __init__(self, layer):
        super().__init__()
        self.weight = layer.dequantized_weight(mx.float32)
        self.d = mx.zeros((layer.out_features,), dtype=mx.float32)
        self.step = 2.0 ** (2 - layer.bits)
        if "bias" in layer:
            self.bias = layer.bias.astype(mx.float32)

    def factor(self):
        return 1 + self.step * self.d

    def __call__(self, x):
        y = (x @ self.weight.T) * self.factor()
        return y + self.bias if "bias" in self else y


class _ScaledEmbedding(_Scaled):
    head = None  # a residual-rotated tied head reads head(x) (vqpipe/layers/head.py: plain state)

    def __init__(self, layer):
        super().__init__(layer)
        object.__setattr__(self, "head", layer.head)

    def __call__(self, ids):
        return self.weight[ids] * self.factor()[ids][..., None]

    def as_linear(self, x):
        return ((x if self.head is None else self.head(x)) @ self.weight.T) * self.factor()


def steps_for(steps, bits):
    """The Adam steps of a tuning at width ``bits``: ``steps`` as given, or for "auto" LOW_STEPS at
    2 bits, STEPS at 3 and none above."""
    if steps == "auto":
        return LOW_STEPS if bits <= 2 else STEPS if bits == 3 else 0
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 0:
        raise ValueError(f"tune_steps must be auto or an integer of at least 0, got {steps!r}")
    return steps


def teacher_of(model):
    """A float32 dense copy of ``model`` (affine layers dequantized) to tune against: call it before
    quantizing ``model`` in place."""
    from mlx_lm.utils import dequantize_model

    teacher = dequantize_model(copy.deepcopy(model))
    teacher.update(tree_map(lambda a: a.astype(mx.float32) if mx.issubdtype(a.dtype, mx.floating) else a,
                            teacher.parameters()))
    teacher.freeze()
    mx.eval(teacher.parameters())
    return teacher


def kl(model, x, teacher_logits):
    """Mean over positions of KL(teacher || model) of the next-token distribution (``teacher_logits``:
    logits or log-probabilities, the same distribution)."""
    return kl_to(model, x, *target(teacher_logits))


def target(logits):
    """(p, sum_v p log p per position) of the teacher's ``logits``, in numpy (MLX's CPU exp is many
    times slower than numpy's, and no gradient flows into the teacher)."""
    t = np.array(logits.astype(mx.float32), dtype=np.float32)
    t -= t.max(axis=-1, keepdims=True)
    p = np.exp(t)
    z = p.sum(axis=-1, keepdims=True, dtype=np.float64)
    p /= z.astype(np.float32)
    logp = t - np.log(z).astype(np.float32)
    return mx.array(p), mx.array(np.einsum("...v,...v->...", p, logp, dtype=np.float64).astype(np.float32))


def kl_to(model, x, p, negent):
    """KL(p || model(x)) per position, averaged: sum_v p log p - sum_v p log q."""
    lq = nn.log_softmax(model(x).astype(mx.float32), axis=-1)
    return mx.mean(negent - mx.sum(p * lq, axis=-1))


def windows(tokens, length=None):
    """``tokens`` [n, T] cut into windows of ``length`` (None: T) tokens [n * (T // length), length],
    the first piece of every window first (the calibration windows are in the text's order, so
    the steps spread over the whole text)."""
    n, T = tokens.shape
    if length is None or length >= T:
        return tokens
    k = T // length
    return tokens[:, : k * length].reshape(n, k, length).transpose(1, 0, 2).reshape(-1, length)


def tune(model, teacher, tokens, steps, lr=LR, length=None, check=CHECK, stop=True, progress=None):
    """Tune ``model``'s quantized layers' row scales in place (module docstring) for up to ``steps``
    Adam steps of one window each, the rate ``lr`` decaying to ``lr`` x FINAL by the last step
    (a cosine): ``tokens`` [n, T] cut into ``length``-token windows
    (:func:`windows`), as many as there are steps spread evenly over them (all of them, cycling,
    when there are more steps). Every ``check`` steps (None: only after the last) the held-out
    windows are measured; the factors of the best check are kept (none if no check beat the
    untuned model) and, with ``stop``, the run ends at the first check that is not better than the
    best so far. Returns the record of the run. ``teacher``: :func:`teacher_of` the source."""
    layers = {n: m for n, m in model.named_modules() if isinstance(m, QuantizedLinear)}
    if not layers:
        raise ValueError("tune: the model has no vqpipe quantized layers")
    if tokens.ndim != 2 or tokens.shape[0] < 1 or tokens.shape[1] < 2:
        raise ValueError(f"tune: tokens must be [windows, length >= 2], got shape {tokens.shape}")
    if length is not None and length < 2:
        raise ValueError(f"tune: windows of {length} tokens; at least 2")
    tokens = windows(tokens, length)
    n = tokens.shape[0]
    order = [(i * n) // steps for i in range(steps)] if steps <= n else [i % n for i in range(steps)]
    used = set(order)
    unused = [i for i in range(n) if i not in used]
    held = [unused[(j * len(unused)) // HELD] for j in range(min(HELD, len(unused)))]
    t0 = time.perf_counter()
    inside = tuple(n + "." for n in layers)
    rest = [(k, v) for k, v in tree_flatten(model.parameters())
            if not k.startswith(inside) and mx.issubdtype(v.dtype, mx.floating)]
    model.load_weights([(k, v.astype(mx.float32)) for k, v in rest], strict=False)
    scaled = {n: (_ScaledEmbedding if isinstance(m, QuantizedEmbedding) else _Scaled)(m) for n, m in layers.items()}
    model.update_modules(tree_unflatten(list(scaled.items())))
    was_training = model.training
    model.freeze()
    for m in scaled.values():
        m.unfreeze(keys=["d"], recurse=False)
    mx.eval(model.parameters())
    # windows the steps do not read: the checks
    targets = [(tokens[i][None], *target(teacher(tokens[i][None]))) for i in held]

    def held_kl():
        return sum(kl_to(model, *t).item() for t in targets) / len(targets) if targets else None

    before = held_kl()
    checks = [[0, before]]  # lists: the record goes to JSON as it is
    best = (0, before, {n: m.d for n, m in scaled.items()})  # arrays are immutable: a snapshot

    step_fn = nn.value_and_grad(model, kl_to)
    opt = optim.Adam(learning_rate=optim.cosine_decay(lr, steps, lr * FINAL))
    losses = []
    for step in range(1, steps + 1):
        x = tokens[order[step - 1]][None]
        loss, grads = step_fn(model, x, *target(teacher(x)))
        opt.update(model, grads)
        mx.eval(model.trainable_parameters(), opt.state, loss)
        losses.append(loss.item())
        if progress and (step % 8 == 1 or step == steps):
            progress(f"tune step {step}/{steps}: KL {losses[-1]:.4f} ({time.perf_counter() - t0:.0f}s)")
        if step == steps or (check and step % check == 0):
            h = held_kl()
            checks.append([step, h])
            if h is None or h < best[1]:
                best = (step, h, {n: m.d for n, m in scaled.items()})
            elif stop:
                break

    kept = best[0] > 0
    if progress and before is not None:
        progress(f"tune: held-out KL {before:.4f} -> {best[1]:.4f} at step {best[0]} of {len(losses)}"
                 + ("" if kept else " (not kept)"))
    # back to the quantized layers, their scales times the best check's factors; the rest in its dtypes again
    model.update_modules(tree_unflatten(list(layers.items())))
    for n in scaled:
        scaled[n].d = best[2][n]
    for n, m in layers.items() if kept else ():
        g = scaled[n].factor()
        s = m.scales.astype(mx.float32)
        m.scales = (s * (g if s.ndim == 1 else g[:, None])).astype(m.scales.dtype)
    model.load_weights(rest, strict=False)
    model.unfreeze()
    for m in layers.values():  # as QuantizedLinear makes them
        m.freeze()
    model.train(was_training)
    mx.eval(model.parameters())
    gs = mx.concatenate([scaled[n].factor() for n in layers])
    head = min(4, len(losses))
    return {"steps": steps, "steps_run": len(losses), "best_step": best[0], "lr": lr, "lr_final": lr * FINAL,
            "windows": len(used), "length": int(tokens.shape[1]), "layers": len(layers),
            "held_out": len(held), "held_kl_before": before, "held_kl_after": best[1], "kept": kept,
            "checks": checks,
            "kl_first": sum(losses[:head]) / max(head, 1), "kl_last": sum(losses[-head:]) / max(head, 1),
            "factor_min": gs.min().item(), "factor_max": gs.max().item(), "seconds": time.perf_counter() - t0}
