"""Fused KIVI fake-quant kernels: one kernel description, a thin Metal/CUDA dialect layer, dispatch.

Each kernel reads x once and writes x_hat (x's dtype and shape) plus float32 scale and zero, with
exactly the operations of :mod:`vqpipe.kivi.quant` in the same order, so outputs match the
reference bit for bit on the same device.

- keys (per channel): one thread owns one whole group of G tokens of one channel; consecutive threads
  take consecutive channels, so each warp/SIMD group reads 32 adjacent elements per token. No
  reduction across threads, no barriers, no transpose.
- values (per token): one 32-lane warp/SIMD group per group of G channels; lane i holds channels
  i, i+32, ...; min and max by an xor-shuffle butterfly. The bounds check is on the group index,
  which all 32 lanes share, so a warp exits whole and no lane shuffles with one that has left.
  Lanes past a ragged group's end load its last element (edge padding).

Shapes reach the kernel at run time through ``x_shape`` (MLX passes it as a kernel argument);
only dtype, bits and G are template arguments, so the number of compiled kernels is bounded by
the (kind, dtype, bits, G) combinations used and does not grow with the sequence length.
"""

import functools
import hashlib
import os

import mlx.core as mx

from . import quant

WARP = 32
THREADS = 256

# The kernel description. Dialect tokens: KV_TID (global thread index; substituted in Python so
# Metal sees its attribute name in the source), KV_UNROLL; helpers kv_* come from the dialect header.
_KEYS = """
    const unsigned int tid = KV_TID;
    const unsigned int S = x_shape[2];
    const unsigned int D = x_shape[3];
    const unsigned int NG = (S + G - 1) / G;
    if (tid >= (unsigned int)(x_shape[0] * x_shape[1]) * NG * D) {
        return;
    }
    const unsigned int d = tid % D;
    const unsigned int r = tid / D;  // (b * H + h) * NG + g
    const unsigned int g = r % NG;
    const unsigned int t0 = g * G;
    const unsigned int n = kv_umin((unsigned int)G, S - t0);
    const unsigned int base = ((r / NG) * S + t0) * D + d;
    float v[G];
    float lo = static_cast<float>(x[base]);
    float hi = lo;
    KV_UNROLL
    for (int t = 0; t < G; ++t) {
        // a ragged group repeats its last token (edge padding)
        v[t] = static_cast<float>(x[base + kv_umin((unsigned int)t, n - 1) * D]);
        lo = kv_min(lo, v[t]);
        hi = kv_max(hi, v[t]);
    }
    const float qmax = (float)((1 << BITS) - 1);
    const float scale = kv_div(kv_sub(hi, lo), qmax);
    const float safe = scale == 0.0f ? 1.0f : scale;
    KV_UNROLL
    for (int t = 0; t < G; ++t) {
        if ((unsigned int)t < n) {
            float q = kv_rint(kv_div(kv_sub(v[t], lo), safe));
            q = kv_min(kv_max(q, 0.0f), qmax);
            out[base + t * D] = static_cast<T>(kv_add(kv_mul(q, scale), lo));
        }
    }
    out_scale[r * D + d] = scale;
    out_zero[r * D + d] = lo;
"""

