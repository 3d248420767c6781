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

Two layouts of the same arithmetic (``set_layout`` / ``VQPIPE_KIVI_LAYOUT``; default "default"):

- "default": as above.
- "wide" (untimed alternative for the S = 2048 flush): keys, one thread owns one group of G tokens
  for two adjacent channels (one 2-element vector load and store per token where the dialect has
  them and the rows are aligned; two scalar accesses otherwise, and a lone last channel when D is
  odd); values, one warp still owns each group (same butterfly, same edge padding) but processes
  VGROUPS (4) groups, issuing all their loads before the butterflies; a warp exits only when all its
  groups are past the end, so exits stay uniform per warp.

Shapes reach the kernel at run time through ``x_shape`` (MLX passes it as a kernel argument);
only dtype, bits and G are template arguments, so the number of compiled kernels is bounded by
the (kind, dtype, bits, G) combinations used and does not grow with the sequence length.
"""

import functools
import hashlib
import os
import re

import mlx.core as mx

from .. import gpu
from ..gpu import backend
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


# "wide" layout. Keys: thread = (row, channel pair); every arithmetic step as in _KEYS, done once for
# channel d (a) and once for channel d + 1 (b). kv_load2/kv_store2 (dialect header) move two
# adjacent elements, as one vector access when `vec` holds; with `pair` false (odd D, last pair)
# only the first element is real (b repeats it and is never written).
_KEYS_WIDE = """
    const unsigned int tid = KV_TID;
    const unsigned int S = x_shape[2];
    const unsigned int D = x_shape[3];
    const unsigned int NG = (S + G - 1) / G;
    const unsigned int DP = (D + 1u) / 2u;  // channel pairs, the last one ragged when D is odd
    if (tid >= (unsigned int)(x_shape[0] * x_shape[1]) * NG * DP) {
        return;
    }
    const unsigned int d = 2u * (tid % DP);
    const unsigned int r = tid / DP;  // (b * H + h) * NG + g
    const unsigned int g = r % NG;
    const bool pair = d + 1u < D;
    // vector accesses need every row of x and out aligned to two elements (uniform for the launch)
    const bool vec = (D % 2u == 0u) && kv_aligned2(x) && kv_aligned2(out);
    const bool vec_p = (D % 2u == 0u) && kv_aligned2(out_scale) && kv_aligned2(out_zero);
    const unsigned int t0 = g * G;
    const unsigned int n = kv_umin((unsigned int)G, S - t0);
    const unsigned int base = ((r / NG) * S + t0) * D + d;
    float xa[G];
    float xb[G];
    float lo_a, lo_b;
    kv_load2(x + base, vec, pair, lo_a, lo_b);
    float hi_a = lo_a;
    float hi_b = lo_b;
    KV_UNROLL
    for (int t = 0; t < G; ++t) {
        // a ragged group repeats its last token (edge padding)
        kv_load2(x + base + kv_umin((unsigned int)t, n - 1) * D, vec, pair, xa[t], xb[t]);
        lo_a = kv_min(lo_a, xa[t]);
        hi_a = kv_max(hi_a, xa[t]);
        lo_b = kv_min(lo_b, xb[t]);
        hi_b = kv_max(hi_b, xb[t]);
    }
    const float qmax = (float)((1 << BITS) - 1);
    const float scale_a = kv_div(kv_sub(hi_a, lo_a), qmax);
    const float scale_b = kv_div(kv_sub(hi_b, lo_b), qmax);
    const float safe_a = scale_a == 0.0f ? 1.0f : scale_a;
    const float safe_b = scale_b == 0.0f ? 1.0f : scale_b;
    KV_UNROLL
    for (int t = 0; t < G; ++t) {
        if ((unsigned int)t < n) {
            float qa = kv_rint(kv_div(kv_sub(xa[t], lo_a), safe_a));
            float qb = kv_rint(kv_div(kv_sub(xb[t], lo_b), safe_b));
            qa = kv_min(kv_max(qa, 0.0f), qmax);
            qb = kv_min(kv_max(qb, 0.0f), qmax);
            kv_store2(out + base + t * D, vec, pair, kv_add(kv_mul(qa, scale_a), lo_a), kv_add(kv_mul(qb, scale_b), lo_b));
        }
    }
    kv_store2(out_scale + r * D + d, vec_p, pair, scale_a, scale_b);
    kv_store2(out_zero + r * D + d, vec_p, pair, lo_a, lo_b);
