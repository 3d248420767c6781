"""Tensor-core codebook mat-vec (qmv revision 8, CUDA sm_80+): 4-bit codes, bfloat16 activations, M <= 8.

    y[m, o] = s[o] * sum_i C[q[o, i]] * x[m, i]  (+ b[o])        (or per-group scales s[o, g])

The weight tile is the 16 x 16 A operand of ``mma.sync.m16n8k16.row.col.f32.bf16.bf16.f32`` (16 output
rows x 16 inputs), the activation rows (M <= 8, lanes past M hold zeros) the 16 x 8 B operand,
accumulated in float32 by the mma. A lane (g = lane / 4, t = lane % 4) holds the A pairs of rows g
and g + 8; it makes each pair with ONE 8-byte shared-memory lookup from a 256-entry pair table
indexed by a code byte (two 4-bit codes): the entry holds (hi[a], hi[b]) and (lo[a], lo[b]) with
hi = bf16(C), lo = bf16(C - hi), and every tile runs two mma (hi, lo) into separate float32
accumulators. bf16 products are exact in the mma, so the weight's only extra error is C - hi - lo,
at most 2^-18 |C| (docs/qmv.md, "Revision 8", for the whole bound).

Input order inside a tile: the mma sums over its 16 k positions in any order, so the kernel picks
the one that makes every load wide: tile pair p of a 128-input chunk covers inputs 32p .. 32p + 31,
lane t the 8 inputs 32p + 8t + [0, 8), i.e. one packed word per row and one 16-byte activation
load per tile pair; logical k = 2t + e / 2t + 8 + e of tile 2p + s is input 32p + 8t + 4s + e /
32p + 8t + 4s + 2 + e (:func:`input_of`). The packed words are repacked once per layer
(:func:`repack`, cached on the layer by :func:`packed_for`; the stored format is unchanged) so a
warp's words of one (16-row block, chunk) are 1 KiB contiguous, each lane's two 16-byte loads
coalesced.

The pair table is stored 16 times (copy k at entry * 16 + k, lane l reads copy l % 16), so the 16
lanes of a half-warp, one 8-byte wavefront, never hit the same bank. KS warps split a row block's
chunks (partials added in warp order in shared memory: deterministic); 256-thread threadgroups share
one 32 KiB table and take row blocks grid-stride, the grid capped at the resident threadgroups so
the table fill is paid a few times per SM. Only 4 bits, bfloat16 x, in_features % 128 == 0 (the
other cases stay on revision 6, vqpipe/kernels/qmv.py).
"""

import contextlib
import functools
import hashlib
import math

import mlx.core as mx
import numpy as np

from . import cuda_cache, qmv, small_arrays

BITS = 4
CHUNK = 128  # inputs per chunk: 4 tile pairs of 32, one packed word per row and lane per tile pair
ROWS = 16  # output rows per row block (the mma's M)
WARPS = 8  # warps per threadgroup (256 threads share one pair table)
NCOPIES = 16
TARGET_WARPS = 4096  # split K while fewer warps than this
# Threadgroups at most (0: by PF, prefetch_for), more row blocks grid-stride: 396 = the 3 per H200 SM that
# 72 registers (PF = 1) leave resident, 528 for PF = 2 (96 registers: 2 resident, a second round)
MAX_BLOCKS = 0
MIN_BLOCKS = 0  # __launch_bounds__ min blocks (0: none)
PREFETCH = 0  # items of codes in flight per warp (0: prefetch_for)
GROUP_SIZES = (32, 64, 128, 256)
# "1": every call the kernel takes (4 bits, bf16 x, in_features % 128 == 0, M <= 8); "0": never (revision 6);
# "auto": where it measured faster than revision 6 on the H200 (:func:`auto_rule`, docs/qmv.md "Revision 8")
MODES = ("0", "1", "auto")
_mode = "auto"
INPUT_NAMES = ["x", "packed", "scales", "codebook", "bias", "seg"]

