"""The sign diagonals of shared input rotations, folded into the layers before them (runtime only).

A hadamard or kron rotation is R = H D with D a diagonal of +-1 signs: ``apply(x)`` is a multiply by
the signs, then the transform. Where the rotated input comes from a layer whose output can absorb
D, that multiply is one primitive per rotation per token saved, and nothing changes numerically:
multiplying by -1 is exact in every float format, and every operation in between commutes with it
bit for bit (round-to-nearest is symmetric; a sum of negated terms is the negated sum).

In mlx-lm's llama / qwen2 / qwen3 decoder blocks, per layer:

- q|k|v read ``input_layernorm(h)``: the norm's weight times D (``SignedRMSNorm``), and the fused
  group rotates what that norm made without D;
- gate|up read ``post_attention_layernorm(h)``: the same;
- down reads ``silu(gate) * up``: up's output rows times D (a copy of the group's scales and bias),
  since ``silu(g) * (-u) == -(silu(g) * u)``, computed by ``SignedMLP`` in place of the block's MLP.

o_proj's input is attention over v: under GQA one v head feeds several query heads, whose o_proj
columns carry different signs, so D cannot move into v_proj; it stays.

The projections keep their meaning when called on their own: a group drops D only for an input
its SignedRMSNorm made (identity, as FusedGroup serves siblings), down_proj and the gate|up
group's sibling calls never flip, only SignedMLP does. What changes is the norms' output (D times
the norm), which in these blocks feeds only q|k|v and the MLP.

What is stored never changes: the norms and MLPs keep their parameters (the same arrays under the
same names; the folded products are plain attributes), and the layers their signed rotations.
``split_state`` and the reservoir see the unfolded model, byte for byte. Off with
``fuse_model(model, fold=False)``.
"""

import weakref

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.activations import swiglu

from .qlinear import QuantizedLinear

# Block classes whose __call__ we checked: input_layernorm -> q/k/v only, post_attention_layernorm
# -> the MLP only, and down_proj(swiglu(gate_proj(x), up_proj(x))).
BLOCK_MODULES = ("mlx_lm.models.llama", "mlx_lm.models.qwen2", "mlx_lm.models.qwen3")


class SignedRMSNorm(nn.Module):
    """``nn.RMSNorm`` with its output multiplied by ``signs``, computed as rms_norm with weight *
    signs. The parameter is the norm's own weight, unchanged (what is stored)."""

    def __init__(self, norm, signs):
        super().__init__()
        self.weight = norm.weight
        self.eps = norm.eps
        object.__setattr__(self, "original", norm)  # restored by unfold_model
        object.__setattr__(self, "signs", signs)
        object.__setattr__(self, "_last", None)  # weakref to the last output: FusedGroup.compute asks
        object.__setattr__(self, "consumers", ())  # (module, child name, child) that read the output
        self._fold()
        mx.eval(self._folded)

    def _fold(self):
        w = self["weight"]
        folded = w * self.signs.astype(w.dtype)
        object.__setattr__(self, "_source", w)
        object.__setattr__(self, "_folded", folded)

    def intact(self):
        """Whether every reader of this norm's output is still the folded group (a dense copy or
        any other module swap makes them plain layers, which expect the plain norm)."""
        return all(parent.get(name) is child for parent, name, child in self.consumers)

    def __call__(self, x):
        if not self.intact():
            object.__setattr__(self, "_last", None)
            return mx.fast.rms_norm(x, self["weight"], self.eps)
        if self._source is not self["weight"]:  # load_weights replaced the weight: fold it again
            self._fold()
        y = mx.fast.rms_norm(x, self._folded, self.eps)
        object.__setattr__(self, "_last", weakref.ref(y))
        return y

    def made(self, x):
        """Whether ``x`` is this norm's last output (so it carries the signs)."""
        return self._last is not None and self._last() is x


class SignedMLP(nn.Module):
    """The block's MLP, ``down(swiglu(gate(x), up(x)))``, with down_proj's signs in up_proj's rows.
    Its children are the MLP's own layers (same names, same parameters)."""

    def __init__(self, mlp, group):
        super().__init__()
        for name, layer in mlp.children().items():  # in the MLP's order: the module walk (and the file) unchanged
            setattr(self, name, layer)
        object.__setattr__(self, "original", mlp)  # restored by unfold_model
        object.__setattr__(self, "group", group)
        object.__setattr__(self, "unsigned", mlp.down_proj.rotation.unsigned())
        object.__setattr__(self, "layers", tuple(mlp.children().items()))

    def __call__(self, x):
        if not all(self.get(name) is layer for name, layer in self.layers):  # children swapped: a plain MLP
            return self.down_proj(swiglu(self.gate_proj(x), self.up_proj(x)))
        gate, up = self.group.compute(x, flip=True)
        return self.down_proj.forward(swiglu(gate, up), self.unsigned)


