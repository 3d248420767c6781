"""What users would pick instead of vqpipe: mlx-lm 0.32's own quantizers and MLX's fp4 modes.

Each builder quantizes a source model in place the way the tool would, with our calibration
tokens (mlx-lm's own ``main()`` downloads its calibration text; these call its functions; ``calib``
is the [n, length] tokens or a function giving them, called once the width is accepted):

    gptq      mlx_lm.quant.gptq.gptq_quantize: affine g64 GPTQ on every nn.Linear, the rest
              (the embedding) at its fallback, 6 bits g64 (mlx-lm's defaults)
    awq       mlx_lm.quant.awq.awq_quantize: activation-aware scales and clipping, affine g64, the
              embedding at 4 bits g32 (its defaults), n_grid 20
    dynamic   mlx_lm.quant.dynamic_quant: per-layer sensitivities (gradients of the KL to the
              source on calibration text) pick which layers get the high width, at a bpw budget
    mxfp4 / nvfp4   MLX's nn.quantize(mode=...): 4-bit floats, group 32 / 16, 8-bit scales

A width the tool does not do raises :class:`Refused` with the tool's own words.
"""


import mlx.core as mx
import mlx.nn as nn


class Refused(Exception):
    """The tool refuses this width or model; the message says why."""


def check(method, bits):
    """Refused if ``method`` does not do ``bits``, asked before any model is read."""
    if method == "mlx-gptq":
        from mlx_lm.quant.gptq import quantize

        try:  # its packing asserts the width only after the Hessians and the first layer: ask it first
            quantize(mx.zeros((1, 32)), bits, mx.ones((1, 1)), mx.zeros((1, 1)))
        except AssertionError as e:
            raise Refused(f"mlx_lm.quant.gptq: {e} (it packs 2, 4 and 8 bits only)") from None
    elif method in FP4 and bits != 4:
        raise Refused(f"MLX's {method} mode stores 4-bit floats only, not {bits} bits")


def gptq(model, calib, bits, group_size=64, fallback_bits=6, fallback_group_size=64, batch_size=8):
    """mlx-lm's GPTQ (its Hessians from ``calib`` [n, length] tokens)."""
    from mlx_lm.quant.gptq import gptq_quantize

    check("mlx-gptq", bits)
    calib = calib() if callable(calib) else calib
    gptq_quantize(model, calib, bits, group_size, fallback_bits, fallback_group_size, batch_size=batch_size)
    return {"group_size": group_size, "fallback_bits": fallback_bits, "fallback_group_size": fallback_group_size,
            "calibration": list(calib.shape)}


def awq(model, calib, bits, model_type, group_size=64, embed_bits=4, embed_group_size=32, n_grid=20):
    """mlx-lm's AWQ (activation statistics of ``calib``); the embedding at ``embed_bits``."""
    from mlx_lm.quant.awq import AWQ_MODEL_CONFIGS, awq_quantize

    if model_type not in AWQ_MODEL_CONFIGS:
        raise Refused(f"mlx_lm.quant.awq: AWQ support for {model_type} models NYI")
    calib = calib() if callable(calib) else calib
    awq_quantize(model, calib, AWQ_MODEL_CONFIGS[model_type], group_size=group_size, bits=bits,
                 embed_group_size=embed_group_size, embed_bits=embed_bits, n_grid=n_grid)
    mx.eval(model.parameters())
    return {"group_size": group_size, "embed_bits": embed_bits, "embed_group_size": embed_group_size,
            "n_grid": n_grid, "calibration": list(calib.shape)}


def dynamic_widths(bits):
    """(low, high) widths of the dynamic arm at ``bits``: one bit either side where MLX has both,
    so that a budget of about bits + 0.5 (affine g64's, and vqpipe's) leaves room to mix; at 2 bits
    (MLX has no 1-bit affine) 2 and 3."""
    return (bits - 1, bits + 1) if bits - 1 >= 2 else (bits, bits + 1)


def dynamic(model, calib, bits, target_bpw, group_size=64, batch_size=4, dtype=None):
    """mlx-lm's dynamic_quant at ``target_bpw`` (mlx-lm's own count: every parameter's stored bits
    over the parameter count): sensitivities from ``calib``, then its threshold search and the
    quantization on the model cast to ``dtype`` (the source's: the budget counts scales as stored)."""
    from mlx.utils import tree_flatten
    from mlx_lm.quant.dynamic_quant import estimate_sensitivities, estimate_threshold

    low, high = dynamic_widths(bits)
    sens = dict(estimate_sensitivities(model, calib, low, group_size, high, group_size, batch_size=batch_size))
    if dtype is not None:
        model.set_dtype(dtype)
    threshold = estimate_threshold(model, sens, target_bpw, low, group_size, high, group_size)

    def predicate(p, m):
        if not hasattr(m, "to_quantized"):
            return False
        return {"bits": high, "group_size": group_size} if sens[p] > threshold else True

    nn.quantize(model, group_size=group_size, bits=low, class_predicate=predicate)
    mx.eval(model.parameters())
    widths = {k: m.bits for k, m in tree_flatten(model.leaf_modules(), is_leaf=nn.Module.is_module) if hasattr(m, "bits")}
    return {"group_size": group_size, "low_bits": low, "high_bits": high, "target_bpw": target_bpw,
            "layers_high": list(widths.values()).count(high), "layers_low": list(widths.values()).count(low),
            "widths": widths, "calibration": list(calib.shape)}


FP4 = {"mxfp4": 32, "nvfp4": 16}  # MLX's fp4 modes and their (fixed) group sizes


def fp4(model, mode, bits, embeddings=False):
    """MLX's ``mode`` (mxfp4 / nvfp4) on every nn.Linear (and the embedding with ``embeddings``)."""
    check(mode, bits)
    kinds = (nn.Linear, nn.Embedding) if embeddings else nn.Linear
    nn.quantize(model, group_size=FP4[mode], bits=4, mode=mode, class_predicate=lambda p, m: isinstance(m, kinds))
    mx.eval(model.parameters())
    return {"mode": mode, "group_size": FP4[mode]}


def embedding_format(model):
    """How the model stores its embedding table: None (dense) or {bits, group_size, mode}."""
    for _, m in model.named_modules():
        if isinstance(m, nn.QuantizedEmbedding):
            return {"bits": m.bits, "group_size": m.group_size, "mode": getattr(m, "mode", "affine")}
    return None


def mlx_lm_bpw(model):
    """mlx-lm's own count (mlx_lm.utils.compute_bits_per_weight): every parameter, stored bits."""
    from mlx_lm.utils import compute_bits_per_weight

    return compute_bits_per_weight(model)
