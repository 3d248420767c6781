"""KIVI codes packed into uint32 words, laid out for the decode-attention kernel.

A word holds ``32 // bits`` consecutive channels of one token, the lowest bits first. Keys are
stored per key group (G tokens of one channel share a scale and zero): a group is a tile of
``W = D * bits / 32`` words of each of its G tokens, word-major, so the 32 lanes of a warp that own
32 consecutive tokens read 32 consecutive words (128 bytes) per load. Values are stored per token,
the W words of a token consecutive (a token's channels are one value group after another).

    keys:   codes [B, H, NG*G, D] -> words [B, H, NG, W, G]
    values: codes [B, H, S, D]    -> words [B, H, S, W]

Scale and zero are kept as float16 pairs, ``[..., 2]`` (scale, zero) per group: keys
``[B, H, NG, D, 2]``, values ``[B, H, S, ceil(D / G), 2]``. Dequantization in float32:
``x_hat = code * scale + zero``.
"""

import mlx.core as mx

from . import quantizer


def per_word(bits):
    return 32 // bits


def check_geometry(head_dim, bits, group_size):
    """Raise ValueError unless codes fill whole words and no word straddles two value groups."""
    quantizer._qmax(bits)
    if bits not in (2, 4, 8):
        raise ValueError(f"packed KIVI stores 2, 4 or 8 bits per code, got {bits}")
    cpw = per_word(bits)
    if head_dim % cpw:
        raise ValueError(f"head dim {head_dim} is not a multiple of {cpw} ({bits}-bit codes fill 32-bit words)")
    if group_size % cpw:
        raise ValueError(f"group_size {group_size} is not a multiple of {cpw}: a word would straddle two groups")


_CONSTANTS = {}


def _shifts(bits):
    """(field shifts, field mask) as uint32 arrays, made once per width: the prefill path unpacks
    every tile, and on a GPU each array made per call is one more op or host allocation there."""
    if bits not in _CONSTANTS:
        _CONSTANTS[bits] = (mx.arange(0, 32, bits, dtype=mx.uint32), mx.array(2**bits - 1, dtype=mx.uint32))
    return _CONSTANTS[bits]


def pack_words(codes, bits):
    """uint8 codes [..., D] -> uint32 words [..., D * bits / 32] (channel c of a word at bit c * bits)."""
    *lead, d = codes.shape
    c = codes.astype(mx.uint32).reshape(*lead, d // per_word(bits), per_word(bits))
    # the fields are disjoint, so the sum is their bitwise or
    return mx.sum(c << _shifts(bits)[0], axis=-1)


def unpack_words(words, bits):
    """uint32 words [..., W] -> codes [..., W * 32 / bits] as uint32."""
    *lead, w = words.shape
    shifts, mask = _shifts(bits)
    c = (words[..., None] >> shifts) & mask
    return c.reshape(*lead, w * per_word(bits))


def pack_keys(codes, bits, group_size):
    """Key codes [B, H, NG*G, D] -> [B, H, NG, W, G]."""
    b, h, s, d = codes.shape
    words = pack_words(codes, bits).reshape(b, h, s // group_size, group_size, -1)
    return words.swapaxes(-1, -2)


def unpack_keys(words, bits):
    """[B, H, NG, W, G] -> key codes [B, H, NG*G, D] as uint32."""
    b, h, ng, w, g = words.shape
    return unpack_words(words.swapaxes(-1, -2), bits).reshape(b, h, ng * g, -1)


def params(scale, zero):
    """float32 scale and zero -> one float16 array [..., 2]."""
    return mx.stack([scale, zero], axis=-1).astype(mx.float16)


def dequantize_keys(words, kp, bits, group_size):
    """float32 keys [B, H, NG*G, D] from packed words and [B, H, NG, D, 2] scale/zero."""
    # codes as [B, H, NG, G, D] against the groups' parameters broadcast over G: no repeated copy.
    # The float16 parameters meet the float32 codes in the multiply, which upcasts them exactly
    # (no separate cast: one op less per tile).
    b, h, ng, _, g = words.shape
    codes = unpack_words(words.swapaxes(-1, -2), bits).astype(mx.float32)
    kp = kp[:, :, :, None]
    return (codes * kp[..., 0] + kp[..., 1]).reshape(b, h, ng * g, -1)


def dequantize_values(words, vp, bits, group_size):
    """float32 values [B, H, S, D] from packed words [B, H, S, W] and [B, H, S, NGV, 2]."""
    codes = unpack_words(words, bits).astype(mx.float32)
    *lead, d = codes.shape
    ngv = vp.shape[-2]
    if ngv * group_size != d:  # a ragged last group: the parameters repeated per channel
        vp = mx.repeat(vp, group_size, axis=-2)[..., :d, :]
        return codes * vp[..., 0] + vp[..., 1]
    # codes as [..., NGV, G] against the groups' parameters broadcast over G: no repeated copy
    codes = codes.reshape(*lead, ngv, group_size)
    vp = vp[..., None, :]
    return (codes * vp[..., 0] + vp[..., 1]).reshape(*lead, d)


def quantize_flush(k, v, bits, group_size):
    """One flush of whole key groups: ``(key words, key params, value words, value params)``,
    codes from the reference quantizer (:mod:`vqpipe.kivi.quantizer`), scale and zero as float16."""
    qk, ks, kz = quantizer.quantize_keys(k, bits, group_size)
    qv, vs, vz = quantizer.quantize_values(v, bits, group_size)
    return pack_keys(qk, bits, group_size), params(ks, kz), pack_words(qv, bits), params(vs, vz)