"""

# Values: warp w owns groups w * VGROUPS + k (k < VGROUPS), each exactly as in _VALUES. A slot past
# the last group loads the last group (a valid address; uniform per warp) and writes nothing.
VGROUPS = 4
_VALUES_WIDE = """
    const unsigned int tid = KV_TID;
    const unsigned int lane = tid % 32u;
    const unsigned int w = tid / 32u;
    constexpr unsigned int VG = KV_VGROUPS;
    const unsigned int D = x_shape[3];
    const unsigned int NG = (D + G - 1) / G;
    const unsigned int NT = (unsigned int)(x_shape[0] * x_shape[1] * x_shape[2]) * NG;  // groups
    // uniform per warp: every lane of a warp has the same w
    if (w >= (NT + VG - 1u) / VG) {
        return;
    }
    constexpr int PER = (G + 31) / 32;
    float xs[VG][PER];
    float lo[VG];
    float hi[VG];
    unsigned int bases[VG];
    unsigned int ns[VG];
    KV_UNROLL
    for (unsigned int u = 0; u < VG; ++u) {
        const unsigned int q = kv_umin(w * VG + u, NT - 1u);  // slots past the end repeat the last group
        const unsigned int c0 = (q % NG) * G;
        ns[u] = kv_umin((unsigned int)G, D - c0);
        bases[u] = (q / NG) * D + c0;
    }
    // every load of every group before any shuffle
    KV_UNROLL
    for (unsigned int u = 0; u < VG; ++u) {
        KV_UNROLL
        for (int p = 0; p < PER; ++p) {
            // lanes past the end of a ragged group load its last element (edge padding)
            xs[u][p] = static_cast<float>(x[bases[u] + kv_umin(lane + 32u * p, ns[u] - 1)]);
        }
    }
    KV_UNROLL
    for (unsigned int u = 0; u < VG; ++u) {
        KV_UNROLL
        for (int p = 0; p < PER; ++p) {
            lo[u] = p == 0 ? xs[u][p] : kv_min(lo[u], xs[u][p]);
            hi[u] = p == 0 ? xs[u][p] : kv_max(hi[u], xs[u][p]);
        }
    }
    KV_UNROLL
    for (int m = 16; m > 0; m /= 2) {
        KV_UNROLL
        for (unsigned int u = 0; u < VG; ++u) {
            lo[u] = kv_min(lo[u], kv_shfl_xor(lo[u], m));
            hi[u] = kv_max(hi[u], kv_shfl_xor(hi[u], m));
        }
    }
    const float qmax = (float)((1 << BITS) - 1);
    KV_UNROLL
    for (unsigned int u = 0; u < VG; ++u) {
        const float scale = kv_div(kv_sub(hi[u], lo[u]), qmax);
        const float safe = scale == 0.0f ? 1.0f : scale;
        if (w * VG + u < NT) {  // uniform per warp
            KV_UNROLL
            for (int p = 0; p < PER; ++p) {
                const unsigned int c = lane + 32u * p;
                if (c < ns[u]) {
                    float q = kv_rint(kv_div(kv_sub(xs[u][p], lo[u]), safe));
                    q = kv_min(kv_max(q, 0.0f), qmax);
                    out[bases[u] + c] = static_cast<T>(kv_add(kv_mul(q, scale), lo[u]));
                }
            }
            if (lane == 0) {
                out_scale[w * VG + u] = scale;
                out_zero[w * VG + u] = lo[u];
            }
        }
    }