def _group(layers):
    """The FusedGroup serving exactly ``layers``, or None."""
    g = layers[0].__dict__.get("_fused")
    ok = g is not None and g.size == len(layers) and all(m.__dict__.get("_fused") is g for m in layers)
    return g if ok else None


def _norm_fold(block, norm_name, group):
    norm = getattr(block, norm_name, None)
    if group is None or type(norm) is not nn.RMSNorm or not group.rotation.has_signs():
        return 0
    signed = SignedRMSNorm(norm, group.rotation.sign_vector())
    setattr(block, norm_name, signed)
    group.norm, group.unsigned = signed, group.rotation.unsigned()
    return 1


def _down_fold(block, group):
    """down_proj's signs into up_proj's rows of the gate|up group (up is its last sibling)."""
    mlp = block.mlp
    down = getattr(mlp, "down_proj", None)
    if group is None or type(down) is not QuantizedLinear or not down.rotation.has_signs():
        return 0
    if set(mlp.children()) != {"gate_proj", "up_proj", "down_proj"}:
        return 0  # an MLP with more in it than SignedMLP computes
    start = group.splits[-1]
    if group.scales.shape[0] - start != down.in_features:
        return 0
    s = down.rotation.sign_vector()
    scales = group.scales
    flipped = mx.concatenate([scales[:start], scales[start:] * s.astype(scales.dtype).reshape(-1, *([1] * (scales.ndim - 1)))])
    bias = None
    if group.bias is not None:
        bias = mx.concatenate([group.bias[:start], group.bias[start:] * s.astype(group.bias.dtype)])
    mx.eval(flipped, bias)
    group.flipped = (flipped, bias)
    block.mlp = SignedMLP(mlp, group)
    return 1


def fold_block(block):
    """Fold one decoder block; returns the sign multiplies removed (3 for a fused block)."""
    attn, mlp = getattr(block, "self_attn", None), getattr(block, "mlp", None)
    if type(block).__module__ not in BLOCK_MODULES or attn is None or mlp is None:
        return 0
    names = ("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj")
    groups = [_group([getattr(mod, n, None) for n in group]) if all(hasattr(mod, n) for n in group) else None
              for mod, group in zip((attn, mlp), names)]
    count = (_norm_fold(block, "input_layernorm", groups[0]) + _norm_fold(block, "post_attention_layernorm", groups[1])
             + _down_fold(block, groups[1]))
    for norm, parent, names in (("input_layernorm", "self_attn", names[0]), ("post_attention_layernorm", "mlp", names[1])):
        n, mod = block[norm], block[parent]
        if isinstance(n, SignedRMSNorm):
            object.__setattr__(n, "consumers", ((block, parent, mod), *((mod, k, mod[k]) for k in names)))
    return count


def fused_groups(model):
    """{id: group} of the fused groups (vqpipe/layers/fused.py) the model's layers belong to."""
    return {id(g): g for _, m in model.named_modules() if (g := getattr(m, "__dict__", {}).get("_fused"))}


def fold_model(model):
    """Fold every block where it is exact (undoing an earlier fold first); the multiplies removed."""
    unfold_model(model)
    blocks = [m for _, m in model.named_modules() if type(m).__module__ in BLOCK_MODULES and hasattr(m, "mlp")]
    return sum(fold_block(b) for b in blocks)


def unfold_model(model):
    """Back to the stored forward: the original norms and MLPs, groups without folded signs."""
    for g in fused_groups(model).values():
        g.unfold()
    for _, m in model.named_modules():
        for name, child in list(m.children().items()):
            if isinstance(child, SignedRMSNorm):
                child.original.weight = child["weight"]
                setattr(m, name, child.original)
            elif isinstance(child, SignedMLP):  # with its current children (a graft may have replaced them)
                for k, layer in child.children().items():
                    setattr(child.original, k, layer)
                setattr(m, name, child.original)


def folded_count(model):
    """Sign multiplies the current model leaves out per forward (norms + folded MLPs)."""
    return sum(isinstance(m, (SignedRMSNorm, SignedMLP)) for _, m in model.named_modules())
