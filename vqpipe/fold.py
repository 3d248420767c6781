"""The sign diagonals of shared input rotations, folded into the layers before them (runtime only).

A hadamard or kron rotation is R = H D with D a diagonal of +-1 signs: ``apply(x)`` is a multiply by
the signs, then the transform. Where the rotated input comes from a layer whose output can absorb
D, that multiply is one primitive per rotation per token saved, and nothing changes numerically:
multiplying by -1 is exact in every float format, and every operation in between commutes with it
bit for bit (round-to-nearest is symmetric; a sum of negated terms is the negated sum).

In mlx-lm's llama / qwen2 / qwen3 decoder blocks, per layer:

- q|k|v read ``input_layernorm(h)``: the norm's weight times D (``SignedRMSNorm``);
- gate|up read ``post_attention_layernorm(h)``: the same;
- down reads ``silu(gate) * up``: up's output rows times D (its row scales and bias in the fused
  group's copy), since ``silu(g) * (-u) == -(silu(g) * u)``.

o_proj's input is attention over v: under GQA one v head feeds several query heads, whose o_proj
columns carry different signs, so D cannot move into v_proj; it stays.

What is stored never changes: the norms keep their ``weight`` parameter (the folded product is a
plain attribute), the fused groups fold copies of their scales, and the layers keep their signed
rotations (the forward uses an unsigned copy). ``split_state`` and the reservoir see the unfolded
model, byte for byte. Off with ``VQPIPE_FOLD_SIGNS=0`` or ``fuse_model(model, fold=False)``.
"""

import os

import mlx.core as mx
import mlx.nn as nn

from .qlinear import QuantizedLinear

# Block classes whose __call__ we checked: input_layernorm -> q/k/v only, post_attention_layernorm
# -> the MLP only, and down_proj(swiglu(gate_proj(x), up_proj(x))).
BLOCK_MODULES = ("mlx_lm.models.llama", "mlx_lm.models.qwen2", "mlx_lm.models.qwen3")


def default():
    """Whether fusing folds by default (``VQPIPE_FOLD_SIGNS``, on unless set to 0)."""
    return os.environ.get("VQPIPE_FOLD_SIGNS", "1") != "0"


class SignedRMSNorm(nn.Module):
    """``nn.RMSNorm`` with its output multiplied by ``signs``, computed as rms_norm with weight *
    signs. The parameter is the norm's own weight, unchanged (what is stored)."""

    def __init__(self, norm, signs):
        super().__init__()
        self.weight = norm.weight
        self.eps = norm.eps
        object.__setattr__(self, "original", norm)  # restored by unfold_model
        object.__setattr__(self, "signs", signs)
        self._fold()

    def _fold(self):
        w = self["weight"]
        folded = w * self.signs.astype(w.dtype)
        mx.eval(folded)
        object.__setattr__(self, "_source", w)
        object.__setattr__(self, "_folded", folded)

    def __call__(self, x):
        if self._source is not self["weight"]:  # load_weights replaced the weight: fold it again
            self._fold()
        return mx.fast.rms_norm(x, self._folded, self.eps)


def _group(layers):
    """The FusedGroup serving exactly ``layers``, or None."""
    g = layers[0].__dict__.get("_fused")
    ok = g is not None and g.size == len(layers) and all(m.__dict__.get("_fused") is g for m in layers)
    return g if ok else None


def _norm_fold(block, norm_name, group):
    norm = getattr(block, norm_name, None)
    if group is None or type(norm) is not nn.RMSNorm or not group.rotation.has_signs():
        return 0
    setattr(block, norm_name, SignedRMSNorm(norm, group.rotation.sign_vector()))
    group.rotation = group.rotation.unsigned()
    return 1


def _down_fold(mlp, group):
    """down_proj's signs into up_proj's rows of the gate|up group (up is its last sibling)."""

    down = getattr(mlp, "down_proj", None)
    if group is None or type(down) is not QuantizedLinear or not down.rotation.has_signs():
        return 0
    start = group.splits[-1]
    if group.scales.shape[0] - start != down.in_features:
        return 0
    s = down.rotation.sign_vector()
    scales = group.scales
    signs = s.astype(scales.dtype).reshape(-1, *([1] * (scales.ndim - 1)))
    group.scales = mx.concatenate([scales[:start], scales[start:] * signs])
    if group.bias is not None:
        group.bias = mx.concatenate([group.bias[:start], group.bias[start:] * s.astype(group.bias.dtype)])
    mx.eval(group.scales, group.bias)
    object.__setattr__(down, "_rotation", down.rotation.unsigned())
    return 1


def fold_block(block):
    """Fold one decoder block; returns the sign multiplies removed (3 for a fused block)."""
    attn, mlp = getattr(block, "self_attn", None), getattr(block, "mlp", None)
    if type(block).__module__ not in BLOCK_MODULES or attn is None or mlp is None:
        return 0
    names = ("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj")
    groups = [_group([getattr(mod, n, None) for n in group]) if all(hasattr(mod, n) for n in group) else None
              for mod, group in zip((attn, mlp), names)]
    return (_norm_fold(block, "input_layernorm", groups[0]) + _norm_fold(block, "post_attention_layernorm", groups[1])
            + _down_fold(mlp, groups[1]))


def fold_model(model):
    """Fold every block where it is exact (undoing an earlier fold first); the multiplies removed."""
    unfold_model(model)
    blocks = [m for _, m in model.named_modules() if type(m).__module__ in BLOCK_MODULES and hasattr(m, "mlp")]
    return sum(fold_block(b) for b in blocks)


def unfold_model(model):
    """Back to the stored forward: the original norms, signed rotations, stored scales."""
    from .fused import fused_groups

    for g in fused_groups(model).values():
        g.restore()
    for _, m in model.named_modules():
        if isinstance(m, QuantizedLinear):
            m.__dict__.pop("_rotation", None)
        for name, child in list(m.children().items()):
            if isinstance(child, SignedRMSNorm):
                child.original.weight = child["weight"]
                setattr(m, name, child.original)


def folded_count(model):
    """Sign multiplies the current model leaves out per forward (norms + folded down_projs)."""

    mods = [m for _, m in model.named_modules()]
    return sum(isinstance(m, SignedRMSNorm) for m in mods) + sum(
        isinstance(m, QuantizedLinear) and "_rotation" in m.__dict__ for m in mods)
