"""Fused KIVI fake-quant kernels: one kernel description, a thin Metal/CUDA dialect layer, dispatch.

Each kernel reads its input once and writes x_hat (x's dtype and shape) plus float32 scale and zero, with
exactly the operations of :mod:`vqpipe.kivi.quant` in the same order, so outputs match the
reference bit for bit on the same device.

- keys (per channel): one thread owns one whole group of G tokens of one channel; consecutive threads
  take consecutive channels, so each warp/SIMD group reads 32 adjacent elements per token. No
  reduction across threads, no barriers, no transpose.
- values (per token): one 32-lane warp/SIMD group per group of G channels; lane i holds channels
  i, i+32, ...; min and max by an xor-shuffle butterfly. The bounds check is on the group index,
  which all 32 lanes share, so a warp exits whole and no lane shuffles with one that has left.
  Lanes past a ragged group's end load its last element (edge padding).
- kv: one whole flush in one launch, the keys body on the first threadgroups and the values body on
  the rest (what the cache uses: per layer and flush, one launch instead of two).

Shapes reach the kernel at run time through ``x_shape`` (MLX passes it as a kernel argument);
only dtype, bits and G are template arguments, so the number of compiled kernels is bounded by
the (kind, dtype, bits, G) combinations used and does not grow with the sequence length.
"""

