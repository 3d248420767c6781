import mlx.core as mx
import numpy as np
import pytest

from vqpipe.codec.bitpack import pack, unpack, unpack_numpy, words_per_row


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
@pytest.mark.parametrize("n", [1, 31, 32, 33, 50, 896, 4864])
def test_round_trip(bits, n):
    rng = np.random.default_rng(bits * 1000 + n)
    idx = rng.integers(0, 1 << bits, (5, n)).astype(np.uint8)
    packed = pack(idx, bits)
    assert packed.dtype == np.uint32 and packed.shape == (5, words_per_row(n, bits))
    assert np.array_equal(unpack_numpy(packed, bits, n), idx)
    assert np.array_equal(np.array(unpack(mx.array(packed), bits, n)), idx)


def test_really_bit_packed():
    idx = np.zeros((1, 4864), dtype=np.uint8)
    assert pack(idx, 3).nbytes == 4864 * 3 // 8
    assert pack(idx, 2).nbytes == 4864 * 2 // 8


def test_known_layout():
    # Values 1..7 in 3 bits, LSB first: 1 | 2<<3 | 3<<6 | ... ; value 10 straddles words 0 and 1.
    idx = np.array([[1, 2, 3, 4, 5, 6, 7, 1, 2, 3, 7] + [0] * 21], dtype=np.uint8)
    word0 = sum(int(v) << (3 * i) for i, v in enumerate(idx[0, :11])) & 0xFFFFFFFF
    p = pack(idx, 3)
    assert int(p[0, 0]) == word0
    assert int(p[0, 1]) & 0b1 == 7 >> 2


def test_too_large_index():
    with pytest.raises(ValueError, match="does not fit in 2 bits"):
        pack(np.array([[4]], dtype=np.uint8), 2)


@pytest.mark.parametrize("bits", [2, 4, 8])
def test_bytewise_packing_is_the_word_layout(bits):
    # pack builds 2/4/8-bit words from bytes; the layout is value i at bits [bits*i, bits*i + bits)
    # of the little-endian stream, i.e. the word fields below.
    idx = np.random.default_rng(bits).integers(0, 1 << bits, (37, 70)).astype(np.uint8)
    padded = np.zeros((37, 96), dtype=np.uint8)
    padded[:, :70] = idx
    fields = padded.reshape(37, -1, 32 // bits).astype(np.uint32) << np.arange(0, 32, bits, dtype=np.uint32)
    want = np.bitwise_or.reduce(fields, axis=-1)
    got = pack(idx, bits)
    assert got.dtype == np.uint32 and got.flags.c_contiguous and np.array_equal(got, want)
