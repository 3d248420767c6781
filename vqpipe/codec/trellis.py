"""Bitshift-trellis codes (issue 34, adopted from experiments/vq/README.md): the quantizer's side.

A tile of ``TILE_ROWS`` rows x ``GROUP`` rotated columns of a weight (32 x 8 = 256 weights) is one
sequence, column-major (down the rows of a column, then the next column). Each weight shifts k
new bits into an L-bit state, s_i = ((s_{i-1} << k) | b_i) mod 2^L, from s_{-1} = 0, and its
value is table[s_i] (the 1MAD code, normalised). Only the b_i are stored: exactly k bits per
weight, ``bitpack``'s little-endian stream (one tile = T*k bits, 16 uint32 words at k = 2), and
any weight decodes from the L bits before it. Viterbi chooses the b_i with the least squared
error; LDLQ feeds a block of GROUP columns' error forward.

A layer's codes: uint32 [rows / 32, cols / 8 * 8k], tile (rb, cb) (rows 32 rb.., columns 8 cb..)
at row rb, words 8k cb.. (row-block-major: ``quantize``'s blocks concatenated along axis 1), with
one float32 scale per row; ``decode`` is the dense reference, ``matvec`` the decode mat-vec.

The numpy code here is the reference. ``viterbi`` and ``matvec`` take the compiled kernels
(vqpipe._ext, csrc/trellis.cpp) where they are built: the same states, and the same mat-vec to
float32 rounding. quantize_model takes it with QuantizeConfig(codes="trellis") (block LDLQ:
vqpipe/codec/ldlq.py; the layer: vqpipe/layers/qlinear.py), and the recipe's allocator with
codebook.distortion(..., kind="trellis").
"""

from functools import lru_cache

import numpy as np

from .bitpack import pack, unpack_numpy

try:  # the compiled kernels; vqpipe/kernels/ext.py says when the extension is missing
    from .. import _ext
except ImportError:
    _ext = None

L_DEFAULT = 10
TILE_ROWS, GROUP = 32, 8
SCALE = 1.05  # code values x this: the Gaussian-MSE fit at L = 10, k = 2 (experiments/vq/gauss.py)


LCG = (34038481, 76625530)  # 1MAD's x -> x * LCG[0] + LCG[1] mod 2^32


def byte_sum(states):
    """1MAD's integer part (QTIP): the LCG of the state, the sum of its four bytes (0..1020)."""
    x = (np.asarray(states, dtype=np.uint64) * np.uint64(LCG[0]) + np.uint64(LCG[1])) & np.uint64(0xFFFFFFFF)
    return sum((x >> np.uint64(8 * i)) & np.uint64(255) for i in range(4)).astype(np.int64)


def code_1mad(states):
    """QTIP's 1MAD idea: the byte sum, centred and scaled to about unit variance."""
    return (byte_sum(states) - 510.0) / 147.800537109375


@lru_cache(maxsize=None)
def code_affine(L=L_DEFAULT, scale=SCALE):
    """(a, b), float32: a state's value is a * byte_sum(state) + b, normalised to zero mean and
    variance ``scale``^2 over the 2^L states."""
    y = byte_sum(np.arange(1 << L)).astype(np.float64)
    return np.float32(scale / y.std()), np.float32(-y.mean() * scale / y.std())


@lru_cache(maxsize=None)
def table(L=L_DEFAULT, scale=SCALE):
    """Value of every L-bit state (float32): ``code_affine``'s map of the byte sum, rounded once
    (a * y + b is exact in float64 here: a float32 fused multiply-add's value, so decode kernels
    compute the code rather than look it up, to the bit). Read-only."""
    a, b = code_affine(L, scale)
    v = (np.float64(a) * byte_sum(np.arange(1 << L)) + np.float64(b)).astype(np.float32)
    v.setflags(write=False)
    return v


def viterbi(x, L, k, tab):
    """States [n, T] (int64) of the least-squares path of each sequence x [n, T] from state 0:
    the compiled kernel (vqpipe._ext) where it is built, else the numpy reference (same states)."""
    fn = _compiled("trellis_viterbi")
    x = np.ascontiguousarray(x, dtype=np.float32)
    tab = np.ascontiguousarray(tab, dtype=np.float32)
    if fn is None or len(tab) != 1 << L or not k <= L <= 16 or k > 8 or not np.isfinite(x).all():
        return _viterbi_numpy(x, L, k, tab)
    return fn(x, tab, k).astype(np.int64)


def _compiled(name):
    """The compiled kernel ``name`` (csrc/trellis.cpp), or None where vqpipe._ext is not built (or
    is an older build without it)."""
    return getattr(_ext, name, None)


def _viterbi_numpy(x, L, k, tab):
    """The reference: numpy over all n sequences at once, one step at a time."""
    x = np.asarray(x, dtype=np.float32)
    n, T = x.shape
    S, K = 1 << L, 1 << k
    if L < k:
        raise ValueError(f"an L = {L} bit state cannot take k = {k} bits a step")
    P = S // K
    cost = np.full((n, S), np.inf, dtype=np.float32)
    cost[:, 0] = 0
    back = np.empty((T, n, P), dtype=np.uint8)
    for i in range(T):
        c = cost.reshape(n, K, P)  # predecessors of t: top << (L - k) | (t >> k)
        arg = c.argmin(1)
        m = np.take_along_axis(c, arg[:, None, :], 1)[:, 0, :]
        back[i] = arg
        d = x[:, i][:, None] - tab[None, :]
        cost = ((d * d).reshape(n, P, K) + m[:, :, None]).reshape(n, S)
    t = cost.argmin(1)
    states = np.empty((n, T), dtype=np.int64)
    rows = np.arange(n)
    for i in range(T - 1, -1, -1):
        states[:, i] = t
        t = (back[i][rows, t >> k].astype(np.int64) << (L - k)) | (t >> k)
    return states


