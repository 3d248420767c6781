"""One rotation of the residual stream, folded into the weights before quantization.

In mlx-lm's llama / qwen2 / qwen3 decoders every linear that reads the residual stream h reads it
through an RMSNorm: q/k/v after ``input_layernorm``, gate/up after ``post_attention_layernorm``,
the head after the final ``norm``. With an orthogonal Q and the stream kept as h' = Q h (rms is
unchanged by Q):

    W (g * h / rms(h)) = (W diag(g) Q^T) (h' / rms(h'))

so those linears take W diag(g) Q^T and the norms' weights become ones, while everything that
writes the stream is multiplied by Q: the embedding's rows, o_proj's and down_proj's output rows
and biases. The model computes the same function (computational invariance, as SliceGPT and
QuaRot use it); in floating point it differs by rounding.

Why: the readers' weights are incoherent already (Q spreads every input column over all of them),
so they are quantized without a rotation of their own (:func:`unrotated`), and q|k|v and gate|up
need no online rotation per token. o_proj and down_proj keep theirs: their inputs (attention's
output, the SwiGLU product) are not the stream.

A tied head (the embedding table read as the output layer) cannot take diag(g_f) Q^T, since its
rows are the embedding's (now Q e). It reads ``Head(y) = Q (g_f * Q^T y)`` of the final norm's
output y instead: two rotations per token at the head, none at the lookup. :class:`TiedEmbedding`
carries it while the model is dense; quantize hands it to the QuantizedEmbedding, which stores it
(vqpipe/layers/qlinear.py). A tied model therefore needs a quantized embedding.
"""

import mlx.core as mx
import mlx.nn as nn

from ..codec import rotation as rot
from .calibrate import decoder
from ..layers.fold import BLOCK_MODULES
from ..layers.head import Head

READERS = {"input_layernorm": ("q_proj", "k_proj", "v_proj"), "post_attention_layernorm": ("gate_proj", "up_proj")}
WRITERS = ("self_attn.o_proj", "mlp.down_proj")
ROW_CHUNK = 8192  # rows transformed at a time: a 150k-row embedding never has a float32 copy whole


class TiedEmbedding(nn.Embedding):
    """A dense embedding whose rows live in the rotated stream; as the tied head it reads Head(y)."""

    def __init__(self, weight, head):
        super().__init__(*weight.shape)
        self.weight = weight
        self.head = head

    def as_linear(self, x):
        return super().as_linear(self.head(x))


def tied(model):
    """Whether the output head is the embedding table (mlx-lm calls ``embed_tokens.as_linear``)."""
    if "lm_head" in model:
        return False
    return getattr(getattr(model, "args", None), "tie_word_embeddings", True) is not False


def check(model):
    """Raise ValueError naming what keeps ``model`` from a residual rotation (nothing changed)."""
    inner = decoder(model, "residual rotation")
    for i, layer in enumerate(inner.layers):
        if type(layer).__module__ not in BLOCK_MODULES:
            raise ValueError(f"residual rotation: block {i} is {type(layer).__module__}.{type(layer).__name__}; "
                             f"only the blocks of {', '.join(BLOCK_MODULES)} were checked for it")
        for norm, names in READERS.items():
            parent = layer.self_attn if norm == "input_layernorm" else layer.mlp
            if type(layer[norm]) is not nn.RMSNorm:
                raise ValueError(f"residual rotation: block {i}'s {norm} is {type(layer[norm]).__name__}, "
                                 "not nn.RMSNorm (whose weight folds into the next linears)")
            for n in names:
                _check_linear(parent[n], f"block {i}'s {n}")
        for path in WRITERS:
            a, b = path.split(".")
            _check_linear(layer[a][b], f"block {i}'s {b}")
    if type(inner.norm) is not nn.RMSNorm:
        raise ValueError(f"residual rotation: the final norm is {type(inner.norm).__name__}, not nn.RMSNorm")
    if not isinstance(inner.embed_tokens, (nn.Embedding, nn.QuantizedEmbedding)):
        raise ValueError(f"residual rotation: embed_tokens is {type(inner.embed_tokens).__name__}")
    if not tied(model):
        _check_linear(model.lm_head, "lm_head")


