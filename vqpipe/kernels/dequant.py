"""C[q] for the dense path (prefill, the CPU), read through a table of whole packed fields.

The obvious rebuild, ``codebook[unpack(packed)]``, shifts and masks every value as a uint32 (4-bit:
two weight-sized uint32 temporaries; 3-bit: seven, for the straddling words), then gathers: some
10-30 bytes written per weight entry before the matmul reads 2. Here the packed stream is read as
fields of F whole bits, each holding v = F / bits values (F = 8, one byte, for 2/4/8 bits; F = 12
for 3/6; F = 10 for 5), and one gather from a table of every field's v codebook values writes the
weight: for 2/4/8 bits there is no arithmetic at all (the bytes are the indices), for 3/5/6 a few
ops on arrays 1/v the weight's size, in uint16. The table holds the same codebook values in the
same dtype, so the weight is the same, bit for bit.

Layout (vqpipe/codec/bitpack.py): value i of a row is stream bits [bits*i, bits*(i+1)), stream bit k is
bit k % 32 of little-endian word k // 32, so byte j of a row holds stream bits [8j, 8j + 8); rows
are padded to 32 values, a whole number of fields.
"""

import contextlib
import weakref

import mlx.core as mx
import numpy as np

from ..codec import trellis
from ..codec.bitpack import unpack
from . import ext

FIELD_BITS = {2: 8, 4: 8, 8: 8, 3: 12, 6: 12, 5: 10}

_use_tables = True  # False: the old rebuild (an A/B arm of experiments/decode_shapes.py)
_tables = {}  # (id(codebook), bits, dtype) -> table; dropped with the codebook (weakref callback)


