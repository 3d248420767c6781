"""Small arrays a kernel reads, kept out of MLX's CUDA small-array pool.

MLX's CUDA allocator (0.32.4, mlx/backend/cuda/allocator.cpp ``SmallSizePool``) serves every array
of at most 8 bytes from one shared 64 KiB block of managed memory (``cudaMallocManaged``; the
versions we read advise it accessed-by the device, so the device may read it where it lies rather
than migrate it). A decode loop writes its scalars there on every step (the next token, the
position, per-call counts made on the host) and the host reads the token back, so those pages are
touched by both sides, and a kernel whose every thread reads a pooled array may wait on that.
Under Nsight Compute on the H200 the fused q|k|v and gate|up mat-vecs of qwen2.5-0.5b, which read
their 4-8-byte split points, took 13.8 and 21.9 µs against 4.7-5.8 µs for the single-output
launches that read none (experiments/step_kernels.py, 2026-12-04; CHANGELOG.md).

So the small arrays that kernels read in the decode path are made at least ``PADDED_BYTES`` long:
they get an allocation of their own. End to end at Llama-3-8B shapes the padded and the pooled
arrays decode alike (1.05x, inside the ±38.8 % floor: docs/tried.md); the padding stays as the
path the GPU tests ran. On the CPU and Metal nothing differs but a few bytes.
"""

import mlx.core as mx

POOL_BYTES = 8  # MLX's small pool takes allocations of at most this many bytes
PADDED_BYTES = 16


def length(n, dtype):
    """Elements to allocate for ``n`` of ``dtype``: at least PADDED_BYTES."""
    return max(n, -(-PADDED_BYTES // dtype.size))


def array(values, dtype):
    """``values`` as a 1-d array of ``dtype``, zeros after them up to :func:`length` elements."""
    values = list(values)
    return mx.array(values + [0] * (length(len(values), dtype) - len(values)), dtype)


_made = {}


def constant(values, dtype):
    """:func:`array` of ``values``, made once per (values, dtype) and reused: a launch's split
    points, which a per-call ``mx.array`` would write from the host on every eager call."""
    key = (tuple(values), dtype)
    if key not in _made:
        _made[key] = array(values, dtype)
    return _made[key]
