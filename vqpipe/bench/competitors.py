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
    dwq       mlx_lm.quant.dwq.dwq_quantize: affine g64 RTN of every layer (the embedding too, as
              mlx_lm.dwq's quantize_model does), then its scales and biases distilled from the source
              (Adam, KL at temperature 2 on the source's logits), on the calibration windows
    mxfp4 / nvfp4   MLX's nn.quantize(mode=...): 4-bit floats, group 32 / 16, 8-bit scales

A width the tool does not do raises :class:`Refused` with the tool's own words.
"""

import copy

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import tqdm
from mlx.utils import tree_flatten, tree_unflatten


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


# DWQ's Adam rate: the lowest validation loss of those tried on SmolLM2 (docs/results/2026-12-07-dwq/:
# 1e-4 beat 1e-5 at 2 and 4 bits, and 3e-4 at 4); mlx_lm.dwq's default, 1e-6, is set for its 512 steps, not the 15 here
DWQ_LR = 1e-4


class _DenseAffine(nn.Module):
    """An affine nn.QuantizedLinear / QuantizedEmbedding as DWQ trains it, computed densely: the same
    attributes dwq_quantize looks for (bits, group_size, mode) and the same trainable ``scales`` and
    ``biases``; the weight is q * scale + bias per group, with the codes q frozen as floats. MLX's
    CPU quantized matmul runs on one thread and takes minutes per 2,048-token step on SmolLM2; this
    is the same function of the same parameters at float32 BLAS speed."""

    def __init__(self, layer):
        super().__init__()
        self.bits, self.group_size, self.mode = layer.bits, layer.group_size, "affine"
        self.embedding = isinstance(layer, nn.QuantizedEmbedding)
        ones = mx.ones(layer.scales.shape, dtype=mx.float32)
        self.q = mx.dequantize(layer.weight, ones, mx.zeros_like(ones), layer.group_size, layer.bits)
        self.weight = layer.weight  # packed, unused here: mlx-lm's parameter count reads its size
        self.scales = layer.scales.astype(mx.float32)
        self.biases = layer.biases.astype(mx.float32)
        if "bias" in layer:
            self.bias = layer.bias.astype(mx.float32)
        self.freeze(recurse=False)  # as nn.QuantizedLinear: dwq_quantize unfreezes scales and biases

    def dense(self):
        o, i = self.q.shape
        q = self.q.reshape(o, i // self.group_size, self.group_size)
        return (q * self.scales[..., None] + self.biases[..., None]).reshape(o, i)

    def __call__(self, x):
        if self.embedding:
            return self.dense()[x]
        y = x @ self.dense().T
        return y + self.bias if "bias" in self else y

    def as_linear(self, x):  # a tied head
        return x @ self.dense().T


def dwq(model, calib, bits, group_size=64, lr=DWQ_LR, batch_size=4, valid=4, seed=0):
    """mlx-lm's DWQ of ``model`` (float32 source, quantized and distilled in place): ``calib()`` [n, T]
    tokens, ``valid`` of them (spread over the draw) for its validation loss, the rest its training
    windows, one pass in batches of ``batch_size``. mlx_lm.quant.dwq.dwq_quantize runs as it
    is (its loss, Adam, batches, validation) on :class:`_DenseAffine` stand-ins whose scales and
    biases go back into the quantized layers afterwards. Returns the settings and the validation
    loss before and after (its KL at temperature 2, as the tool prints it)."""
    from mlx_lm.quant.dwq import dwq_quantize
    from mlx_lm.utils import quantize_model

    calib = calib() if callable(calib) else calib
    n, T = calib.shape
    if n < valid + batch_size:
        raise ValueError(f"mlx-dwq needs at least {valid + batch_size} calibration windows, got {n}")
    held = {(j * n) // valid + n // (2 * valid) for j in range(valid)}
    rows = [calib[i].tolist() for i in range(n)]
    train = [(rows[i], 0) for i in range(n) if i not in held]
    val = [(rows[i], 0) for i in sorted(held)]
    teacher = copy.deepcopy(model)
    teacher.freeze()
    quantize_model(model, {}, group_size=group_size, bits=bits)
    mx.eval(model.parameters())
    layers = {k: m for k, m in tree_flatten(model.leaf_modules(), is_leaf=nn.Module.is_module)
              if isinstance(m, (nn.QuantizedLinear, nn.QuantizedEmbedding))}
    model.update_modules(tree_unflatten([(k, _DenseAffine(m)) for k, m in layers.items()]))
    targets = {}

    def target_fn(batch, i, split):  # the source's logits; the validation batches' computed once
        if split == "valid":
            if i not in targets:
                targets[i] = mx.stop_gradient(teacher(batch))
                mx.eval(targets[i])
            return targets[i]
        return mx.stop_gradient(teacher(batch))

    losses = []

    def record(*args, **kwargs):  # dwq_quantize's validation lines: "Validation: it=0, loss=..."
        line = " ".join(str(a) for a in args)
        if line.startswith("Validation:"):
            losses.append(float(line.rsplit("loss=", 1)[1]))

    write = tqdm.tqdm.write  # dwq_quantize prints through it
    tqdm.tqdm.write = staticmethod(record)
    try:
        dwq_quantize(model, target_fn, optim.Adam(learning_rate=lr, bias_correction=True), train, val,
                     batch_size, T + 1, seed, dtype=mx.float32)
    finally:
        tqdm.tqdm.write = write
    stand_ins = dict(tree_flatten(model.leaf_modules(), is_leaf=nn.Module.is_module))
    for k, m in layers.items():
        m.scales, m.biases = stand_ins[k].scales, stand_ins[k].biases
    model.update_modules(tree_unflatten(list(layers.items())))
    model.eval()
    mx.eval(model.parameters())
    return {"group_size": group_size, "lr": lr, "batch_size": batch_size,
            "steps": len(train) // batch_size, "train_windows": n - len(held), "valid_windows": len(held),
            "valid_loss_before": losses[0] if losses else None, "valid_loss_after": losses[-1] if losses else None,
            "calibration": list(calib.shape)}


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
