"""Linears that read one activation, computed as one: one rotation, one mat-vec over their rows.

mlx-lm's attention and MLP modules call ``q_proj(x)``, ``k_proj(x)``, ``v_proj(x)`` (and
``gate_proj(x)``, ``up_proj(x)``) one after the other on the same array. Rewriting every
architecture's ``__call__`` to call one fused projection would mean a patch per model file; instead
the sibling layers stay where they are (same names, same stored state, so the reservoir round trip
is untouched) and share a :class:`FusedGroup`. The first sibling called with an input computes all
the group's rows at once (one rotation of x, one kernel launch or one dense matmul over the
concatenated rows) and keeps the other siblings' slices; they take theirs when called with the same
array object. Identity (``is``) is the test: MLX arrays are immutable values, and holding x keeps
its id from being reused. A group drops what it holds once every sibling took its slice, so
prefill outputs are not kept alive; a sibling called on another input (cross-attention) just
recomputes.

Groups form only where it is exact: same rotation (kind, dim, seed: quantize gives siblings the
first one's seed, see :func:`rotation_owner`), bits, codebook, scale layout and dtypes, and either
all or none with a bias. Artifacts made before siblings shared a seed simply stay unfused.

:func:`fuse_model` then folds the groups' rotation signs into the norms before them (and
down_proj's into up's rows) where that is exact: vqpipe/layers/fold.py.
"""

import mlx.core as mx

from . import fold as fold_signs
from ..kernels import dispatch, ext, qmv
from ..kernels.dequant import dense_forward
from .fold import fused_groups  # noqa: F401  (part of this module's interface)
from .qlinear import QuantizedEmbedding, QuantizedLinear, trellis_forward

# Sibling names that read the same input in mlx-lm's decoder layers (Llama, Qwen2/3, Mistral, Gemma,
# ...): the first of each tuple owns the rotation seed.
SIBLINGS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


def rotation_owner(name):
    """The layer whose seed ``name``'s rotation uses: its first sibling (itself if it has none)."""
    parent, _, leaf = name.rpartition(".")
    for group in SIBLINGS:
        if leaf in group:
            return f"{parent}.{group[0]}" if parent else group[0]
    return name


def _signature(layer):
    r = layer.rotation
    return (type(layer), layer.trellis, r.kind, r.dim, r.seed, layer.bits, layer.in_features, layer.group_size,
            layer.scales.ndim, layer.scales.dtype, layer.packed.dtype, layer.codebook.dtype, "bias" in layer,
            layer.bias.dtype if "bias" in layer else None)


def _same_rotation(a, b):
    if (a.kind, a.dim, a.seed, a.m, a.p) != (b.kind, b.dim, b.seed, b.m, b.p):
        return False
    return all((x is None) == (y is None) and (x is None or mx.array_equal(x, y).item())
               for x, y in ((a.signs, b.signs), (a.q, b.q), (a.matrix, b.matrix)))


