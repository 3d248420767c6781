"""Bit-packing of codebook indices: ``bits`` bits per value in a little-endian uint32 stream.

Value i of a row occupies stream bits [bits*i, bits*i + bits), where stream bit k is bit k % 32 of
word k // 32. Each row is padded to a multiple of 32 values, so a row is exactly ``bits`` words per
32 values and rows start on word boundaries. 3 bits straddle words; 2, 4 and 8 never do.
"""

import mlx.core as mx
import numpy as np


def padded_length(n):
    return -(-n // 32) * 32


def words_per_row(n, bits):
    return padded_length(n) * bits // 32


def pack(indices, bits):
    """numpy uint8 ``[rows, n]`` (values < 2**bits) -> numpy uint32 ``[rows, words]``."""
    indices = np.asarray(indices)
    if indices.ndim != 2:
        raise ValueError(f"pack expects a 2-D index array, got shape {indices.shape}")
    if indices.size and int(indices.max()) >= 1 << bits:
        raise ValueError(f"index {int(indices.max())} does not fit in {bits} bits")
    rows, n = indices.shape
    padded = np.zeros((rows, padded_length(n)), dtype=np.uint8)
    padded[:, :n] = indices
    if bits in (2, 4, 8):
        # Whole values per byte: build the stream's bytes (uint8 work, no uint32 fields: 4-bit
        # packing of a 151,936 x 896 head 4x faster); little-endian words are those bytes.
        per = 8 // bits
        fields = padded.reshape(rows, -1, per)
        stream = fields[..., 0].copy()
        for j in range(1, per):
            stream |= fields[..., j] << np.uint8(bits * j)
        return stream.view("<u4").astype(np.uint32, copy=False)
    if 32 % bits == 0:
        shifts = np.arange(0, 32, bits, dtype=np.uint32)
        fields = padded.reshape(rows, -1, 32 // bits).astype(np.uint32) << shifts
        return np.bitwise_or.reduce(fields, axis=-1)
    planes = (padded[..., None] >> np.arange(bits, dtype=np.uint8)) & 1
    stream = np.packbits(planes.reshape(rows, -1), axis=-1, bitorder="little")
    return np.ascontiguousarray(stream).view("<u4").astype(np.uint32, copy=False)


def unpack_numpy(packed, bits, n):
    """Inverse of ``pack`` in numpy (for tests and tools)."""
    packed = np.ascontiguousarray(packed, dtype="<u4")
    rows = packed.shape[0]
    stream = np.unpackbits(packed.view(np.uint8).reshape(rows, -1), axis=-1, bitorder="little")
    planes = stream.reshape(rows, -1, bits)
    values = (planes << np.arange(bits, dtype=np.uint8)).sum(axis=-1, dtype=np.uint32)
    return values[:, :n].astype(np.uint8)


def unpack(packed, bits, n):
    """MLX uint32 ``[rows, words]`` -> uint32 ``[rows, n]``, with plain array ops (any backend)."""
    rows = packed.shape[0]
    mask = (1 << bits) - 1
    if 32 % bits == 0:
        shifts = mx.arange(0, 32, bits, dtype=mx.uint32)
        values = (packed[..., None] >> shifts) & mask
        return values.reshape(rows, -1)[:, :n]
    # Straddling widths: within each 32-value group, value j starts at bit bits*j of `bits` words.
    start = np.arange(32) * bits
    word, shift = start // 32, start % 32
    straddle = shift + bits > 32
    groups = packed.reshape(rows, -1, bits)
    lo = mx.take(groups, mx.array(word, dtype=mx.uint32), axis=-1) >> mx.array(shift, dtype=mx.uint32)
    hi_word = mx.take(groups, mx.array(np.minimum(word + 1, bits - 1), dtype=mx.uint32), axis=-1)
    # A shift by 32 is undefined in C, so only shift where the value really straddles.
    hi_shift = mx.array(np.where(straddle, 32 - shift, 0), dtype=mx.uint32)
    hi = mx.where(mx.array(straddle), hi_word << hi_shift, 0)
    return ((lo | hi) & mask).reshape(rows, -1)[:, :n]