_VALUES = """
    const unsigned int tid = KV_TID;
    const unsigned int lane = tid % 32u;
    const unsigned int w = tid / 32u;  // one group per warp: (b, h, s, j)
    const unsigned int D = x_shape[3];
    const unsigned int NG = (D + G - 1) / G;
    // uniform per warp: every lane of a warp has the same w
    if (w >= (unsigned int)(x_shape[0] * x_shape[1] * x_shape[2]) * NG) {
        return;
    }
    const unsigned int j = w % NG;
    const unsigned int c0 = j * G;
    const unsigned int n = kv_umin((unsigned int)G, D - c0);
    const unsigned int base = (w / NG) * D + c0;
    constexpr int PER = (G + 31) / 32;
    float v[PER];
    float lo = 0.0f;
    float hi = 0.0f;
    KV_UNROLL
    for (int k = 0; k < PER; ++k) {
        // lanes past the end of a ragged group load its last element (edge padding)
        v[k] = static_cast<float>(x[base + kv_umin(lane + 32u * k, n - 1)]);
        lo = k == 0 ? v[k] : kv_min(lo, v[k]);
        hi = k == 0 ? v[k] : kv_max(hi, v[k]);
    }
    KV_UNROLL
    for (int m = 16; m > 0; m /= 2) {
        lo = kv_min(lo, kv_shfl_xor(lo, m));
        hi = kv_max(hi, kv_shfl_xor(hi, m));
    }
    const float qmax = (float)((1 << BITS) - 1);
    const float scale = kv_div(kv_sub(hi, lo), qmax);
    const float safe = scale == 0.0f ? 1.0f : scale;
    KV_UNROLL
    for (int k = 0; k < PER; ++k) {
        const unsigned int c = lane + 32u * k;
        if (c < n) {
            float q = kv_rint(kv_div(kv_sub(v[k], lo), safe));
            q = kv_min(kv_max(q, 0.0f), qmax);
            out[base + c] = static_cast<T>(kv_add(kv_mul(q, scale), lo));
        }
    }
    if (lane == 0) {
        out_scale[w] = scale;
        out_zero[w] = lo;
    }
"""

SOURCES = {"keys": _KEYS, "values": _VALUES}

# min/max written as MLX's own Minimum/Maximum ops are (x < y ? x : y), so clip matches exactly.
_CUDA_HEADER = """
// NVRTC contracts a*b+c into an FMA by default; the _rn intrinsics are never contracted.
__device__ __forceinline__ float kv_add(float a, float b) { return __fadd_rn(a, b); }
__device__ __forceinline__ float kv_sub(float a, float b) { return __fsub_rn(a, b); }
__device__ __forceinline__ float kv_mul(float a, float b) { return __fmul_rn(a, b); }
__device__ __forceinline__ float kv_div(float a, float b) { return __fdiv_rn(a, b); }
__device__ __forceinline__ float kv_rint(float a) { return rintf(a); }
__device__ __forceinline__ float kv_min(float a, float b) { return a < b ? a : b; }
__device__ __forceinline__ float kv_max(float a, float b) { return a > b ? a : b; }
__device__ __forceinline__ unsigned int kv_umin(unsigned int a, unsigned int b) { return a < b ? a : b; }
__device__ __forceinline__ float kv_shfl_xor(float v, int m) { return __shfl_xor_sync(0xffffffffu, v, m); }
"""

# Untested: no Apple GPU was available. contract(off) keeps the compiler from fusing mul+add.
_METAL_HEADER = """
#pragma METAL fp math_mode(safe)
#pragma METAL fp contract(off)
inline float kv_add(float a, float b) { return a + b; }
inline float kv_sub(float a, float b) { return a - b; }
inline float kv_mul(float a, float b) { return a * b; }
inline float kv_div(float a, float b) { return a / b; }
inline float kv_rint(float a) { return metal::rint(a); }
inline float kv_min(float a, float b) { return a < b ? a : b; }
inline float kv_max(float a, float b) { return a > b ? a : b; }
inline unsigned int kv_umin(unsigned int a, unsigned int b) { return a < b ? a : b; }
inline float kv_shfl_xor(float v, int m) { return metal::simd_shuffle_xor(v, ushort(m)); }
"""

DIALECTS = {
    "cuda": {
        "header": _CUDA_HEADER,
        "tokens": {"KV_TID": "(blockIdx.x * blockDim.x + threadIdx.x)", "KV_UNROLL": "#pragma unroll"},
    },
    "metal": {
        "header": _METAL_HEADER,
        "tokens": {"KV_TID": "thread_position_in_grid.x", "KV_UNROLL": "#pragma unroll"},
    },
}

_kernels = {}  # (dialect, kind) -> MLX kernel object, built once
_instances = set()  # (dialect, kind, dtype, bits, G): one JIT-compiled kernel each
_enabled = os.environ.get("VQPIPE_KIVI_KERNELS", "1") != "0"


def render(kind, dialect):
    """(name, header, body) for one kernel in one dialect. The name carries a digest of the source:
    MLX caches compiled kernels (in memory and as PTX on disk) by name alone."""
    spec = DIALECTS[dialect]
    body = SOURCES[kind]
    for token, text in spec["tokens"].items():
        body = body.replace(token, text)
    digest = hashlib.sha1((spec["header"] + body).encode()).hexdigest()[:10]
    return f"kivi_{kind}_{digest}", spec["header"], body