""".replace("KV_VGROUPS", f"{VGROUPS}u")


# "vec" layout: the keys body of "default" (its 32 loads per thread in flight are what keeps the keys
# half fast, and its register count bounds the fused kernel's occupancy), and a values body with
# fewer, fuller threads.
# Values: L lanes per group (the power of two >= the group's 16-byte chunks, at most 32), each lane
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


LAYOUTS = ("default", "wide", "vec")
LAYOUT_SOURCES = {
    "default": _layout_sources(_KEYS, _VALUES, "k_shape[3]"),
    "wide": _layout_sources(_KEYS_WIDE, _VALUES_WIDE, "((k_shape[3] + 1) / 2)"),
    "vec": _layout_sources(_KEYS, _VALUES_VEC, "k_shape[3]"),
}
SOURCES = LAYOUT_SOURCES["default"]
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

# Only the "wide" layout gets these: the default layout's source stays exactly what was tested on
# the H200 (a header change would be a new, untested kernel).
_CUDA_WIDE_HEADER = """
// Two adjacent elements ("wide" layout): one 2-element vector access when vec (the caller has
// checked alignment), else scalar; with pair false only p[0] exists (b repeats a, nothing stored).
// Conversions as static_cast: exact to float, round to nearest even back.
template <typename U> struct kv_vec2 { typedef U type; };
template <> struct kv_vec2<float> { typedef float2 type; };
template <> struct kv_vec2<__half> { typedef __half2 type; };
template <> struct kv_vec2<__nv_bfloat16> { typedef __nv_bfloat162 type; };
__device__ __forceinline__ float2 kv_unpack2(float2 v) { return v; }
__device__ __forceinline__ float2 kv_unpack2(__half2 v) { return make_float2(__low2float(v), __high2float(v)); }
__device__ __forceinline__ float2 kv_unpack2(__nv_bfloat162 v) { return make_float2(__low2float(v), __high2float(v)); }
__device__ __forceinline__ void kv_pack2(float* p, float a, float b) { *reinterpret_cast<float2*>(p) = make_float2(a, b); }
__device__ __forceinline__ void kv_pack2(__half* p, float a, float b) { *reinterpret_cast<__half2*>(p) = __floats2half2_rn(a, b); }
__device__ __forceinline__ void kv_pack2(__nv_bfloat16* p, float a, float b) {
    *reinterpret_cast<__nv_bfloat162*>(p) = __floats2bfloat162_rn(a, b);
}
template <typename U> __device__ __forceinline__ bool kv_aligned2(const U* p) {
    return (reinterpret_cast<unsigned long long>(p) & (2ull * sizeof(U) - 1ull)) == 0ull;
}
template <typename U> __device__ __forceinline__ void kv_load2(const U* p, bool vec, bool pair, float& a, float& b) {
    if (vec) {
        const float2 f = kv_unpack2(*reinterpret_cast<const typename kv_vec2<U>::type*>(p));
        a = f.x;
        b = f.y;
    } else {
        a = static_cast<float>(p[0]);
        b = pair ? static_cast<float>(p[1]) : a;
    }
}
template <typename U> __device__ __forceinline__ void kv_store2(U* p, bool vec, bool pair, float a, float b) {
    if (vec) {
        kv_pack2(p, a, b);
    } else {
        p[0] = static_cast<U>(a);
        if (pair) {
            p[1] = static_cast<U>(b);
        }
    }
}
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