_HEADER = r"""
__device__ __forceinline__ void qtc_mma(float* d, unsigned int a0, unsigned int a1, unsigned int a2, unsigned int a3,
                                        unsigned int b0, unsigned int b1) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}
__device__ __forceinline__ unsigned int qtc_bits(__nv_bfloat16 v) { return (unsigned int)__bfloat16_as_ushort(v); }
// The (hi, lo) pair entry for byte B of packed word w: entry (w >> 8B) & 255 at 128 bytes per entry (16
// copies of 8 bytes) from tb, the 32-bit shared address of this lane's copy: a byte extract (prmt) and a
// shift-add (lea), then one 8-byte shared load
template <int B>
__device__ __forceinline__ uint2 qtc_pair(unsigned int w, unsigned int tb) {
    uint2 e;
    const unsigned int a = tb + (__byte_perm(w, 0u, 0x4440u | B) << 7);
    asm("ld.shared.v2.u32 {%0, %1}, [%2];" : "=r"(e.x), "=r"(e.y) : "r"(a));
    return e;
}
// 8 bfloat16 activations (16 bytes) at p: one 16-byte load where x is 16-byte aligned
__device__ __forceinline__ uint4 qtc_ldx(const __nv_bfloat16* p, bool aligned) {
    if (aligned) { return *reinterpret_cast<const uint4*>(p); }
    const unsigned short* s = reinterpret_cast<const unsigned short*>(p);
    return make_uint4(s[0] | ((unsigned int)s[1] << 16), s[2] | ((unsigned int)s[3] << 16),
                      s[4] | ((unsigned int)s[5] << 16), s[6] | ((unsigned int)s[7] << 16));
}
"""

