"""Fused KIVI fake-quant kernels: one kernel description, a thin Metal/CUDA dialect layer, dispatch.

Each kernel reads its input once and writes x_hat (x's dtype and shape), and float32 scale and zero
unless it is the cache's x_hat-only flush, with exactly the operations of :mod:`vqpipe.kivi.quantizer`
in the same order, so outputs match the reference bit for bit on the same device.

- keys (per channel): one thread owns one whole group of G tokens of one channel; consecutive threads
  take consecutive channels, so each warp/SIMD group reads 32 adjacent elements per token. No
  reduction across threads, no barriers, no transpose.
- values (per token): min and max of each group of G channels by an xor-shuffle butterfly inside a
  warp/SIMD group, in one of two layouts (below). Warps exit whole (the bounds check is on what all
  their lanes share), so no lane shuffles with one that has left. Lanes past a ragged group's end
  load its last element (edge padding).
- kv: one whole flush in one launch, the keys body on the first threadgroups and the values body on
  the rest; kv_hat: the same without the scale and zero outputs, what the cache runs (per layer and
  flush, one launch with two outputs).

Two layouts of the values body (``set_layout``; the keys body is shared):

- "vec" (the default): L lanes per group, the power of two that covers the group in 16-byte chunks
  (4 for fp16 and G = 32), each lane one 16-byte load; a warp takes 32 / L groups.
- "warp": one 32-lane warp per group, lane i holding channels i, i+32, ... (the first design; at
  S = 2048 on an H200 its fused flush took 1.3x the time of "vec", docs/kivi.md).

Shapes reach the kernel at run time through ``x_shape`` (MLX passes it as a kernel argument);
only dtype, bits and G are template arguments, so the number of compiled kernels is bounded by
the (kind, layout, dtype, bits, G) combinations used and does not grow with the sequence length.
"""

import hashlib
import os
import re

import mlx.core as mx

from .. import gpu
from ..kernels import cuda_cache
from ..gpu import backend
from . import quantizer

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