def backend():
    """'metal', 'cuda' or None (no GPU backend, or the default device is the CPU)."""
    if mx.default_device() != mx.gpu:
        return None
    if mx.metal.is_available():
        return "metal"
    if mx.cuda.is_available():
        return "cuda"
    return None


def set_enabled(flag):
    """Global switch (also ``VQPIPE_KIVI_KERNELS=0``). Returns the previous setting."""
    global _enabled
    previous, _enabled = _enabled, bool(flag)
    return previous


def kernels_active(use_kernels=None):
    """Whether a call with ``use_kernels`` runs a fused kernel: None follows the global switch and
    the backend; True insists (raises if there is no GPU backend); False never."""
    if use_kernels is False or (use_kernels is None and not _enabled):
        return False
    if backend() is None:
        if use_kernels:
            raise RuntimeError("KIVI kernels need MLX's Metal or CUDA backend on the default device")
        return False
    return True


def compiled_kernel_count():
    """Distinct kernels compiled so far (one per kind, dtype, bits, G)."""
    return len(_instances)


def _kernel(dialect, kind):
    key = (dialect, kind)
    if key not in _kernels:
        name, header, body = render(kind, dialect)
        make = mx.fast.metal_kernel if dialect == "metal" else mx.fast.cuda_kernel
        _kernels[key] = make(
            name=name, input_names=["x"], output_names=["out", "out_scale", "out_zero"],
            source=body, header=header,
        )
    return _kernels[key]


@functools.lru_cache(maxsize=512)
def launch_spec(kind, shape, dtype, bits, group_size):
    """Template arguments, grid, threadgroup and output shapes for a launch (cached; read-only).
    Only the template arguments select a compiled kernel, and they hold no shape."""
    if len(shape) != 4:
        raise ValueError(f"kernels take [B, H, S, D], got shape {tuple(shape)}")
    b, h, s, d = shape
    if kind == "keys":
        ng = -(-s // group_size)
        threads = b * h * ng * d
        params = (b, h, ng, d)
    elif kind == "values":
        ng = -(-d // group_size)
        threads = b * h * s * ng * WARP
        params = (b, h, s, ng)
    else:
        raise ValueError(f"kind must be 'keys' or 'values', got {kind!r}")
    if b * h * s * d >= 2**31 or threads >= 2**31:
        raise ValueError("kernels index with 32-bit integers; split the input")
    quant._qmax(bits)
    template = [("T", dtype), ("BITS", int(bits)), ("G", int(group_size))]
    return {
        "template": template,
        "grid": (max(threads, 1), 1, 1),
        "threadgroup": (THREADS, 1, 1),
        "output_shapes": [tuple(shape), params, params],
        "output_dtypes": [dtype, mx.float32, mx.float32],
    }


def _run_kernel(kind, x, bits, group_size):
    dialect = backend()
    spec = launch_spec(kind, tuple(x.shape), x.dtype, int(bits), int(group_size))
    if x.size == 0:
        return (x, *(mx.zeros(s, mx.float32) for s in spec["output_shapes"][1:]))
    _instances.add((dialect, kind, str(x.dtype), int(bits), int(group_size)))
    return tuple(_kernel(dialect, kind)(inputs=[x], **spec))


def fake_quant_keys(x, bits=4, group_size=32, use_kernels=None):
    """Keys per channel: ``(x_hat, scale, zero)`` as :func:`vqpipe.kivi.quant.fake_quant_keys`,
    from the fused kernel when active (x must be [B, H, S, D]), else from the reference ops."""
    if kernels_active(use_kernels):
        return _run_kernel("keys", x, bits, group_size)
    return quant.fake_quant_keys(x, bits, group_size)


def fake_quant_values(x, bits=4, group_size=32, use_kernels=None):
    """Values per token: ``(x_hat, scale, zero)`` as :func:`vqpipe.kivi.quant.fake_quant_values`."""
    if kernels_active(use_kernels):
        return _run_kernel("values", x, bits, group_size)
    return quant.fake_quant_values(x, bits, group_size)