def _field_values(bits):
    """[2^F, v] numpy: the codes in each F-bit field value, lowest bits first."""
    f = FIELD_BITS[bits]
    fields = np.arange(1 << f, dtype=np.uint32)[:, None]
    return ((fields >> (bits * np.arange(f // bits, dtype=np.uint32))) & ((1 << bits) - 1)).astype(np.uint32)


def table(codebook, bits, dtype):
    """[2^F, v] in ``dtype``: the codebook values of every field; one per codebook array and dtype."""
    key = (id(codebook), bits, dtype)
    entry = _tables.get(key)
    if entry is None or entry[0]() is not codebook:
        t = codebook.reshape(-1).astype(dtype)[mx.array(_field_values(bits))]
        mx.eval(t)  # made once: not a gather replayed by a compiled function that first made it
        ref = weakref.ref(codebook, lambda _, key=key: _tables.pop(key, None))
        _tables[key] = entry = (ref, t)
    return entry[1]


def _fields(packed, bits):
    """uint8 (F = 8) or uint16 field values [rows, fields] of the packed rows."""
    rows = packed.shape[0]
    b = packed.view(mx.uint8).reshape(rows, -1)
    f = FIELD_BITS[bits]
    if f == 8:
        return b
    group = np.lcm(f, 8) // 8  # bytes per period of whole fields (3 for F = 12, 5 for F = 10)
    g = b.reshape(rows, -1, group).astype(mx.uint16)
    out = []
    for k in range(group * 8 // f):
        start, shift = divmod(k * f, 8)
        v = g[..., start] >> shift if shift else g[..., start]
        if shift + f > 8:  # the field's remaining bits in the next byte (at most one more: F <= 12)
            v = v | (g[..., start + 1] << (8 - shift))
        if (k + 1) * f % 8:  # bits of the next field above F: mask them off
            v = v & ((1 << f) - 1)
        out.append(v)
    return mx.stack(out, axis=-1).reshape(rows, -1)


def codes_to_values(packed, codebook, bits, n, dtype):
    """``codebook.astype(dtype)[unpack(packed, bits, n)]`` ([rows, n]), the same values, cheaper."""
    if bits not in FIELD_BITS or not _use_tables:
        return codebook.astype(dtype)[unpack(packed, bits, n)]
    rows = packed.shape[0]
    w = table(codebook, bits, dtype)[_fields(packed, bits)].reshape(rows, -1)
    # padded rows: a contiguous copy, as the old gather wrote one (the same matmul operand layout)
    return w if w.shape[1] == n else mx.contiguous(w[:, :n])


def _times_group_scales(w, scales, group_size):
    rows, g = scales.shape
    return (w.reshape(rows, g, group_size) * scales.astype(w.dtype)[:, :, None]).reshape(rows, w.shape[1])


def scaled_values(packed, codebook, bits, n, dtype, scales, group_size):
    """C[q] times its group scales ([rows, n]; scales [rows, n // group_size]): the weight the
    dense path multiplies by (dense_forward)."""
    return _times_group_scales(codes_to_values(packed, codebook, bits, n, dtype), scales, group_size)



@contextlib.contextmanager
def using_tables(flag):
    """``with dequant.using_tables(False): ...``: the block rebuilds weights the old way."""
    global _use_tables
    previous, _use_tables = _use_tables, bool(flag)
    try:
        yield
    finally:
        _use_tables = previous


@contextlib.contextmanager
def decoded_once():
    """Within: each layer's codes are decoded to codebook values once, on the first prompt; later
    prompts reuse those arrays. Decoding is most of a short prompt's CPU forward (SmolLM2: 0.8 of
    1.0 s, every weight of 30 blocks and the embedding), the values are the same every time (a
    deterministic gather), and everything else the model does runs per prompt as before, so a
    reservoir that differs anywhere still differs. validate runs its prompts in it, and quantize
    the same prompts for the reference logits validate compares with (bit-identical either way,
    tests/test_validate.py). Keyed by the arrays themselves (held, so no id is reused); rows
    gathered from an embedding are new arrays each prompt and never hit.

    A layer with group scales is kept as the scaled weight (``scaled_values``), its unscaled codes
    a temporary of that product, so the group-scale multiply runs once too (the same product in
    the same dtype: the same bytes) and one weight-sized array a layer is held, not two. A trellis
    layer's code values (``trellis_values``) are kept the same way."""
    global codes_to_values, scaled_values, trellis_values  # called as module attributes: those are patched
    decode, scale, decode_trellis, cache = codes_to_values, scaled_values, trellis_values, {}

    def lookup(key, arrays, make):
        hit = cache.get(key)
        if hit is None or any(a is not b for a, b in zip(hit[0], arrays)):
            hit = cache[key] = (arrays, make())
        return hit[1]

    def cached(packed, codebook, bits, n, dtype):
        return lookup(("codes", id(packed), id(codebook), bits, n, dtype), (packed, codebook),
                      lambda: decode(packed, codebook, bits, n, dtype))

    def cached_scaled(packed, codebook, bits, n, dtype, scales, group_size):
        # from the uncached decode: the unscaled values are not held beside the scaled ones
        return lookup(("scaled", id(packed), id(codebook), id(scales), bits, n, dtype, group_size),
                      (packed, codebook, scales),
                      lambda: _times_group_scales(decode(packed, codebook, bits, n, dtype), scales, group_size))

    def cached_trellis(packed, table, bits, rows, cols, L, dtype=mx.float32, scale=None):
        return lookup(("trellis", id(packed), id(table), bits, rows, cols, L, dtype), (packed, table),
                      lambda: decode_trellis(packed, table, bits, rows, cols, L, dtype, scale))

    codes_to_values, scaled_values, trellis_values = cached, cached_scaled, cached_trellis
    try:
        yield
    finally:
        codes_to_values, scaled_values, trellis_values = decode, scale, decode_trellis


def dense_forward(xr, packed, scales, codebook, bits, bias=None, group_size=None):
    """The dense path from the rotated input: rebuild C[q] in x's dtype, one matmul, scales, bias.
    Per-row scales multiply the matmul's output (the formula the artifacts' reference logits were
    made with); per-group scales multiply the rebuilt weight."""
    dt, n = xr.dtype, xr.shape[-1]
    # no uint32 temporaries
    if scales.ndim == 1:
        y = (xr @ codes_to_values(packed, codebook, bits, n, dt).T) * scales.astype(dt)
    else:  # the same products as w * repeat(scales), without a weight-sized repeat of the scales
        y = xr @ scaled_values(packed, codebook, bits, n, dt, scales, group_size).T
    return y if bias is None else y + bias.astype(dt)


def trellis_values(packed, table, bits, rows, cols, L, dtype=mx.float32, scale=None):
    """The code values [rows, cols] (no scales) of a trellis layer's codes (vqpipe/codec/trellis.py:
    tiles of 32 rows x 8 columns, each a column-major stream of k-bit steps from state 0). Given the
    code's ``scale``, where the extension runs (the CPU; CUDA in its CUDA build) its compiled decode
    writes them (ext.trellis_decode: the same values, bit for bit, 2-4 bytes a weight written);
    otherwise MLX ops: each state is the last L bits of its tile's stream, then one gather from
    ``table`` (16 bytes a weight of uint32 temporaries on the way)."""
    if scale is not None and ext.decode_dispatch():
        return ext.trellis_decode(packed, bits, L, scale, cols, dtype)
    tr, g = trellis.TILE_ROWS, trellis.GROUP
    nb, ncb, n = rows // tr, cols // g, tr * g
    steps = unpack(packed.reshape(nb * ncb, g * bits), bits, n)
    states = steps
    for j in range(1, -(-L // bits)):  # the older steps still inside the L-bit window
        older = mx.pad(steps[:, : n - j], [(0, 0), (j, 0)])
        states = states | (older << (j * bits))
    states = states & ((1 << L) - 1)
    v = table.astype(dtype)[states].reshape(nb, ncb, g, tr)
    return v.transpose(0, 3, 1, 2).reshape(rows, cols)


def trellis_forward(xr, packed, scales, table, bits, L, bias=None, scale=None):
    """The dense path of a trellis layer from the rotated input: decode (``trellis_values``), one
    matmul, row scales, bias (the scalar path's order: per-row scales multiply the matmul's output)."""
    dt = xr.dtype
    w = trellis_values(packed, table, bits, packed.shape[0] * trellis.TILE_ROWS, xr.shape[-1], L, dt, scale)
    y = (xr @ w.T) * scales.astype(dt)
    return y if bias is None else y + bias.astype(dt)