def _check_linear(module, where):
    if not isinstance(module, (nn.Linear, nn.QuantizedLinear)):
        raise ValueError(f"residual rotation: {where} is {type(module).__name__}, not a linear layer")


def _dense(module):
    """(weight, bias or None) of a Linear/Embedding, an affine-quantized one dequantized."""
    if isinstance(module, (nn.QuantizedLinear, nn.QuantizedEmbedding)):
        w = mx.dequantize(module.weight, module.scales, module.get("biases"), module.group_size, module.bits,
                          mode=getattr(module, "mode", "affine"))
        return w.astype(module.scales.dtype), module.get("bias")
    return module.weight, module.get("bias")


def _rows(w, fn):
    """fn applied to row chunks of w in float32, back in w's dtype (evaluated chunk by chunk)."""
    out = []
    for a in range(0, w.shape[0], ROW_CHUNK):
        part = fn(w[a:a + ROW_CHUNK].astype(mx.float32)).astype(w.dtype)
        mx.eval(part)
        out.append(part)
    return out[0] if len(out) == 1 else mx.concatenate(out)


def _linear(weight, bias):
    new = nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None)
    new.weight = weight
    if bias is not None:
        new.bias = bias
    return new


def _reader(module, gain, q):
    """A linear reading RMSNorm(h) with weight ``gain``, remade to read h' / rms(h')."""
    w, b = _dense(module)
    g = gain.astype(mx.float32)
    return _linear(_rows(w, lambda x: q.apply(x * g)), b)


def _writer(module, q):
    """A linear adding to the stream, remade to add Q times its output."""
    w, b = _dense(module)
    wt = _rows(w.T, q.apply)  # [in, hidden]: each input's column of W rotated
    return _linear(mx.contiguous(wt.T), None if b is None else q.apply(b.astype(mx.float32)).astype(b.dtype))


def _ones(norm):
    norm.weight = mx.ones(norm.weight.shape, norm.weight.dtype)


def identity(q):
    """What records and reservoir headers keep of a residual rotation: kind, dim, seed (or None)."""
    return None if q is None else {"kind": q.kind, "dim": int(q.dim), "seed": int(q.seed)}


def mark(model, spec):
    """Note on ``model`` (a plain attribute, not a parameter) the residual rotation folded into it."""
    object.__setattr__(model, "residual_rotation", spec)


def of(model):
    """The residual rotation ``model`` was made with (:func:`identity`), None for a plain model."""
    return model.__dict__.get("residual_rotation")


def unrotated(name):
    """Whether layer ``name`` of a residual-rotated model is quantized without a rotation of its own:
    the stream's readers (q/k/v, gate/up, an untied lm_head) and the embedding, whose rows are rotated."""
    leaf = name.rpartition(".")[2]
    return leaf in ("lm_head", "embed_tokens") or any(leaf in names for names in READERS.values())


def rotate_residual(model, seed, kind="auto"):
    """Fold one rotation of the residual stream into ``model`` (dense or affine-quantized weights), in
    place; returns it (a Rotation of the hidden size). Affine-quantized layers come out dense."""
    check(model)
    inner = decoder(model, "residual rotation")
    emb, _ = _dense(inner.embed_tokens)
    q = rot.make_rotation(kind, emb.shape[-1], seed)
    if q.kind in ("none", "qr"):
        raise ValueError(f"residual rotation: kind {q.kind!r}; a hadamard or kron rotation is folded (auto picks one)")
    for layer in inner.layers:
        for norm, names in READERS.items():
            parent = layer.self_attn if norm == "input_layernorm" else layer.mlp
            parent.update_modules({n: _reader(parent[n], layer[norm].weight, q) for n in names})
            _ones(layer[norm])
        for path in WRITERS:
            a, b = path.split(".")
            layer[a].update_modules({b: _writer(layer[a][b], q)})
    rows = _rows(emb, q.apply)
    if tied(model):
        gain = inner.norm.weight
        inner.update_modules({"embed_tokens": TiedEmbedding(rows, Head(gain, q))})
    else:
        model.update_modules({"lm_head": _reader(model.lm_head, inner.norm.weight, q)})
        new = nn.Embedding(*rows.shape)
        new.weight = rows
        inner.update_modules({"embed_tokens": new})
    _ones(inner.norm)
    mx.eval(model.parameters())
    mark(model, identity(q))
    return q
