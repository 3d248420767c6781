"""vqpipe/kernels/small_arrays.py: small arrays kernels read are padded past MLX's small pool."""

import mlx.core as mx

from vqpipe.codec import bitpack
from vqpipe.kernels import qmv, small_arrays


def test_padding_lengths_and_values():
    a = small_arrays.array([3, 7], mx.int32)
    assert a.nbytes >= small_arrays.PADDED_BYTES > small_arrays.POOL_BYTES
    assert a.tolist()[:2] == [3, 7] and not any(a.tolist()[2:])
    assert small_arrays.length(2, mx.int32) == 4
    assert small_arrays.length(9, mx.int32) == 9  # long enough already: unchanged


def test_split_points_are_padded_and_cached():
    assert small_arrays.constant([896, 1024], mx.int32).nbytes == 16 and small_arrays.constant([896, 1024], mx.int32) is small_arrays.constant((896, 1024), mx.int32)
    assert small_arrays.constant([0], mx.int32).tolist()[0] == 0 and small_arrays.constant([0], mx.int32).nbytes == 16


def test_qmv_launch_feeds_padded_split_points(monkeypatch):
    """Revision 6's launch hands the kernel split points out of the pool, made once per signature:
    captured at the kernel call, nothing run."""
    seen = []

    def fake_kernel(dialect, outputs=1):
        def call(inputs, output_shapes, output_dtypes, **_):
            seen.append(inputs[7])  # seg (qmv.INPUT_NAMES)
            return [mx.zeros(s, d) for s, d in zip(output_shapes, output_dtypes)]
        return call

    monkeypatch.setattr(qmv, "_kernel", fake_kernel)
    n_in, n_out, bits = 256, 48, 4
    x = mx.zeros((1, n_in), mx.bfloat16)
    packed = mx.zeros((n_out, bitpack.words_per_row(n_in, bits)), mx.uint32)
    args = ("cuda", x, packed, mx.ones((n_out,), mx.float32), mx.zeros((16,), mx.float32), bits)
    outs = qmv.launch(*args, splits=[16, 32])
    qmv.launch(*args, splits=[16, 32])
    assert [o.shape for o in outs] == [(1, 16), (1, 16), (1, 16)]
    assert [s.nbytes for s in seen] == [16, 16]
    assert seen[0] is seen[1]  # made once per signature
    assert [s.tolist()[:2] for s in seen] == [[16, 32]] * 2