class FusedGroup:
    def __init__(self, layers):
        first = layers[0]
        self.rotation, self.bits, self.group_size = first.rotation, first.bits, first.group_size
        self.codebook, self.trellis = first.codebook, first.trellis
        self.splits, end = [], 0
        for layer in layers[:-1]:
            end += layer.out_features
            self.splits.append(end)
        self.packed = mx.concatenate([layer.packed for layer in layers])
        self.scales = mx.concatenate([layer.scales for layer in layers])
        self.bias = mx.concatenate([layer.bias for layer in layers]) if "bias" in first else None
        mx.eval(self.packed, self.scales, self.bias)
        # The siblings' arrays become views of the concatenated ones: one copy of the weights.
        start = 0
        for layer in layers:
            stop = start + layer.out_features
            per = 1 if self.trellis is None else 32  # a trellis layer's packed rows are blocks of 32 rows
            layer.packed, layer.scales = self.packed[start // per : stop // per], self.scales[start:stop]
            if self.bias is not None:
                layer.bias = self.bias[start:stop]
            layer.codebook = self.codebook
            layer.rotation = self.rotation  # equal content (checked); one object, one cast cache
            mx.eval(layer.parameters())
            start = stop
        self.unfold()
        self.slot = {id(layer): k for k, layer in enumerate(layers)}
        self.size = len(layers)
        self._x, self._outs, self._left = None, None, 0

    def unfold(self):
        """No folded signs (vqpipe/layers/fold.py sets these): ``norm``, the SignedRMSNorm whose outputs
        carry the rotation's signs (then ``unsigned`` rotates them); ``flipped``, (scales, bias)
        with the next layer's signs in the last sibling's rows, for :meth:`compute` ``flip``."""
        self.norm, self.unsigned, self.flipped = None, None, None

    def compute(self, x, flip=False):
        """Every sibling's output for ``x``, in sibling order; ``flip``: the last sibling's rows
        times the signs folded into ``flipped``."""
        rotation = self.unsigned if self.norm is not None and self.norm.made(x) else self.rotation
        scales, bias = self.flipped if flip else (self.scales, self.bias)
        if self.trellis is not None:  # row blocks of 32 concatenate like rows
            y = trellis_forward(x, rotation, self.packed, scales, self.codebook, self.bits, self.trellis, bias)
            return mx.split(y, self.splits, axis=-1)
        dialect = qmv.dispatch(x) if self.bits in qmv.BITS else None  # 5/6-bit groups run dense
        if dialect is not None:  # one launch: rotation in its prologue, one output per sibling
            return dispatch.launch(dialect, x, self.packed, scales, self.codebook, self.bits, bias,
                                   self.group_size, rotation, self.splits, owner=self)
        xr = rotation.apply(x)
        if ext.dispatch(x):  # CPU decode: one compiled mat-vec over the group's rows
            y = ext.matvec(xr, self.packed, scales, self.codebook, self.bits, bias, self.group_size)
        else:
            y = dense_forward(xr, self.packed, scales, self.codebook, self.bits, bias, self.group_size)
        return mx.split(y, self.splits, axis=-1)

    def __call__(self, layer, x):
        if self._x is not x:
            self._outs, self._x, self._left = self.compute(x), x, self.size
        out = self._outs[self.slot[id(layer)]]
        self._left -= 1
        if self._left <= 0:  # every sibling served: hold nothing across steps
            self._x, self._outs = None, None
        return out


def fuse_model(model, fold=True):
    """Install a FusedGroup on every set of compatible siblings; returns the number of new groups.
    ``fold`` (on by default): then fold the shared rotations' signs into
    the layers before them (vqpipe/layers/fold.py: exact, runtime only)."""
    modules = dict(model.named_modules())
    count = 0
    for name, module in modules.items():
        for group in SIBLINGS:
            layers = [modules.get(f"{name}.{leaf}" if name else leaf) for leaf in group]
            if not all(isinstance(m, QuantizedLinear) and not isinstance(m, QuantizedEmbedding) for m in layers):
                continue
            if any(m.__dict__.get("_fused") is not None for m in layers):
                continue
            if len({_signature(m) for m in layers}) != 1:
                continue
            if not all(_same_rotation(layers[0].rotation, m.rotation) for m in layers[1:]):
                continue
            if not all(mx.array_equal(layers[0].codebook, m.codebook).item() for m in layers[1:]):
                continue
            fused = FusedGroup(layers)
            for m in layers:
                object.__setattr__(m, "_fused", fused)
            count += 1
    if fold:
        fold_signs.fold_model(model)
    return count


def unfuse_model(model):
    """Back to one computation per layer (the arrays stay views; the same function, and the same
    bytes where the BLAS's products do not depend on the matrix width)."""
    fold_signs.unfold_model(model)
    for _, m in model.named_modules():
        if isinstance(m, QuantizedLinear) and m.__dict__.get("_fused") is not None:
            object.__setattr__(m, "_fused", None)