# "vec" values: fewer, fuller threads than _VALUES, vector loads. (Both layouts keep _KEYS: its 32
# loads per thread in flight keep the keys half fast, and wider key threads need more registers,
# which in the fused kernel lower the occupancy of the values half too; measured in docs/kivi.md.)
# L lanes per group (the power of two >= the group's 16-byte chunks, at most 32), each lane
# holding PER chunks of E = 16 / sizeof(T) consecutive channels (one 16-byte load when the group is
# aligned and whole); min and max by an xor butterfly over the L lanes of the group; a warp takes
# 32 / L consecutive groups. A warp exits only when all its groups are past the end; a slot past the
# end repeats the last group (valid loads, same shuffles) and writes nothing. Chunks past a ragged
# group's end load its last element (edge padding).
_VALUES_VEC = """
    const unsigned int tid = KV_TID;
    const unsigned int lane = tid % 32u;
    const unsigned int w = tid / 32u;
    constexpr unsigned int E = 16u / sizeof(T);  // channels per 16-byte chunk
    constexpr unsigned int CH = (G + E - 1u) / E;  // chunks per group
    constexpr unsigned int L = CH > 16u ? 32u : CH > 8u ? 16u : CH > 4u ? 8u : CH > 2u ? 4u : CH > 1u ? 2u : 1u;
    constexpr unsigned int PER = (CH + L - 1u) / L;  // chunks per lane
    constexpr unsigned int GW = 32u / L;  // groups per warp
    const unsigned int D = x_shape[3];
    const unsigned int NG = (D + G - 1) / G;
    const unsigned int NT = (unsigned int)(x_shape[0] * x_shape[1] * x_shape[2]) * NG;  // groups
    // uniform per warp: every lane of a warp has the same w
    if (w * GW >= NT) {
        return;
    }
    const unsigned int slot = w * GW + lane / L;  // this lane's group
    const unsigned int sl = lane % L;  // this lane's place in the group
    const unsigned int q = kv_umin(slot, NT - 1u);  // slots past the end repeat the last group
    const unsigned int c0 = (q % NG) * G;
    const unsigned int n = kv_umin((unsigned int)G, D - c0);
    const unsigned int base = (q / NG) * D + c0;
    const bool vec = (D % E == 0u) && (G % E == 0u) && kv_aligned(x, E) && kv_aligned(out, E);
    float xs[PER][E];
    KV_UNROLL
    for (unsigned int p = 0; p < PER; ++p) {
        kv_loadn<E>(x + base, (p * L + sl) * E, n, vec, xs[p]);
    }
    float lo = xs[0][0];
    float hi = lo;
    KV_UNROLL
    for (unsigned int p = 0; p < PER; ++p) {
        KV_UNROLL
        for (unsigned int e = 0; e < E; ++e) {
            lo = kv_min(lo, xs[p][e]);
            hi = kv_max(hi, xs[p][e]);
        }
    }
    KV_UNROLL
    for (unsigned int m = L / 2u; m > 0u; m /= 2u) {
        lo = kv_min(lo, kv_shfl_xor(lo, m));
        hi = kv_max(hi, kv_shfl_xor(hi, m));
    }
    const float qmax = (float)((1 << BITS) - 1);
    const float scale = kv_div(kv_sub(hi, lo), qmax);
    const float safe = scale == 0.0f ? 1.0f : scale;
    if (slot < NT) {
        KV_UNROLL
        for (unsigned int p = 0; p < PER; ++p) {
            float o[E];
            KV_UNROLL
            for (unsigned int e = 0; e < E; ++e) {
                float qq = kv_rint(kv_div(kv_sub(xs[p][e], lo), safe));
                qq = kv_min(kv_max(qq, 0.0f), qmax);
                o[e] = kv_add(kv_mul(qq, scale), lo);
            }
            kv_storen<E>(out + base, (p * L + sl) * E, n, vec, o);
        }
        if (sl == 0u) {
            out_scale[slot] = scale;
            out_zero[slot] = lo;
        }
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
def _kv_source(keys, values, keys_threads):
    return (
        "    const unsigned int gtid = KV_TID;\n"
        f"    const unsigned int KT = ({keys_threads} + {THREADS - 1}u) / {THREADS}u * {THREADS}u;\n"
        "    if (gtid < KT) {\n"
        + _rename(keys, {"KV_TID": "gtid", **_io("k")})
        + "    } else {\n"
        + _rename(values, {"KV_TID": "(gtid - KT)", **_io("v")})
        + "    }\n"
    )


_KEY_ROWS = "(unsigned int)(k_shape[0] * k_shape[1]) * ((k_shape[2] + G - 1) / G)"


def _hat_only(body):
    """The body without its scale and zero stores (every line naming out_scale or out_zero): the
    flush as the cache runs it, which keeps only x_hat. Each output is an allocation and a graph
    node per launch, host time that a decode step pays per layer."""
    return "".join(line for line in body.splitlines(True) if "out_scale" not in line and "out_zero" not in line)


def _layout_sources(keys, values, key_threads_per_row):
    threads = f"{_KEY_ROWS} * {key_threads_per_row}"
    return {
        "keys": keys,
        "values": values,
        "kv": _kv_source(keys, values, threads),
        "kv_hat": _kv_source(_hat_only(keys), _hat_only(values), threads),
    }


LAYOUTS = ("vec", "warp")
LAYOUT_SOURCES = {
    "vec": _layout_sources(_KEYS, _VALUES_VEC, "k_shape[3]"),
    "warp": _layout_sources(_KEYS, _VALUES, "k_shape[3]"),
}
IO_NAMES = {
    "keys": (["x"], ["out", "out_scale", "out_zero"]),
    "values": (["x"], ["out", "out_scale", "out_zero"]),
    "kv": (["k", "v"], ["k_out", "k_scale", "k_zero", "v_out", "v_scale", "v_zero"]),
    "kv_hat": (["k", "v"], ["k_out", "v_out"]),
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

# Only the "vec" layout gets these. N consecutive elements g[c .. c+N-1] of one row: one 8- or
# 16-byte access when vec (the caller has checked alignment) and all N exist (c + N <= n);
# otherwise scalar accesses, a load past the end repeating g[n - 1] (edge padding), a store past the
# end skipped. Conversions are exact to float and round to nearest even back, as static_cast.
_CUDA_VEC_HEADER = """
template <typename U> __device__ __forceinline__ bool kv_aligned(const U* p, unsigned int n) {
    return (reinterpret_cast<unsigned long long>(p) & ((unsigned long long)n * sizeof(U) - 1ull)) == 0ull;
}
__device__ __forceinline__ void kv_words(const void* p, unsigned int (&w)[2]) {
    const uint2 v = *reinterpret_cast<const uint2*>(p);
    w[0] = v.x;
    w[1] = v.y;
}
__device__ __forceinline__ void kv_words(const void* p, unsigned int (&w)[4]) {
    const uint4 v = *reinterpret_cast<const uint4*>(p);
    w[0] = v.x;
    w[1] = v.y;
    w[2] = v.z;
    w[3] = v.w;
}
__device__ __forceinline__ void kv_put_words(void* p, const unsigned int (&w)[2]) { *reinterpret_cast<uint2*>(p) = make_uint2(w[0], w[1]); }
__device__ __forceinline__ void kv_put_words(void* p, const unsigned int (&w)[4]) {
    *reinterpret_cast<uint4*>(p) = make_uint4(w[0], w[1], w[2], w[3]);
}
__device__ __forceinline__ void kv_unword(unsigned int w, float* o, const float*) { o[0] = __uint_as_float(w); }
__device__ __forceinline__ void kv_unword(unsigned int w, float* o, const __half*) {
    const float2 f = __half22float2(*reinterpret_cast<const __half2*>(&w));
    o[0] = f.x;
    o[1] = f.y;
}
__device__ __forceinline__ void kv_unword(unsigned int w, float* o, const __nv_bfloat16*) {
    const float2 f = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&w));
    o[0] = f.x;
    o[1] = f.y;
}
__device__ __forceinline__ unsigned int kv_word(const float* o, const float*) { return __float_as_uint(o[0]); }
__device__ __forceinline__ unsigned int kv_word(const float* o, const __half*) {
    const __half2 h = __floats2half2_rn(o[0], o[1]);
    return *reinterpret_cast<const unsigned int*>(&h);
}
__device__ __forceinline__ unsigned int kv_word(const float* o, const __nv_bfloat16*) {
    const __nv_bfloat162 h = __floats2bfloat162_rn(o[0], o[1]);
    return *reinterpret_cast<const unsigned int*>(&h);
}
template <int N, typename U>
__device__ __forceinline__ void kv_loadn(const U* g, unsigned int c, unsigned int n, bool vec, float* o) {
    constexpr int PW = 4 / sizeof(U);  // elements per 32-bit word
    if (vec && c + N <= n) {
        unsigned int w[N / PW];
        kv_words(g + c, w);
        #pragma unroll
        for (int i = 0; i < N / PW; ++i) {
            kv_unword(w[i], o + i * PW, g);
        }
    } else {
        #pragma unroll
        for (int i = 0; i < N; ++i) {
            o[i] = static_cast<float>(g[c + i < n ? c + i : n - 1]);
        }
    }
}
template <int N, typename U>
__device__ __forceinline__ void kv_storen(U* g, unsigned int c, unsigned int n, bool vec, const float* o) {
    constexpr int PW = 4 / sizeof(U);
    if (vec && c + N <= n) {
        unsigned int w[N / PW];
        #pragma unroll
        for (int i = 0; i < N / PW; ++i) {
            w[i] = kv_word(o + i * PW, g);
        }
        kv_put_words(g + c, w);
    } else {
        #pragma unroll
        for (int i = 0; i < N; ++i) {
            if (c + i < n) {
                g[c + i] = static_cast<U>(o[i]);
            }
        }
    }
}
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

