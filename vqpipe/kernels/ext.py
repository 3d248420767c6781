"""The compiled codebook mat-vec (``vqpipe._ext``, built from csrc/ by scripts/build_ext.sh).

``codebook_matvec`` is an MLX primitive computing ``s * (C[q] @ xr) + b`` (or the group-scaled
form) from the rotated input and the packed codes, without rebuilding the dense weight. On the
CPU it runs an AVX2/FMA kernel (a portable one elsewhere) over output rows on a small thread pool;
a CUDA build of it serves eval_gpu where the installed MLX is a CUDA build, but vqpipe routes
scalar-code GPU work to vqpipe/kernels/qmv.py and only CPU work here. ``trellis_matvec`` (trellis
codes) runs here on both: its CUDA kernel (csrc/trellis.cu) is the only GPU kernel for them. Decode, small batches and short prompts take it (M <= MAX_M rows
of x on the CPU, GPU_MAX_M on the GPU); longer inputs keep the dense path (vqpipe/layers/qlinear.py ``dense_forward``),
whose trellis weights ``trellis_decode`` writes (CPU and CUDA) without MLX's uint32 temporaries.

When the module is missing (not built, or the build failed) everything runs on MLX ops as before,
with one warning per process naming what is missing.
"""

import contextlib
import math
import warnings

import mlx.core as mx

from ..codec import trellis

try:
    from .. import _ext
except ImportError as error:  # not built: vqpipe runs on MLX ops
    _ext, _missing = None, error
else:
    _missing = None

# Rows of x (product of the leading dims) up to which the CPU takes the extension; above it the
# dense path. Measured on SmolLM2's gate|up and down (docs/ext.md, experiments/ext_decode.py
# --threshold): the scalar kernel 2.6-3.1x faster at M = 64, even with the dense path at M = 128;
# the trellis kernel against the dense path with trellis_decode crosses at ~50 rows, 1.07-1.13x its
# time at 64 (docs/results/2026-12-07-trellis-decode/): one limit for both.
MAX_M = 64
DTYPES = (mx.float32, mx.float16, mx.bfloat16)
# Rows of x up to which a trellis layer on the GPU takes the CUDA kernel (one block row per 8 rows,
# each decoding every code again); above it the dense path, its weight written by trellis_decode.
# On an H100 (qwen2.5-0.5b's shapes, whole prefill) the kernel took 0.74-0.86x the dense path's time
# up to 64 rows, 1.05x at 96, 1.30x at 128 (docs/results/2026-12-07-h100-row-limit/).
GPU_MAX_M = 64
_has_gpu = _ext is not None and _ext.has_gpu()
_warned = False
_enabled = True  # off only inside ``using(False)`` (benchmarks, tests: the dense arm)


def available():
    """Whether ``vqpipe._ext`` imported."""
    return _ext is not None


def module():
    return _ext


def _warn_missing():
    global _warned
    if not _warned:
        _warned = True
        warnings.warn(
            f"vqpipe._ext is not built ({_missing}); the CPU decode path rebuilds dense weights "
            "per token (slow). Build it with scripts/build_ext.sh (scripts/setup.sh does).",
            RuntimeWarning,
            stacklevel=3,
        )


def dispatch(x):
    """Whether a layer's call on ``x`` runs here: the CPU is the default device, 1 <= M <= MAX_M
    and x is float32/float16/bfloat16. Runs per layer per token, so it is kept cheap."""
    shape = x.shape
    if not _enabled or not 0 < math.prod(shape[:-1]) <= MAX_M or x.dtype not in DTYPES:
        return False
    if mx.default_device() != mx.cpu:
        return False
    if _ext is None:
        _warn_missing()
        return False
    return True


def gpu_dispatch(x):
    """Whether a trellis layer's call on ``x`` runs the extension's CUDA kernel (csrc/trellis.cu):
    a GPU default device, a CUDA build of the module, 1 <= M <= GPU_MAX_M, a float dtype. (Scalar
    codes on the GPU go to vqpipe/kernels/qmv.py instead.)"""
    if not _has_gpu or not _enabled or not 0 < math.prod(x.shape[:-1]) <= GPU_MAX_M or x.dtype not in DTYPES:
        return False
    return mx.default_device() != mx.cpu


def decode_dispatch():
    """Whether a trellis weight's dense values are decoded here (ext.trellis_decode): the module
    built, not switched off, and the default device the CPU or, in a CUDA build, the GPU."""
    if _ext is None or not _enabled:
        return False
    return _has_gpu or mx.default_device() == mx.cpu


@contextlib.contextmanager
def using(flag):
    """``with ext.using(False): ...`` runs the block on the dense path (an A/B arm)."""
    global _enabled
    previous, _enabled = _enabled, bool(flag)
    try:
        yield
    finally:
        _enabled = previous


def matvec(xr, packed, scales, codebook, bits, bias=None, group_size=None):
    """``s * (C[q] @ xr) + b`` along xr's last axis, in xr's dtype (float32 accumulation)."""
    if _ext is None:
        raise RuntimeError(f"vqpipe._ext is not built ({_missing}); run scripts/build_ext.sh")
    return _ext.codebook_matvec(xr, packed, scales, codebook, bits, group_size or 0, bias)


def trellis_decode(packed, bits, L, code_scale, cols, dtype):
    """The code values [rows, cols] (no scales) of a trellis weight in ``dtype``, as the mat-vec
    reads them (the table's values, to the bit): prefill's dense weight without MLX's uint32
    temporaries."""
    a, b = trellis.code_affine(L, code_scale)
    return _ext.trellis_decode(packed, bits, L, float(a), float(b), cols, dtype)


def trellis_matvec(xr, packed, scales, bits, L, code_scale, bias=None):
    """``s * (C @ xr) + b`` of a trellis layer (vqpipe/codec/trellis.py) along xr's last axis, in
    xr's dtype: the compiled mat-vec, which computes each state's 1MAD value (the table's, to the bit)."""
    if _ext is None:
        raise RuntimeError(f"vqpipe._ext is not built ({_missing}); run scripts/build_ext.sh")
    a, b = trellis.code_affine(L, code_scale)
    return _ext.trellis_matvec(xr, packed, scales, bits, L, float(a), float(b), bias)