_BODY = r"""
    __shared__ __align__(16) uint2 tab_s[256 * 16];    // pair table, 16 copies: entry e copy k at e * 16 + k
    __shared__ float red_s[8 * 32 * 4];                 // KS partials, one 16 x 8 tile per warp
    const unsigned int lane = threadIdx.x, ks = threadIdx.y, KS = blockDim.y, rw = threadIdx.z, RW = blockDim.z;
    const unsigned int tid = (rw * KS + ks) * 32u + lane, NT = RW * KS * 32u;
    unsigned int M = 1u;                                // activation rows: the product of x's leading dims
    for (unsigned int k = 0; k + 1u < (unsigned int)x_ndim; ++k) { M *= (unsigned int)x_shape[k]; }
    const unsigned int K = x_shape[x_ndim - 1];         // in_features, a multiple of 128
    const unsigned int OUT = scales_shape[0];
    const unsigned int NG = GS > 0 ? scales_shape[1] : 1u;
    const bool has_bias = bias_ndim == 1;               // the no-bias placeholder is 2-D
    const unsigned int NC = K >> 7, NB = (OUT + 15u) >> 4;
    constexpr unsigned int GP = GS > 0 ? GS / 32 : 1;   // tile pairs (32 inputs each) per scale group
    for (unsigned int f = tid; f < 256u * 16u; f += NT) {  // consecutive threads, consecutive slots: no conflicts
        const unsigned int e = f >> 4;
        const float c0 = codebook[e & 15u], c1 = codebook[e >> 4];
        const __nv_bfloat16 h0 = __float2bfloat16_rn(c0), h1 = __float2bfloat16_rn(c1);
        const __nv_bfloat16 l0 = __float2bfloat16_rn(c0 - __bfloat162float(h0));  // c - hi is exact in float
        const __nv_bfloat16 l1 = __float2bfloat16_rn(c1 - __bfloat162float(h1));
        tab_s[f] = make_uint2(qtc_bits(h0) | (qtc_bits(h1) << 16), qtc_bits(l0) | (qtc_bits(l1) << 16));
    }
    __syncthreads();
    const unsigned int g = lane >> 2, t = lane & 3u;
    const unsigned int tb = (unsigned int)__cvta_generic_to_shared(tab_s) + ((lane & 15u) << 3);  // this lane's copy
    const unsigned int c_beg = ks * NC / KS, ncl = (ks + 1u) * NC / KS - c_beg;
    const unsigned int step = gridDim.x * RW;
    // Every warp of a threadgroup runs the same number of row-block rounds (the block's first warp's), warps
    // past the last row block idle through theirs, so the KS partials can meet behind __syncthreads
    const unsigned int base = blockIdx.x * RW, lim = base + rw + (NB - base + step - 1u) / step * step;
    const bool xon = g < M;                             // B column g is activation row g; zeros past M
    const bool xal = (reinterpret_cast<size_t>(x) & 15u) == 0u;
    const __nv_bfloat16* xr = reinterpret_cast<const __nv_bfloat16*>(x) + (size_t)(xon ? g : 0u) * K + 8u * t;
    const uint4* pw = reinterpret_cast<const uint4*>(packed) + lane;  // block (rb, c): 64 uint4 at (rb * NC + c) * 64
    // Codes of the next PF items (row block, chunk) in registers: item i + PF is requested while item i
    // is computed, across row-block boundaries
    unsigned int rb = blockIdx.x * RW + rw, c = 0u, frb = rb, fc = 0u;
    uint4 q0[PF], q1[PF];
    #pragma unroll
    for (int j = 0; j < PF; ++j) {
        q0[j] = make_uint4(0u, 0u, 0u, 0u); q1[j] = q0[j];
        if (frb < NB) { const uint4* p = pw + (size_t)(frb * NC + c_beg + fc) * 64u; q0[j] = p[0]; q1[j] = p[32]; }
        if (++fc == ncl) { fc = 0u; frb += step; }
    }
    // acc[h][s]: rows 8h .. 8h + 7 of the block, tile parity s; the mma's rows 0-7 take hi, 8-15 lo
    float acc[2][2][4] = {{{0.f, 0.f, 0.f, 0.f}, {0.f, 0.f, 0.f, 0.f}}, {{0.f, 0.f, 0.f, 0.f}, {0.f, 0.f, 0.f, 0.f}}};
    float tot[4] = {0.f, 0.f, 0.f, 0.f};                // rows g, g + 8 x activation rows 2t, 2t + 1
    // tot += group scale * (hi + lo sums) of rows g (h = 0) and g + 8 (h = 1), then a fresh group
    auto flush = [&](unsigned int grp, unsigned int r0, unsigned int r1) {
        const float s0 = static_cast<float>(scales[r0 * NG + grp]), s1 = static_cast<float>(scales[r1 * NG + grp]);
        #pragma unroll
        for (int i = 0; i < 4; ++i) {
            const int h = i >> 1, e = i & 1;
            tot[i] += (h ? s1 : s0) * ((acc[h][0][e] + acc[h][1][e]) + (acc[h][0][e + 2] + acc[h][1][e + 2]));
        }
        #pragma unroll
        for (int i = 0; i < 16; ++i) { (&acc[0][0][0])[i] = 0.f; }
    };
    while (rb < lim) {
        const uint4 w0 = q0[0], w1 = q1[0];             // rows g and g + 8: one word per tile pair
        #pragma unroll
        for (int j = 0; j + 1 < PF; ++j) { q0[j] = q0[j + 1]; q1[j] = q1[j + 1]; }
        if (frb < NB) { const uint4* p = pw + (size_t)(frb * NC + c_beg + fc) * 64u; q0[PF - 1] = p[0]; q1[PF - 1] = p[32]; }
        if (++fc == ncl) { fc = 0u; frb += step; }
        const unsigned int cc = c_beg + c;
        uint4 xv[4];                                    // (past NB: stale codes, nothing is stored)
        #pragma unroll
        for (int p = 0; p < 4; ++p) {
            xv[p] = xon ? qtc_ldx(xr + cc * 128u + 32u * p, xal) : make_uint4(0u, 0u, 0u, 0u);
        }
        const unsigned int o0 = rb * 16u + g, o0c = o0 < OUT ? o0 : OUT - 1u, o1c = o0 + 8u < OUT ? o0 + 8u : OUT - 1u;
        #pragma unroll
        for (int p = 0; p < 4; ++p) {
            const unsigned int* xb = &xv[p].x;
            #pragma unroll
            for (int h = 0; h < 2; ++h) {
                const unsigned int w = h ? (&w1.x)[p] : (&w0.x)[p];
                #pragma unroll
                for (int s = 0; s < 2; ++s) {               // one 8-byte lookup = (a0 hi, a1 lo), one = (a2 hi, a3 lo)
                    const uint2 e0 = s ? qtc_pair<2>(w, tb) : qtc_pair<0>(w, tb);
                    const uint2 e1 = s ? qtc_pair<3>(w, tb) : qtc_pair<1>(w, tb);
                    qtc_mma(acc[h][s], e0.x, e0.y, e1.x, e1.y, xb[2 * s], xb[2 * s + 1]);
                }
            }
            if (GS > 0 && ((cc * 4u + p + 1u) % GP) == 0u) { flush((cc * 4u + p) / GP, o0c, o1c); }  // a group ends
        }
        if (c + 1u == ncl) {                            // this warp's share of row block rb is done
            if (GS > 0 && ((cc * 4u + 4u) % GP) != 0u) { flush((cc * 4u + 3u) / GP, o0c, o1c); }  // split between warps
            if (GS == 0) {                              // hi sums (D rows 0-7) + lo sums (rows 8-15)
                #pragma unroll
                for (int i = 0; i < 4; ++i) {
                    const int h = i >> 1, e = i & 1;
                    tot[i] = (acc[h][0][e] + acc[h][1][e]) + (acc[h][0][e + 2] + acc[h][1][e + 2]);
                }
                #pragma unroll
                for (int i = 0; i < 16; ++i) { (&acc[0][0][0])[i] = 0.f; }
            }
            if (KS > 1u) {                              // partials added in warp order
                float* mine = red_s + ((rw * KS + ks) * 32u + lane) * 4u;
                if (ks > 0u) { for (int i = 0; i < 4; ++i) { mine[i] = tot[i]; } }
                __syncthreads();
                if (ks == 0u) {
                    for (unsigned int k = 1u; k < KS; ++k) {
                        #pragma unroll
                        for (int i = 0; i < 4; ++i) { tot[i] += red_s[((rw * KS + k) * 32u + lane) * 4u + i]; }
                    }
                }
                __syncthreads();
            }
            if (ks == 0u) {                             // D fragment: rows g, g + 8; activation rows 2t, 2t + 1
                #pragma unroll
                for (int i = 0; i < 4; ++i) {
                    const unsigned int o = o0 + (i < 2 ? 0u : 8u), m = 2u * t + (i & 1);
                    if (o < OUT && m < M) {
                        const float sum = tot[i];
                        QMV_EPILOGUE
                    }
                }
            }
            #pragma unroll
            for (int i = 0; i < 4; ++i) { tot[i] = 0.f; }
        }
        if (++c == ncl) { c = 0u; rb += step; }
    }
"""