_METAL_VEC_HEADER = """
// "vec" layout: N consecutive elements as scalar accesses (vec is ignored; Apple GPUs merge adjacent
// accesses of a SIMD group); a load past the end repeats g[n - 1], a store past the end is skipped.
template <typename U> inline bool kv_aligned(const device U* p, uint n) { return true; }
template <int N, typename U> inline void kv_loadn(const device U* g, uint c, uint n, bool vec, thread float* o) {
    for (int i = 0; i < N; ++i) {
        o[i] = static_cast<float>(g[c + i < n ? c + i : n - 1]);
    }
}
template <int N, typename U> inline void kv_storen(device U* g, uint c, uint n, bool vec, const thread float* o) {
    for (int i = 0; i < N; ++i) {
        if (c + i < n) {
            g[c + i] = static_cast<U>(o[i]);
        }
    }
}
"""

DIALECTS = {
    "cuda": {
        "header": _CUDA_HEADER,
        "layout_headers": {"warp": "", "vec": _CUDA_VEC_HEADER},
        "tokens": {
            "KV_TID": "(blockIdx.x * blockDim.x + threadIdx.x)",
            "KV_UNROLL": "#pragma unroll",
        },
    },
    "metal": {
        "header": _METAL_HEADER,
        "layout_headers": {"warp": "", "vec": _METAL_VEC_HEADER},
        "tokens": {"KV_TID": "thread_position_in_grid.x", "KV_UNROLL": "#pragma unroll"},
    },
}

