"""End-to-end tuning of a quantized model's row scales against its source (issue 34).

After quantization a layer computes y = s * (C[q] R x) + b: the codes C[q] were chosen layer by
layer, each to its own calibration objective. Tuning keeps every code and trains, for the model as
a whole, a factor g per output row of every quantized layer (stored as s * g: the same bits), to
minimise KL(source || quantized) of the next-token distribution on calibration windows, one window
per Adam step. It is the knob mlx-lm's DWQ turns for affine scales; QuIP# and QTIP tune more
(every unquantized parameter, layer by layer first) for their 2-bit models. Training the norms'
weights too did worse on held-out calibration windows (docs/quantize.md, "Tuning").

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
from mlx.utils import tree_flatten, tree_map, tree_unflatten

from ..layers.qlinear import QuantizedEmbedding, QuantizedLinear

LR = 1e-3


class _Scaled(nn.Module):
    """A quantized layer's dense weight with a trainable factor per output row."""

    def __init__(self, layer):
        super().__init__()
        self.weight = layer.dequantized_weight(mx.float32)
        self.g = mx.ones((layer.out_features,), dtype=mx.float32)
        if "bias" in layer:
            self.bias = layer.bias.astype(mx.float32)

    def __call__(self, x):
        y = (x @ self.weight.T) * self.g
        return y + self.bias if "bias" in self else y


class _ScaledEmbedding(_Scaled):
    def __call__(self, ids):
        return self.weight[ids] * self.g[ids][..., None]

    def as_linear(self, x):
        return (x @ self.weight.T) * self.g


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


def kl(model, x, teacher_logprobs):
    """Mean over positions of KL(teacher || model) of the next-token distribution."""
    lp = nn.log_softmax(model(x).astype(mx.float32), axis=-1)
    return mx.mean(mx.sum(mx.exp(teacher_logprobs) * (teacher_logprobs - lp), axis=-1))


def tune(model, teacher, tokens, steps, lr=LR, progress=None):
    """Tune ``model``'s quantized layers' row scales in place (module docstring) for
    ``steps`` Adam steps of one window of ``tokens`` [n, length] each, in order, cycling; returns
    the record of the run. ``teacher``: :func:`teacher_of` the source."""
    layers = {n: m for n, m in model.named_modules() if isinstance(m, QuantizedLinear)}
    if not layers:
        raise ValueError("tune: the model has no vqpipe quantized layers")
    if any(getattr(m, "head", None) is not None for m in layers.values()):
        raise ValueError("tune: a residual-rotated tied head is not supported; quantize with tune_steps=0 "
                         "or without the residual rotation")
    if tokens.ndim != 2 or tokens.shape[0] < 1 or tokens.shape[1] < 2:
        raise ValueError(f"tune: tokens must be [windows, length >= 2], got shape {tokens.shape}")
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
        m.unfreeze(keys=["g"], recurse=False)
    mx.eval(model.parameters())

    step_fn = nn.value_and_grad(model, kl)
    opt = optim.Adam(learning_rate=lr)
    losses = []
    for step in range(steps):
        x = tokens[step % tokens.shape[0]][None]
        target = nn.log_softmax(teacher(x).astype(mx.float32), axis=-1)
        loss, grads = step_fn(model, x, target)
        opt.update(model, grads)
        mx.eval(model.trainable_parameters(), opt.state, loss)
        losses.append(loss.item())
        if progress and (step % 8 == 0 or step == steps - 1):
            progress(f"tune step {step + 1}/{steps}: KL {losses[-1]:.4f} ({time.perf_counter() - t0:.0f}s)")

    # back to the quantized layers, their scales times g; the rest in its dtypes again
    model.update_modules(tree_unflatten(list(layers.items())))
    for n, m in layers.items():
        g = scaled[n].g
        s = m.scales.astype(mx.float32)
        m.scales = (s * (g if s.ndim == 1 else g[:, None])).astype(m.scales.dtype)
    model.load_weights(rest, strict=False)
    model.unfreeze()
    for m in layers.values():  # as QuantizedLinear makes them
        m.freeze()
    model.train(was_training)
    mx.eval(model.parameters())
    gs = mx.concatenate([scaled[n].g for n in layers])
    head = min(4, len(losses))
    return {"steps": steps, "lr": lr, "windows": int(tokens.shape[0]), "length": int(tokens.shape[1]),
            "layers": len(layers),
            "kl_first": sum(losses[:head]) / max(head, 1), "kl_last": sum(losses[-head:]) / max(head, 1),
            "factor_min": gs.min().item(), "factor_max": gs.max().item(), "seconds": time.perf_counter() - t0}
