"""Small arrays a kernel reads, kept out of MLX's CUDA small-array pool.

MLX's CUDA allocator (0.32.4, mlx/backend/cuda/allocator.cpp ``SmallSizePool``) serves every array
of at most 8 bytes from one shared 64 KiB block of managed memory (``cudaMallocManaged``; the
versions we read advise it accessed-by the device, so the device may read it where it lies rather
than migrate it). A decode loop writes its scalars there on every step (the next token, the
position, per-call counts made on the host) and the host reads the token back, so those pages are
touched by both sides, and a kernel whose every thread reads a pooled array may wait on that. Session 13 saw it kernel by kernel on the
H200 (bench/step_kernels.py under Nsight Compute): the fused q|k|v and gate|up mat-vecs of
qwen2.5-0.5b, which read their 4-8-byte split points, took 13.8 and 21.9 µs against 4.7-5.8 µs for
the single-output launches that read none (figures from that session's notes; its raw files were
lost with it, docs/decode.md "Session 13"). Whether padding removes that time end to end is not
measured yet: the decode_shapes arm ``vqpipe-bN+g+s`` is that A/B (scripts/gpu_s13.sh PART=c).

So the small arrays that kernels read in the decode path are made at least ``PADDED_BYTES`` long:
they get an allocation of their own. ``VQPIPE_PAD_SMALL=0`` (or ``with padded(False)``) restores
the pooled arrays, for the side-by-side benchmark arm. On the CPU and Metal nothing differs but a
few bytes.
"""

import contextlib
import os

import mlx.core as mx

POOL_BYTES = 8  # MLX's small pool takes allocations of at most this many bytes
PADDED_BYTES = 16

_padded = os.environ.get("VQPIPE_PAD_SMALL", "1") == "1"


def enabled():
    return _padded


@contextlib.contextmanager
def padded(flag):
    """``with small_arrays.padded(False): ...``: new small arrays as MLX would pool them."""
    global _padded
    previous, _padded = _padded, bool(flag)
    try:
        yield
    finally:
        _padded = previous


def length(n, dtype, pad=None):
    """Elements to allocate for ``n`` of ``dtype``: at least PADDED_BYTES when padding is on."""
    pad = _padded if pad is None else pad
    return max(n, -(-PADDED_BYTES // dtype.size)) if pad else n


def array(values, dtype, pad=None):
    """``values`` as a 1-d array of ``dtype``, zeros after them up to :func:`length` elements."""
    values = list(values)
    return mx.array(values + [0] * (length(len(values), dtype, pad) - len(values)), dtype)


_made = {}


def constant(values, dtype):
    """:func:`array` of ``values``, made once per (values, dtype, padding) and reused: a launch's
    split points, which a per-call ``mx.array`` would write from the host on every eager call."""
    key = (tuple(values), dtype, _padded)
    if key not in _made:
        _made[key] = array(values, dtype)
    return _made[key]