_kernels = {}  # (dialect, kind, layout) -> MLX kernel object, built once
_instances = set()  # (dialect, kind, layout, dtype, bits, G): one JIT-compiled kernel each
_enabled = None  # the switch; VQPIPE_KIVI_KERNELS=0 (read at the first call) turns it off
_layout = "vec"


def _check_layout(name):
    if name not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {name!r}")
    return name


def layout():
    """The kernel layout calls use when they pass none: "vec" unless changed by :func:`set_layout`."""
    return _layout


def set_layout(name):
    """Pick the kernel layout ("vec" or "warp"). Returns the previous one. Both give the same bytes; only speed differs."""
    global _layout
    previous, _layout = _layout, _check_layout(name)
    return previous


def render(kind, dialect, layout="vec"):
    """(name, header, body) for one kernel in one dialect and layout. The name carries a digest of
    the source: MLX caches compiled kernels (in memory and as PTX on disk) by name alone."""
    spec = DIALECTS[dialect]
    body = LAYOUT_SOURCES[_check_layout(layout)][kind]
    for token, text in spec["tokens"].items():
        body = body.replace(token, text)
    header = spec["header"] + spec["layout_headers"][layout]
    digest = hashlib.sha1((header + body).encode()).hexdigest()[:10]
    return f"kivi_{kind}_{layout}_{digest}", header, body


def set_enabled(flag):
    """Global switch (also ``VQPIPE_KIVI_KERNELS=0``). Returns the previous setting."""
    global _enabled
    previous, _enabled = is_enabled(), bool(flag)
    return previous


def is_enabled():
    global _enabled
    if _enabled is None:
        _enabled = os.environ.get("VQPIPE_KIVI_KERNELS", "1") != "0"
    return _enabled


def kernels_active(use_kernels=None):
    """Whether a call with ``use_kernels`` runs a fused kernel: None follows the global switch and
    the backend; True insists (raises if there is no GPU backend); False never."""
    return gpu.active(use_kernels, is_enabled(), backend(), "KIVI kernels")


def compiled_kernel_count():
    """Distinct kernels compiled so far (one per kind, layout, dtype, bits, G)."""
    return len(_instances)


def _kernel(dialect, kind, layout):
    key = (dialect, kind, layout)
    if key not in _kernels:
        name, header, body = render(kind, dialect, layout)
        make = mx.fast.metal_kernel if dialect == "metal" else cuda_cache.cuda_kernel
        inputs, outputs = IO_NAMES[kind]
        _kernels[key] = make(name=name, input_names=inputs, output_names=outputs, source=body, header=header)
    return _kernels[key]