def input_of(tile, k):
    """The input (0..127 within a chunk) at logical position ``k`` (0..15) of ``tile`` (0..7): tile
    pair p = tile // 2 covers 32p .. 32p + 31, lane t = (k % 8) // 2 the 8 inputs 32p + 8t + [0, 8)."""
    p, s = divmod(tile, 2)
    t, e, hi = (k % 8) // 2, k % 2, k // 8
    return 32 * p + 8 * t + 4 * s + 2 * hi + e


def repack(packed):
    """Packed 4-bit rows (numpy or MLX uint32 [out, in / 8], in a multiple of 128) in the kernel's
    order, 1-D: block (row block rb, chunk c) = 256 words at (rb * chunks + c) * 256, word
    (h * 32 + lane) * 4 + p = the row's word c * 16 + 4p + t of row 16 rb + 8h + g (lane = 4g + t).
    Rows are padded to a multiple of 16 with code 0 (their outputs are never stored)."""
    lib = mx if isinstance(packed, mx.array) else np
    n, wpr = packed.shape
    if wpr % 16:
        raise ValueError(f"qmv_tc: {wpr} words per row is not a whole number of 128-input chunks")
    nb, nc = -(-n // ROWS), wpr // 16
    if nb * ROWS != n:
        packed = lib.concatenate([packed, lib.zeros((nb * ROWS - n, wpr), dtype=packed.dtype)], axis=0)
    w = packed.reshape(nb, 2, 8, nc, 4, 4)  # rb, h, g, c, p, t
    return lib.transpose(w, (0, 3, 1, 2, 5, 4)).reshape(-1)  # rb, c, h, g, t, p


def pair_table(codebook):
    """(hi, lo) uint32 [256] pair words of the table as the kernel builds it: bfloat16 bits of C[e & 15]
    in the low half, of C[e >> 4] in the high half; hi = bf16(C) and lo = bf16(C - hi), round to
    nearest even."""
    c = np.asarray(codebook, np.float32)
    hi = _bf16_bits(c)
    lo = _bf16_bits(c - _bf16_value(hi))
    e = np.arange(256)
    pair = lambda v: (v[e & 15].astype(np.uint32) | (v[e >> 4].astype(np.uint32) << 16))  # noqa: E731
    return pair(hi), pair(lo)


def _bf16_bits(a):
    u = np.ascontiguousarray(a, np.float32).view(np.uint32)
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)