def to_sequences(x, tile_rows=TILE_ROWS):
    """[rows, g] (one column block) -> [tiles, g * tile_rows], each tile column-major."""
    rows, g = x.shape
    if rows % tile_rows:
        raise ValueError(f"{rows} rows are not a multiple of the tile's {tile_rows}")
    return x.reshape(rows // tile_rows, tile_rows, g).transpose(0, 2, 1).reshape(rows // tile_rows, g * tile_rows)


def from_sequences(s, rows, g, tile_rows=TILE_ROWS):
    """The inverse of :func:`to_sequences`."""
    return s.reshape(rows // tile_rows, g, tile_rows).transpose(0, 2, 1).reshape(rows, g)


def pack_states(states, k):
    """The stored codes of state sequences [n, T]: each state's low k bits (what it shifted in),
    bit-packed (``bitpack.pack``: uint32 [n, words])."""
    return pack((np.asarray(states) & ((1 << k) - 1)).astype(np.uint8), k)


def unpack_states(packed, T, L, k):
    """States [n, T] (int64) from :func:`pack_states`' words: s_i = the last L stored bits."""
    b = unpack_numpy(np.asarray(packed), k, T).astype(np.int64)
    s = np.zeros_like(b)
    prev = np.zeros(b.shape[0], dtype=np.int64)
    mask = (1 << L) - 1
    for i in range(T):
        prev = ((prev << k) | b[:, i]) & mask
        s[:, i] = prev
    return s


def check_shape(rows, cols):
    """A trellis weight is whole tiles of TILE_ROWS x GROUP."""
    if rows < 1 or cols < 1 or rows % TILE_ROWS or cols % GROUP:
        raise ValueError(
            f"a trellis weight is tiles of {TILE_ROWS} rows x {GROUP} columns: shape ({rows}, {cols}) is not")


def quantize(x, k, L=L_DEFAULT, tab=None):
    """One block of GROUP rotated columns x [rows, GROUP] (in the table's units) -> (codes uint32
    [rows / TILE_ROWS, 8k], the chosen values float32 [rows, GROUP])."""
    x = np.asarray(x, dtype=np.float32)
    rows, g = x.shape
    check_shape(rows, g)
    if g != GROUP:
        raise ValueError(f"quantize takes one block of {GROUP} columns, got shape {x.shape}")
    tab = table(L) if tab is None else tab
    states = viterbi(to_sequences(x), L, k, tab)
    return pack_states(states, k), from_sequences(tab[states], rows, g)


def decode(packed, rows, cols, k, L=L_DEFAULT, tab=None):
    """Code values float32 [rows, cols] (no row scales) of a layer's codes (module docstring)."""
    check_shape(rows, cols)
    tab = table(L) if tab is None else tab
    nb, ncb, words = rows // TILE_ROWS, cols // GROUP, GROUP * k
    packed = np.asarray(packed)
    if packed.shape != (nb, ncb * words):
        raise ValueError(f"codes of a ({rows}, {cols}) weight at k = {k} are uint32 ({nb}, {ncb * words}), got {packed.shape}")
    states = unpack_states(packed.reshape(nb * ncb, words), TILE_ROWS * GROUP, L, k)
    v = tab[states].reshape(nb, ncb, GROUP, TILE_ROWS)  # a tile is column-major
    return v.transpose(0, 3, 1, 2).reshape(rows, cols)


def matvec(x, packed, scales, k, L=L_DEFAULT, scale=SCALE, bias=None):
    """y = x @ (scales[:, None] * decode(...)).T + bias for the rotated input x [..., cols] (MLX),
    in x's dtype: the compiled mat-vec on the CPU where it is built (it computes the 1MAD code of
    each state), else the dense reference."""
    import mlx.core as mx

    fn = _compiled("trellis_matvec")
    rows, cols = packed.shape[0] * TILE_ROWS, x.shape[-1]
    check_shape(rows, cols)
    if fn is not None and mx.default_device() == mx.cpu:
        a, b = code_affine(L, scale)
        return fn(x, packed, scales, k, L, float(a), float(b), bias)
    w = mx.array(decode(np.array(packed), rows, cols, k, L, table(L, scale))) * scales.astype(mx.float32)[:, None]
    y = x.astype(mx.float32) @ w.T
    return (y if bias is None else y + bias).astype(x.dtype)


@lru_cache(maxsize=None)
def distortion(bits, L=L_DEFAULT, n=64, seed=0):
    """Mean squared error per entry of unit Gaussian data at ``bits`` bits per weight (the
    allocator's D_w for this codebook): ``n`` tile-long sequences, seeded, memoised. At k = 2,
    L = 10: ~0.082 (experiments/vq/README.md), against the scalar Lloyd-Max 0.1175."""
    x = np.random.default_rng(seed).standard_normal((n, TILE_ROWS * GROUP)).astype(np.float32)
    tab = table(L)
    return float(np.mean((x - tab[viterbi(x, L, bits, tab)]) ** 2))