def _vec_lanes(group_size, itemsize):
    """Lanes per group in the "vec" values kernel: the power of two >= its 16-byte chunks, <= 32."""
    chunks = -(-group_size // (16 // itemsize))
    return min(WARP, 1 << (chunks - 1).bit_length())


def _geometry(kind, shape, group_size, layout="vec", itemsize=2):
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
    if layout == "vec":  # 32 / L groups per warp (see _VALUES_VEC)
        per_warp = WARP // _vec_lanes(group_size, itemsize)
        return -(-(b * h * s * ng) // per_warp) * WARP, (b, h, s, ng)
    return b * h * s * ng * WARP, (b, h, s, ng)


def launch_spec(kind, shape, dtype, bits, group_size, layout="vec"):
    """Template arguments, grid, threadgroup and output shapes for a launch.
    ``shape`` is the input's shape, or for ``kind="kv"`` the pair (keys shape, values shape).
    Only the template arguments select a compiled kernel, and they hold no shape."""
    quantizer._qmax(bits)
    _check_layout(layout)
    if kind in ("keys", "values"):
        threads, params = _geometry(kind, shape, group_size, layout, dtype.size)
        out_shapes, out_dtypes = [tuple(shape), params, params], [dtype, mx.float32, mx.float32]
    elif kind in ("kv", "kv_hat"):
        kshape, vshape = shape
        if kshape[2] != vshape[2]:
            raise ValueError(f"keys and values hold different token counts: {kshape} vs {vshape}")
        kt, kp = _geometry("keys", kshape, group_size, layout, dtype.size)
        vt, vp = _geometry("values", vshape, group_size, layout, dtype.size)
        threads = -(-kt // THREADS) * THREADS + vt
        if kind == "kv":
            out_shapes = [tuple(kshape), kp, kp, tuple(vshape), vp, vp]
            out_dtypes = [dtype, mx.float32, mx.float32] * 2
        else:
            out_shapes, out_dtypes = [tuple(kshape), tuple(vshape)], [dtype, dtype]
    else:
        raise ValueError(f"kind must be 'keys', 'values', 'kv' or 'kv_hat', got {kind!r}")
    if threads >= 2**31:
        raise ValueError("kernels index with 32-bit integers; split the input")
    return {
        "template": [("T", dtype), ("BITS", int(bits)), ("G", int(group_size))],
        "grid": (max(threads, 1), 1, 1),
        "threadgroup": (THREADS, 1, 1),
        "output_shapes": out_shapes,
        "output_dtypes": out_dtypes,
    }


_plans = {}  # (kind, shape, dtype, bits, G, layout, dialect) -> (kernel or None if empty, spec)
_MAX_PLANS = 512  # one per flush size and model shape in use; emptied when full


def _launch(kind, inputs, shape, bits, group_size, layout=None):
    # Runs once per layer and flush: everything that depends only on the key is looked up once.
    key = (kind, shape, inputs[0].dtype, bits, group_size, _layout if layout is None else layout, backend())
    plan = _plans.get(key)
    if plan is None:
        kind, shape, dtype, bits, group_size, layout, dialect = key
        spec = launch_spec(kind, shape, dtype, int(bits), int(group_size), _check_layout(layout))
        kernel = None
        if all(x.size for x in inputs):
            _instances.add((dialect, kind, layout, str(dtype), int(bits), int(group_size)))
            kernel = _kernel(dialect, kind, layout)
        if len(_plans) >= _MAX_PLANS:
            _plans.clear()
        plan = _plans[key] = (kernel, spec)
    kernel, spec = plan
    if kernel is None:  # an empty input: nothing to launch
        return tuple(mx.zeros(s, t) for s, t in zip(spec["output_shapes"], spec["output_dtypes"]))
    return tuple(kernel(inputs=inputs, **spec))


def fake_quant_keys(x, bits=4, group_size=32, use_kernels=None, layout=None):
    """Keys per channel: ``(x_hat, scale, zero)`` as :func:`vqpipe.kivi.quantizer.fake_quant_keys`,
    from the fused kernel when active (x must be [B, H, S, D]), else from the reference ops.
    ``layout`` picks the kernel layout (None: :func:`layout`)."""
    if kernels_active(use_kernels):
        return _launch("keys", [x], tuple(x.shape), bits, group_size, layout)
    return quantizer.fake_quant_keys(x, bits, group_size)


def fake_quant_values(x, bits=4, group_size=32, use_kernels=None, layout=None):
    """Values per token: ``(x_hat, scale, zero)`` as :func:`vqpipe.kivi.quantizer.fake_quant_values`."""
    if kernels_active(use_kernels):
        return _launch("values", [x], tuple(x.shape), bits, group_size, layout)
    return quantizer.fake_quant_values(x, bits, group_size)


def fake_quant_kv_hat(k, v, bits=4, group_size=32, use_kernels=None, layout=None):
    """One flush as the cache runs it: ``(k_hat, v_hat)``, the x_hat of :func:`fake_quant_kv` alone,
    in a single launch with two outputs when kernels are active."""
    if kernels_active(use_kernels):
        if k.dtype != v.dtype:
            raise ValueError(f"keys and values dtypes differ: {k.dtype} vs {v.dtype}")
        return _launch("kv_hat", [k, v], (tuple(k.shape), tuple(v.shape)), bits, group_size, layout)
    return quantizer.fake_quant_keys(k, bits, group_size)[0], quantizer.fake_quant_values(v, bits, group_size)[0]


def fake_quant_kv(k, v, bits=4, group_size=32, use_kernels=None, layout=None):
    """One flush: ``(fake_quant_keys(k), fake_quant_values(v))``, in a single launch when kernels
    are active (k and v: [B, H, S, D] with the same S and dtype; D may differ)."""
    if kernels_active(use_kernels):
        if k.dtype != v.dtype:
            raise ValueError(f"keys and values dtypes differ: {k.dtype} vs {v.dtype}")
        out = _launch("kv", [k, v], (tuple(k.shape), tuple(v.shape)), bits, group_size, layout)
        return out[:3], out[3:]
    return quantizer.fake_quant_keys(k, bits, group_size), quantizer.fake_quant_values(v, bits, group_size)