import functools
import hashlib
import os
import re

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
    float xs[G];
    float lo = static_cast<float>(x[base]);
    float hi = lo;
    KV_UNROLL
    for (int t = 0; t < G; ++t) {
        // a ragged group repeats its last token (edge padding)
        xs[t] = static_cast<float>(x[base + kv_umin((unsigned int)t, n - 1) * D]);
        lo = kv_min(lo, xs[t]);
        hi = kv_max(hi, xs[t]);
    }
    const float qmax = (float)((1 << BITS) - 1);
    const float scale = kv_div(kv_sub(hi, lo), qmax);
    const float safe = scale == 0.0f ? 1.0f : scale;
    KV_UNROLL
    for (int t = 0; t < G; ++t) {
        if ((unsigned int)t < n) {
            float q = kv_rint(kv_div(kv_sub(xs[t], lo), safe));
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
    float xs[PER];
    float lo = 0.0f;
    float hi = 0.0f;
    KV_UNROLL
    for (int p = 0; p < PER; ++p) {
        // lanes past the end of a ragged group load its last element (edge padding)
        xs[p] = static_cast<float>(x[base + kv_umin(lane + 32u * p, n - 1)]);
        lo = p == 0 ? xs[p] : kv_min(lo, xs[p]);
        hi = p == 0 ? xs[p] : kv_max(hi, xs[p]);
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
    for (int p = 0; p < PER; ++p) {
        const unsigned int c = lane + 32u * p;
        if (c < n) {
            float q = kv_rint(kv_div(kv_sub(xs[p], lo), safe));
            q = kv_min(kv_max(q, 0.0f), qmax);
            out[base + c] = static_cast<T>(kv_add(kv_mul(q, scale), lo));
        }
    }
    if (lane == 0) {
        out_scale[w] = scale;
        out_zero[w] = lo;
    }
"""


def _rename(body, names):
    for old, new in names.items():
        body = re.sub(rf"\b{old}\b", new, body)
    return body


def _io(prefix):
    names = ("x", "x_shape", "out", "out_scale", "out_zero")
    return dict(zip(names, (prefix, f"{prefix}_shape", f"{prefix}_out", f"{prefix}_scale", f"{prefix}_zero")))


# One flush in one launch: the first KT threads run the keys body on k, the rest the values body on
# v. KT is rounded up to whole threadgroups, so no warp straddles the two halves and the values
# body's per-warp exit stays uniform.
_KV = (
    "    const unsigned int gtid = KV_TID;\n"
    "    const unsigned int KT = ((unsigned int)(k_shape[0] * k_shape[1]) * ((k_shape[2] + G - 1) / G)"
    f" * k_shape[3] + {THREADS - 1}u) / {THREADS}u * {THREADS}u;\n"
    "    if (gtid < KT) {\n"
    + _rename(_KEYS, {"KV_TID": "gtid", **_io("k")})
    + "    } else {\n"
    + _rename(_VALUES, {"KV_TID": "(gtid - KT)", **_io("v")})
    + "    }\n"
)

SOURCES = {"keys": _KEYS, "values": _VALUES, "kv": _KV}
IO_NAMES = {
    "keys": (["x"], ["out", "out_scale", "out_zero"]),
    "values": (["x"], ["out", "out_scale", "out_zero"]),
    "kv": (["k", "v"], ["k_out", "k_scale", "k_zero", "v_out", "v_scale", "v_zero"]),
}

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
        inputs, outputs = IO_NAMES[kind]
        _kernels[key] = make(name=name, input_names=inputs, output_names=outputs, source=body, header=header)
    return _kernels[key]


def _geometry(kind, shape, group_size):
    """(threads, scale/zero shape) of the keys or values kernel on a [B, H, S, D] input."""
    if len(shape) != 4:
        raise ValueError(f"kernels take [B, H, S, D], got shape {tuple(shape)}")
    b, h, s, d = shape
    if b * h * s * d >= 2**31:
        raise ValueError("kernels index with 32-bit integers; split the input")
    if kind == "keys":
        ng = -(-s // group_size)
        return b * h * ng * d, (b, h, ng, d)
    ng = -(-d // group_size)
    return b * h * s * ng * WARP, (b, h, s, ng)


@functools.lru_cache(maxsize=512)
def launch_spec(kind, shape, dtype, bits, group_size):
    """Template arguments, grid, threadgroup and output shapes for a launch (cached; read-only).
    ``shape`` is the input's shape, or for ``kind="kv"`` the pair (keys shape, values shape).
    Only the template arguments select a compiled kernel, and they hold no shape."""
    quant._qmax(bits)
    if kind in ("keys", "values"):
        threads, params = _geometry(kind, shape, group_size)
        out_shapes, out_dtypes = [tuple(shape), params, params], [dtype, mx.float32, mx.float32]
    elif kind == "kv":
        kshape, vshape = shape
        if kshape[2] != vshape[2]:
            raise ValueError(f"keys and values hold different token counts: {kshape} vs {vshape}")
        kt, kp = _geometry("keys", kshape, group_size)
        vt, vp = _geometry("values", vshape, group_size)
        threads = -(-kt // THREADS) * THREADS + vt
        out_shapes = [tuple(kshape), kp, kp, tuple(vshape), vp, vp]
        out_dtypes = [dtype, mx.float32, mx.float32] * 2
    else:
        raise ValueError(f"kind must be 'keys', 'values' or 'kv', got {kind!r}")
    if threads >= 2**31:
        raise ValueError("kernels index with 32-bit integers; split the input")
    return {
        "template": [("T", dtype), ("BITS", int(bits)), ("G", int(group_size))],
        "grid": (max(threads, 1), 1, 1),
        "threadgroup": (THREADS, 1, 1),
        "output_shapes": out_shapes,
        "output_dtypes": out_dtypes,
    }


def _launch(kind, inputs, shape, bits, group_size):
    dtype = inputs[0].dtype
    spec = launch_spec(kind, shape, dtype, int(bits), int(group_size))
    if any(x.size == 0 for x in inputs):
        return tuple(mx.zeros(s, t) for s, t in zip(spec["output_shapes"], spec["output_dtypes"]))
    dialect = backend()
    _instances.add((dialect, kind, str(dtype), int(bits), int(group_size)))
    return tuple(_kernel(dialect, kind)(inputs=inputs, **spec))


def fake_quant_keys(x, bits=4, group_size=32, use_kernels=None):
    """Keys per channel: ``(x_hat, scale, zero)`` as :func:`vqpipe.kivi.quant.fake_quant_keys`,
    from the fused kernel when active (x must be [B, H, S, D]), else from the reference ops."""
    if kernels_active(use_kernels):
        return _launch("keys", [x], tuple(x.shape), bits, group_size)
    return quant.fake_quant_keys(x, bits, group_size)


def fake_quant_values(x, bits=4, group_size=32, use_kernels=None):
    """Values per token: ``(x_hat, scale, zero)`` as :func:`vqpipe.kivi.quant.fake_quant_values`."""
    if kernels_active(use_kernels):
        return _launch("values", [x], tuple(x.shape), bits, group_size)
    return quant.fake_quant_values(x, bits, group_size)


def fake_quant_kv(k, v, bits=4, group_size=32, use_kernels=None):
    """One flush: ``(fake_quant_keys(k), fake_quant_values(v))``, in a single launch when kernels
    are active (k and v: [B, H, S, D] with the same S and dtype; D may differ)."""
    if kernels_active(use_kernels):
        if k.dtype != v.dtype:
            raise ValueError(f"keys and values dtypes differ: {k.dtype} vs {v.dtype}")
        out = _launch("kv", [k, v], (tuple(k.shape), tuple(v.shape)), bits, group_size)
        return out[:3], out[3:]
    return quant.fake_quant_keys(k, bits, group_size), quant.fake_quant_values(v, bits, group_size)
