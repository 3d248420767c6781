"""A benchmark's compute dtype: a model's floating parameters cast, vqpipe's quantized layers kept."""

import mlx.core as mx

from ..layers.qlinear import QuantizedLinear


def cast_floating(model, dtype):
    """Cast every floating parameter to ``dtype``, except the arrays of vqpipe QuantizedLinear
    layers (scales, codebook, bias: cast on the fly in their forward, kept as stored)."""
    from mlx.utils import tree_flatten

    keep = [n + "." for n, m in model.named_modules() if isinstance(m, QuantizedLinear)]
    new = [(k, v.astype(dtype)) for k, v in tree_flatten(model.parameters())
           if mx.issubdtype(v.dtype, mx.floating) and v.dtype != dtype and not any(k.startswith(p) for p in keep)]
    if new:
        model.load_weights(new, strict=False)
    mx.eval(model.parameters())
    return model