def _bf16_value(bits):
    return (np.asarray(bits).astype(np.uint32) << 16).view(np.float32)


def supports(bits, in_features, dtype, m):
    """Whether a call can take the tensor-core kernel (else revision 6 runs)."""
    return bits == BITS and dtype == mx.bfloat16 and in_features % CHUNK == 0 and 1 <= m <= qmv.MAX_M


def auto_rule(m, out_features, in_features):
    """Where the tensor-core kernel beat revision 6 (GPU time on the H200, n = 20, A/A <= 2.6 %; docs/qmv.md
    "Revision 8"): M = 1 the vocabulary heads (8B 1.02x, qwen 1.31x) and long rows (8B down 1.08x), not
    gate|up (0.94x) nor the qwen layers (0.76-0.91x); M = 2..7 layers of >= 8 Mi weights (1.03-2.6x; the
    qwen q|k|v and down below that: 0.82-0.98x); M = 8 every layer (1.31-4.08x)."""
    if in_features < 768:  # the weight's hi + lo residual (2^-16) would pass the float32 bound's (K/4 + 64) 2^-24
        return False
    if m == 1:
        return out_features >= 65536 or in_features >= 8192
    return m >= 8 or out_features * in_features >= 8 << 20


def wanted(x, bits, out_features):
    """Whether qmv.launch takes this kernel for activation ``x`` (per call: kept cheap)."""
    if _mode == "0" or bits != BITS or x.dtype != mx.bfloat16 or x.shape[-1] % CHUNK:
        return False
    m = math.prod(x.shape[:-1])
    if not 1 <= m <= qmv.MAX_M:
        return False
    return _mode == "1" or auto_rule(m, out_features, x.shape[-1])


def set_mode(mode):
    """``"0"``, ``"1"`` or ``"auto"``. Returns the previous mode."""
    global _mode
    if mode not in MODES:
        raise ValueError(f"qmv_tc: mode must be one of {MODES}, got {mode!r}")
    previous, _mode = _mode, mode
    return previous


@contextlib.contextmanager
def mode(value):
    """``with qmv_tc.mode("1"): ...`` runs the block in that mode, then restores it."""
    previous = set_mode(value)
    try:
        yield
    finally:
        set_mode(previous)


# MLX writes "__global__ void name(...)" after the header and __global__ is a macro (crt/host_defines.h), so the
# header can redefine it to carry __launch_bounds__ (as vqpipe/kivi/decode_kernel.py does)
_BOUNDS = "#undef __global__\n#define __global__ __location__(global) __launch_bounds__(256, {})\n"


def render(outputs=1, minblocks=None):
    """(name, header, body), minified; the name carries a digest (MLX caches kernels by name)."""
    minblocks = MIN_BLOCKS if minblocks is None else minblocks
    header = _HEADER
    if minblocks:
        header = _BOUNDS.format(minblocks) + header
    body = _BODY.replace("QMV_EPILOGUE", qmv.epilogue_code(outputs))
    header, body = qmv.minify(header), qmv.minify(body)
    digest = hashlib.sha1((header + body).encode()).hexdigest()[:10]
    return f"vqpipe_qmvtc{outputs}_{digest}", header, body


def prefetch_for(ks, chunks):
    """PF, the (row block, chunk) items whose codes a warp has in flight: 2 where one warp walks whole
    long rows (KS = 1, >= 16 chunks: the 8B head, 1.07x faster than PF = 1 at M = 1 on the H200), else 1
    (72 registers instead of 96: 3 threadgroups per SM instead of 2; q|k|v 1.42x, qwen head 1.17x)."""
    if PREFETCH:
        return PREFETCH
    return 2 if ks == 1 and chunks >= 16 else 1


def split_k(row_blocks, chunks, target=None):
    """KS, the warps splitting a row block's chunks: the smallest power of two up to 8 giving
    ``target`` warps, never more than the chunks."""
    target = TARGET_WARPS if target is None else target
    ks = 1
    while ks < WARPS and row_blocks * ks < target and ks * 2 <= chunks:
        ks *= 2
    return ks


