"""vqpipe/codec/trellis.py: the bitshift-trellis reference (issue 34; experiments/vq/README.md)."""

import itertools

import numpy as np
import pytest

from vqpipe.codec import trellis


def test_table_normalised_and_read_only():
    t = trellis.table(10, 1.0)
    assert t.shape == (1024,) and t.dtype == np.float32
    assert abs(float(t.mean())) < 1e-5 and abs(float(t.std()) - 1) < 1e-5
    with pytest.raises(ValueError):
        t[0] = 0


def test_viterbi_is_the_best_path_by_brute_force():
    L, k, T = 4, 2, 4
    tab = trellis.table(L, 1.0)
    x = np.random.default_rng(0).standard_normal((5, T)).astype(np.float32)
    states = trellis.viterbi(x, L, k, tab)
    for r in range(len(x)):
        best = np.inf
        for bits in itertools.product(range(1 << k), repeat=T):
            s, err = 0, 0.0
            for i, b in enumerate(bits):
                s = ((s << k) | b) & ((1 << L) - 1)
                err += (x[r, i] - tab[s]) ** 2
            best = min(best, err)
        assert np.isclose(((x[r] - tab[states[r]]) ** 2).sum(), best, rtol=1e-5)


@pytest.mark.parametrize("L,k", [(8, 2), (10, 2), (10, 3), (8, 4)])
def test_exactly_k_bits_per_weight_and_states_round_trip(L, k):
    rows, g = 64, trellis.GROUP
    x = np.random.default_rng(L * 10 + k).standard_normal((rows, g)).astype(np.float32)
    seq = trellis.to_sequences(x)
    assert np.array_equal(trellis.from_sequences(seq, rows, g), x)
    states = trellis.viterbi(seq, L, k, trellis.table(L))
    # each state is the previous one shifted by k bits: the path is a trellis path
    prev = np.concatenate([np.zeros((len(states), 1), dtype=np.int64), states[:, :-1]], axis=1)
    assert np.array_equal(states >> k, prev & ((1 << (L - k)) - 1))
    packed = trellis.pack_states(states, k)
    T = seq.shape[1]
    assert packed.dtype == np.uint32 and packed.size * 32 == seq.size * k  # 256 weights: no padding
    assert np.array_equal(trellis.unpack_states(packed, T, L, k), states)


def test_trellis_beats_scalar_lloyd_max_on_gaussian_data():
    from vqpipe.codec.codebook import distortion

    x = np.random.default_rng(1).standard_normal((16, 256)).astype(np.float32)
    tab = trellis.table(8, 1.08)
    mse = float(np.mean((x - tab[trellis.viterbi(x, 8, 2, tab)]) ** 2))
    assert mse < 0.8 * distortion(2, 576)  # ~0.089 against 0.1175 (experiments/vq/README.md)


def test_allocator_distortion_hook():
    from vqpipe.codec.codebook import distortion

    d2 = distortion(2, 576, kind="trellis")
    assert 0.07 < d2 < 0.09 and distortion(3, 576, kind="trellis") < 0.3 * d2 + 0.005
    assert distortion(2, 576) == distortion(2, 576, kind="scalar")


def test_without_the_extension_the_reference_runs(monkeypatch):
    """No vqpipe._ext: viterbi is the numpy reference, matvec the dense product of decode."""
    import mlx.core as mx

    monkeypatch.setattr(trellis, "_ext", None)
    rng = np.random.default_rng(4)
    x = rng.standard_normal((3, 256)).astype(np.float32)
    assert np.array_equal(trellis.viterbi(x, 10, 2, trellis.table()), trellis._viterbi_numpy(x, 10, 2, trellis.table()))
    packed, values = trellis.quantize(rng.standard_normal((64, 8)).astype(np.float32), 3)
    v = rng.standard_normal((2, 8)).astype(np.float32)
    y = trellis.matvec(mx.array(v), mx.array(packed), mx.full((64,), 2.0), 3, bias=mx.ones((64,)))
    assert np.allclose(np.array(y), 2 * v @ values.T + 1, atol=1e-5)