_METAL_WIDE_HEADER = """
// "wide" layout: two adjacent elements as two scalar accesses (vec is ignored; Apple GPUs merge
// adjacent accesses of a SIMD group); with pair false only p[0] exists.
template <typename U> inline bool kv_aligned2(const device U* p) { return true; }
template <typename U> inline void kv_load2(const device U* p, bool vec, bool pair, thread float& a, thread float& b) {
    a = static_cast<float>(p[0]);
    b = pair ? static_cast<float>(p[1]) : a;
}
template <typename U> inline void kv_store2(device U* p, bool vec, bool pair, float a, float b) {
    p[0] = static_cast<U>(a);
    if (pair) {
        p[1] = static_cast<U>(b);
    }
}
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
        "wide_header": _CUDA_WIDE_HEADER,
        "vec_header": _CUDA_VEC_HEADER,
        "tokens": {
            "KV_TID": "(blockIdx.x * blockDim.x + threadIdx.x)",
            "KV_UNROLL": "#pragma unroll",
        },
    },
    "metal": {
        "header": _METAL_HEADER,
        "wide_header": _METAL_WIDE_HEADER,
        "vec_header": _METAL_VEC_HEADER,
        "tokens": {"KV_TID": "thread_position_in_grid.x", "KV_UNROLL": "#pragma unroll"},
    },
}

_kernels = {}  # (dialect, kind, layout) -> MLX kernel object, built once
_instances = set()  # (dialect, kind, layout, dtype, bits, G): one JIT-compiled kernel each
_enabled = os.environ.get("VQPIPE_KIVI_KERNELS", "1") != "0"
_layout = os.environ.get("VQPIPE_KIVI_LAYOUT", "default")
if _layout not in LAYOUTS:
    raise ValueError(f"VQPIPE_KIVI_LAYOUT must be one of {LAYOUTS}, got {_layout!r}")


def _check_layout(name):
    if name not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {name!r}")
    return name


def layout():
    """The kernel layout calls use when they pass none: "default" unless changed by
    :func:`set_layout` or ``VQPIPE_KIVI_LAYOUT``."""
    return _layout


def set_layout(name):
    """Pick the kernel layout ("default" or "wide"; also ``VQPIPE_KIVI_LAYOUT``). Returns the
    previous one. Both give the same bytes; only speed may differ."""
    global _layout
    previous, _layout = _layout, _check_layout(name)
    return previous


def render(kind, dialect, layout="default"):
    """(name, header, body) for one kernel in one dialect and layout. The name carries a digest of
    the source: MLX caches compiled kernels (in memory and as PTX on disk) by name alone."""
    spec = DIALECTS[dialect]
    body = LAYOUT_SOURCES[_check_layout(layout)][kind]
    for token, text in spec["tokens"].items():
        body = body.replace(token, text)
    header = spec["header"] + (spec[f"{layout}_header"] if layout != "default" else "")
    digest = hashlib.sha1((header + body).encode()).hexdigest()[:10]
    tag = "" if layout == "default" else f"{layout}_"
    return f"kivi_{kind}_{tag}{digest}", header, body


def set_enabled(flag):
    """Global switch (also ``VQPIPE_KIVI_KERNELS=0``). Returns the previous setting."""
    global _enabled
    previous, _enabled = _enabled, bool(flag)
    return previous


def kernels_active(use_kernels=None):
    """Whether a call with ``use_kernels`` runs a fused kernel: None follows the global switch and
    the backend; True insists (raises if there is no GPU backend); False never."""
    return gpu.active(use_kernels, _enabled, backend(), "KIVI kernels")


def compiled_kernel_count():
    """Distinct kernels compiled so far (one per kind, layout, dtype, bits, G)."""
    return len(_instances)


def _kernel(dialect, kind, layout):
    key = (dialect, kind, layout)
    if key not in _kernels:
        name, header, body = render(kind, dialect, layout)
        make = mx.fast.metal_kernel if dialect == "metal" else mx.fast.cuda_kernel
        inputs, outputs = IO_NAMES[kind]
        _kernels[key] = make(name=name, input_names=inputs, output_names=outputs, source=body, header=header)
    return _kernels[key]


def _vec_lanes(group_size, itemsize):
    """Lanes per group in the "vec" values kernel: the power of two >= its 16-byte chunks, <= 32."""
    chunks = -(-group_size // (16 // itemsize))
    return min(WARP, 1 << (chunks - 1).bit_length())


def _geometry(kind, shape, group_size, layout="default", itemsize=2):
    """(threads, scale/zero shape) of the keys or values kernel on a [B, H, S, D] input."""
    if len(shape) != 4:
        raise ValueError(f"kernels take [B, H, S, D], got shape {tuple(shape)}")
    b, h, s, d = shape
    if b * h * s * d >= 2**31:
        raise ValueError("kernels index with 32-bit integers; split the input")
    if kind == "keys":
        ng = -(-s // group_size)
        per_row = -(-d // 2) if layout == "wide" else d  # wide: one thread per channel pair
        return b * h * ng * per_row, (b, h, ng, d)
    ng = -(-d // group_size)
    if layout == "wide":  # VGROUPS groups per warp
        return -(-(b * h * s * ng) // VGROUPS) * WARP, (b, h, s, ng)
    if layout == "vec":  # 32 / L groups per warp (see _VALUES_VEC)
        per_warp = WARP // _vec_lanes(group_size, itemsize)
        return -(-(b * h * s * ng) // per_warp) * WARP, (b, h, s, ng)
    return b * h * s * ng * WARP, (b, h, s, ng)


@functools.lru_cache(maxsize=512)
def launch_spec(kind, shape, dtype, bits, group_size, layout="default"):
    """Template arguments, grid, threadgroup and output shapes for a launch (cached; read-only).
    ``shape`` is the input's shape, or for ``kind="kv"`` the pair (keys shape, values shape).
    Only the template arguments select a compiled kernel, and they hold no shape."""
    quant._qmax(bits)
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
        plan = _plans[key] = (kernel, spec)
    kernel, spec = plan
    if kernel is None:  # an empty input: nothing to launch
        return tuple(mx.zeros(s, t) for s, t in zip(spec["output_shapes"], spec["output_dtypes"]))
    return tuple(kernel(inputs=inputs, **spec))


def fake_quant_keys(x, bits=4, group_size=32, use_kernels=None, layout=None):
    """Keys per channel: ``(x_hat, scale, zero)`` as :func:`vqpipe.kivi.quant.fake_quant_keys`,
    from the fused kernel when active (x must be [B, H, S, D]), else from the reference ops.
    ``layout`` picks the kernel layout (None: :func:`layout`)."""
    if kernels_active(use_kernels):
        return _launch("keys", [x], tuple(x.shape), bits, group_size, layout)
    return quant.fake_quant_keys(x, bits, group_size)


def fake_quant_values(x, bits=4, group_size=32, use_kernels=None, layout=None):
    """Values per token: ``(x_hat, scale, zero)`` as :func:`vqpipe.kivi.quant.fake_quant_values`."""
    if kernels_active(use_kernels):
        return _launch("values", [x], tuple(x.shape), bits, group_size, layout)
    return quant.fake_quant_values(x, bits, group_size)


def fake_quant_kv_hat(k, v, bits=4, group_size=32, use_kernels=None, layout=None):
    """One flush as the cache runs it: ``(k_hat, v_hat)``, the x_hat of :func:`fake_quant_kv` alone,
    in a single launch with two outputs when kernels are active."""
    if kernels_active(use_kernels):
        if k.dtype != v.dtype:
            raise ValueError(f"keys and values dtypes differ: {k.dtype} vs {v.dtype}")
        return _launch("kv_hat", [k, v], (tuple(k.shape), tuple(v.shape)), bits, group_size, layout)
    return quant.fake_quant_keys(k, bits, group_size)[0], quant.fake_quant_values(v, bits, group_size)[0]


def fake_quant_kv(k, v, bits=4, group_size=32, use_kernels=None, layout=None):
    """One flush: ``(fake_quant_keys(k), fake_quant_values(v))``, in a single launch when kernels
    are active (k and v: [B, H, S, D] with the same S and dtype; D may differ)."""
    if kernels_active(use_kernels):
        if k.dtype != v.dtype:
            raise ValueError(f"keys and values dtypes differ: {k.dtype} vs {v.dtype}")
        out = _launch("kv", [k, v], (tuple(k.shape), tuple(v.shape)), bits, group_size, layout)
        return out[:3], out[3:]
    return quant.fake_quant_keys(k, bits, group_size), quant.fake_quant_values(v, bits, group_size)