@functools.lru_cache(maxsize=256)
def launch_spec(x_shape, out_features, scales_shape, bias_shape, dtype, bias_dtype=None, group_size=None,
                scales_dtype=mx.float32, splits=None, max_blocks=None, target=None, prefetch=None):
    """Template, grid, threadgroup and output shapes of one call (ValueError naming the problem)."""
    k, m = x_shape[-1], math.prod(x_shape[:-1])
    if not supports(BITS, k, dtype, m):
        raise ValueError(f"qmv_tc: takes bfloat16 x with in_features % {CHUNK} == 0 and 1..{qmv.MAX_M} rows, "
                         f"got {dtype}, in_features {k}, M = {m}")
    want = (out_features,) if group_size is None else (out_features, k // (group_size or 1))
    if group_size is not None and (group_size not in GROUP_SIZES or k % group_size):
        raise ValueError(f"qmv_tc: group_size must be one of {GROUP_SIZES} and divide {k}, got {group_size!r}")
    if tuple(scales_shape) != want:
        raise ValueError(f"qmv_tc: scales must have shape {want}, got {tuple(scales_shape)}")
    if bias_shape is not None and tuple(bias_shape) != (out_features,):
        raise ValueError(f"qmv_tc: bias must have shape ({out_features},), got {tuple(bias_shape)}")
    nb, nc = -(-out_features // ROWS), k // CHUNK
    ks = split_k(nb, nc, target)
    rw = WARPS // ks
    pf = prefetch_for(ks, nc) if prefetch is None else int(prefetch)
    if max_blocks is None:
        max_blocks = MAX_BLOCKS if MAX_BLOCKS else (528 if pf == 2 else 396)
    blocks = min(-(-nb // rw), max_blocks)
    ends = list(splits or ()) + [out_features]
    if len(ends) > qmv.MAX_OUTPUTS or any(b <= a for a, b in zip([0] + ends, ends)):
        raise ValueError(f"qmv_tc: splits {splits} must increase strictly inside (0, {out_features})")
    lead = tuple(x_shape[:-1])
    return {
        "template": [("T", dtype), ("BT", dtype if bias_dtype is None else bias_dtype), ("ST", scales_dtype),
                     ("GS", int(group_size or 0)), ("PF", pf)],
        "grid": (32 * blocks, ks, rw),
        "threadgroup": (32, ks, rw),
        "output_shapes": [lead + (b - a,) for a, b in zip([0] + ends, ends)],
        "output_dtypes": [dtype] * len(ends),
    }


_kernels = {}


def _kernel(outputs):
    if outputs not in _kernels:
        name, header, body = render(outputs)
        _kernels[outputs] = cuda_cache.cuda_kernel(name=name, input_names=INPUT_NAMES,
                                                output_names=qmv.output_names(outputs), source=body, header=header)
    return _kernels[outputs]


def packed_for(owner, packed):
    """The repacked words of ``packed`` (the layer's stored words), made once and cached on ``owner``
    (a layer or fused group) keyed by the array's identity, so a layer whose ``packed`` is replaced
    gets a new copy."""
    cached = owner.__dict__.get("_qmv_tc_packed")
    if cached is None or cached[0] is not packed:
        cached = (packed, repack(packed))
        mx.eval(cached[1])  # made inside a compile trace and left lazy, the step would repack on every call
        owner.__dict__["_qmv_tc_packed"] = cached
    return cached[1]


def launch(x, repacked, out_features, scales, codebook, bias=None, group_size=None, splits=None):
    """One tensor-core launch on the rotated activation ``x`` (bf16) with words from :func:`repack`."""
    cast = scales.dtype not in qmv.SCALE_DTYPES
    spec = launch_spec(x.shape, out_features, scales.shape, None if bias is None else bias.shape, x.dtype,
                       None if bias is None else bias.dtype, group_size,
                       mx.float32 if cast else scales.dtype, None if splits is None else tuple(splits))
    seg = small_arrays.constant(splits or [0], mx.int32)
    outs = _kernel(len(spec["output_shapes"]))(
        inputs=[x, repacked, scales.astype(mx.float32) if cast else scales,
                codebook if codebook.dtype == mx.float32 else codebook.astype(mx.float32),
                qmv._placeholder(x.dtype) if bias is None else bias, seg],
        template=spec["template"], grid=spec["grid"], threadgroup=spec["threadgroup"],
        output_shapes=spec["output_shapes"], output_dtypes=spec["output_dtypes"])
    return outs if splits is not None else outs[0]
