"""Fused codebook mat-vec ("qmv") for the decode case: one kernel description, a CUDA/Metal dialect
layer, dispatch.

For a :class:`vqpipe.layers.qlinear.QuantizedLinear` with packed indices q (out x in), row scales s, codebook C
and optional bias b, and the rotated activation xr (M rows, M small: decode has M = 1):

    y[m, o] = s[o] * sum_i C[q[o, i]] * xr[m, i]  (+ b[o])

The dense path rebuilds the whole weight C[q] (out x in) on every call; the kernel reads each packed
word once and never materialises the weight, so a decode step costs about the packed bytes.

Layout (revision 6, see docs/qmv.md):

- A lane's unit of work is one *chunk* of a row: 4 packed words (16 bytes: 64, 32 or 16 values at
  2, 4, 8 bits) or 3 words (32 values) at 3 bits. Consecutive lanes take consecutive chunks, so the
  packed words (16-byte loads where rows are 16-byte aligned) and the activation are read coalesced.
- One warp owns R = 4 rows and reuses each activation load for them; KS warps (1, 2 or 4) split the
  chunks of the same rows when rows are few or long (their partials meet in shared memory, in warp
  order). Threadgroups are always 128 threads (KS x RW = 4 warps).
- Each warp walks one flat list of items (row set, chunk step), row sets taken grid-stride, and
  requests the packed words of the next item(s) before computing the current one, across row-set
  boundaries: into registers (RING = 0, one item ahead) or into a per-lane ring in shared memory
  (RING = 2..4 stages, filled by cp.async on CUDA, RING - 1 items ahead). With KS = 1 no barrier
  runs after the codebook fill: the lanes write their rows straight after the butterfly.
- The codebook sits in shared memory, one bank per level (no conflicts); at 2 bits a 16-entry
  pair table (C[e & 3], C[e >> 2]) gives two values per 8-byte lookup. Revision 7 (opt-in, LUT = 1):
  pair tables at every width, the 3/4-bit ones stored 16 times so no 8-byte lookup conflicts; on
  the H200 they were slower at 4 bits (fewer warps, exposed lookup latency), so revision 6's lookups
  stay the default. What bounds the default at M = 1 is its instruction stream (~6 per weight value)
  and the L1 data pipe, not HBM (profiled: docs/qmv.md).
- Revision 8 (vqpipe/kernels/qmv_tc.py, CUDA): tensor cores for 4 bits and bf16 activations, taken by
  vqpipe/kernels/dispatch.py where ``qmv_tc.wanted`` says so (M >= 2 on large layers, the heads at M = 1).
- float32 accumulation in a fixed order (per lane, 5-step xor butterfly, KS partials in warp order),
  then * s[o] (+ b[o]) and one cast to x's dtype: deterministic, not bit-identical to the dense path
  (which works in x's dtype, codebook included).

Shapes reach the kernel at run time (``x_shape``, ``packed_shape``, ``bias_ndim``); the template
arguments are dtypes, bits, M rounded up to 1, 2, 4 or 8, the group size, the prologue's shared
floats and RING, so the number of compiled kernels is bounded and does not grow with the shapes.
"""

import contextlib
import functools
import hashlib
import math
import os
import re

import mlx.core as mx
import numpy as np

from .. import gpu
from . import cuda_cache, small_arrays
from ..codec import rotation as rot
from ..codec.bitpack import words_per_row
from .dequant import dense_forward
from ..gpu import backend

MAX_M = 8  # rows of x (prod of its leading dims) the kernel takes; more -> the dense path
ROWS = 4  # output rows per warp (R, template argument NR); rows_for
TARGET_WARPS = 4096  # enough warps to fill an H200 (132 SMs x ~32 resident warps)
MAX_BLOCKS = 2048  # threadgroups at most, more row sets grid-stride (H200: 1056 was slower at gate|up and head)
# With the rotation in the prologue every threadgroup redoes it, so fewer, longer-lived threadgroups:
# 2 per SM of an H200 (132 SMs). bench-qmv on the H200: 264 beat 528 and 1056 on every shape
# (8B q|k|v 61 / 81 / 133 us; docs/qmv.md).
MAX_BLOCKS_ROT = 264
# How the next chunks' packed words wait (template argument RING, docs/qmv.md): 0 = in registers, one
# chunk ahead; 2..4 = a ring of that many stages in shared memory (8 KiB each per 128-thread
# threadgroup, RING - 1 chunks ahead, filled by cp.async on CUDA). None = by M: registers up to
# MT = 4, the 4-stage ring at MT = 8 (registers alone need 255 there and spill at 2 bits). On the
# H200 (docs/results/2026-12-01-h200-qmv2) registers beat every ring at M = 1 (8B gate|up 32.9 us
# against 35.9-41.6) and M = 4 (63.4 against 69.6); at M = 8 they tie (113.1). qmv.ring_stages(N)
# forces one. Metal has 32 KiB of threadgroup memory: at most 2 stages.
STAGES = None
RING_CHOICES = (0, 2, 3, 4)
DIALECT_MAX_STAGES = {"metal": 2}


def ring_for(mt, stages=None, dialect="cuda"):
    """The RING template argument for MT activation rows (see STAGES)."""
    ring = (0 if mt <= 4 else 4) if stages is None else int(stages)
    if ring not in RING_CHOICES:
        raise ValueError(f"qmv: ring stages must be one of {RING_CHOICES} (or None: by M), got {stages!r}")
    return min(ring, DIALECT_MAX_STAGES.get(dialect, 4)) if ring else 0
# Revision 7's lookups (template argument LUT, docs/qmv.md): 1 = pair tables (one 8-byte lookup per two values,
# the 3/4-bit tables stored 16 times so no lookup conflicts; 256-thread threadgroups share the 32 KiB 4-bit
# table; 2/3 bits keep 128), 0 = revision 6's one lookup per value, the default: on the H200 pair tables cut
# the instructions per item by a third but were 1.04-1.40x slower at 4 bits (72 registers, 24 warps per SM)
# and within -2..+6 % at 2/3 bits (docs/results/2026-12-01-h200-qmv7). They apply only with registers
# (RING = 0), no prologue (its staged activation and a 32 KiB table exceed 48 KiB), 2-4 bits, and on Metal
# (32 KiB of threadgroup memory) 2/3 bits. qmv.lut_tables(1) asks for them.
LUT = None


def lut_for(bits, ring, xcap, lut=None, dialect="cuda"):
    """The LUT template argument (see LUT): 1 where pair tables are asked for (lut = 1) and apply."""
    if lut is not None and lut not in (0, 1):
        raise ValueError(f"qmv: lut must be 0, 1 or None, got {lut!r}")
    fits = bits in (2, 3, 4) and not ring and not xcap and not (dialect == "metal" and bits == 4)
    return int(fits and lut == 1)


def rows_for(bits, lut, rows=None):
    """Output rows per warp (template argument NR): ``rows`` if given (2 or 4), else ROWS. Two rows
    halve the words in flight per lane (fewer registers) and double the activation loads per value."""
    rows = ROWS if rows is None else int(rows)
    if rows not in (2, 4):
        raise ValueError(f"qmv: rows per warp must be 2 or 4, got {rows!r}")
    return rows


def warps_per_group(lut, bits):
    """Warps per threadgroup: 8 with the 4-bit pair table (one 32 KiB table per 8 warps), else 4 (the ring's
    size; the 2- and 3-bit tables are 128 B and 8 KiB)."""
    return 8 if lut and bits == 4 else 4


GROUP_SIZES = (32, 64, 128, 256)  # per-group scale layouts the kernel takes (besides per row)
SCALE_DTYPES = (mx.float16, mx.float32)


def chunk_values(bits):
    """Values per lane chunk: 4 packed words (16 bytes) for 2/4/8 bits, 3 words (32 values) for 3."""
    return 32 * (3 if bits == 3 else 4) // bits
BITS = (2, 3, 4, 8)
DTYPES = (mx.float16, mx.bfloat16, mx.float32)

# The kernel description. Compile-time names (from MLX's template arguments): T (x dtype), BT (bias
# dtype; only keeps kernels with different bias signatures apart in MLX's by-name cache), ST (scale
# dtype), BITS, MT, GS (group size, 0 = per row), XCAP (prologue floats, 0 = none), RING (0 =
# registers, else ring stages), LUT (1 = revision 7's pair tables, 0 = revision 6's lookups). Dialect
# tokens QMV_* are substituted in Python (QMV_EPILOGUE by
# body_source); helpers qmv_* come from the dialect header.
_SOURCE = """
    constexpr int R = NR;                               // rows per warp (2 or 4)
    constexpr int VW = (BITS == 3) ? 3 : 4;             // packed words per lane chunk (12 or 16 bytes)
    constexpr int VPC = 32 * VW / BITS;                 // values per chunk: 64, 32, 32, 16 for 2, 3, 4, 8 bits
    constexpr int SC = 8;                               // values per activation load (one sub-chunk)
    constexpr int PER = 32 / BITS;                      // values per word (2, 4, 8 bits)
    constexpr int NLEV = 1 << BITS;
    constexpr int GSD = GS > 0 ? GS : 1;
    constexpr int NG = (GS > 0 && VPC > GS) ? VPC / GSD : 1;  // scale groups a chunk spans (GS >= 32)
    constexpr int XC = XCAP > 0 ? XCAP : 1;
    constexpr int NTB = 128;                            // threads per threadgroup: KS x RW = 4 warps
    // RING = 0: no ring, the next chunk's words are loaded into registers (one chunk ahead); else
    // ring stages (2 with the prologue, which needs the shared memory)
    constexpr int NST = RING == 0 ? 1 : (XCAP > 0 ? 2 : RING);
    constexpr int SLOT = R * NTB * VW;                  // words per ring stage
    QMV_SHARED float cb_s[NLEV];
    // 2 bits: a pair table, entry e = (C[e & 3], C[e >> 2]) for the 4-bit field e of two neighbouring
    // values: one 8-byte lookup per two values (16 entries of 8 bytes: distinct banks, no conflicts)
    QMV_SHARED float2 cb2_s[BITS == 2 && LUT == 0 ? 16 : 1];
    // LUT = 1 (revision 7): pair tables for every width, entry e = (C[e & (NLEV - 1)], C[e >> BITS]) for the
    // 2 * BITS-bit field e of two neighbouring values, one 8-byte lookup per two values. At 3 and 4 bits (64 and
    // 256 entries) the table is stored NCP = 16 times, copy k at entry * 16 + k: lane l reads copy l % 16, so the
    // 16 lanes of a half-warp (one 8-byte shared-memory wavefront) always hit distinct banks
    constexpr int NPT = LUT ? 1 << (2 * BITS) : 1;      // pair-table entries
    constexpr int NCP = (LUT && BITS > 2) ? 16 : 1;     // copies
    constexpr int PLS = NCP == 16 ? 7 : 3;              // log2 of an entry's stride in bytes
    QMV_SHARED16 float2 pt_s[NPT * NCP];
    QMV_SHARED float red_s[8 * R * MT];
    // The ring: every lane's packed words for its next NST - 1 chunks (R rows each), copied from global
    // memory asynchronously; a lane reads back only what it requested itself, so no barrier guards it
    QMV_SHARED16 unsigned int ring_s[RING == 0 ? 4 : NST * SLOT];
    // XCAP > 0: the activation rows rotated in the prologue, float, 4 pad floats per 32 (qmv_xi), so
    // the lanes' 16-byte reads at a stride of one chunk fall in distinct banks
    QMV_SHARED16 float xs_s[XC];

    const unsigned int lane = QMV_LANE;
    const unsigned int ks = QMV_KS_ID;                  // which slice of the row's chunks
    const unsigned int KS = QMV_KS;
    const unsigned int rw = QMV_RW_ID;                  // which row set of this block
    const unsigned int RW = QMV_RW;
    const unsigned int tid = (rw * KS + ks) * 32u + lane;
    const unsigned int NT = RW * KS * 32u;
    unsigned int M = 1u;                                // rows: the product of x's leading dims
    for (unsigned int k = 0; k + 1u < (unsigned int)x_ndim; ++k) {
        M *= (unsigned int)x_shape[k];
    }
    const unsigned int DIN = x_shape[x_ndim - 1];       // XCAP > 0: in_features; else padded to a chunk
    const unsigned int PIN = ((DIN + VPC - 1u) / VPC) * VPC;
    const unsigned int OUT = packed_shape[0];
    const unsigned int WPR = packed_shape[1];           // words per row
    const unsigned int G = GS > 0 ? scales_shape[1] : 1u;  // scale groups per row
    const unsigned int NCH = PIN / VPC;
    const unsigned int STRIDE = 32u * KS;               // chunks one warp advances per iteration
    const bool has_bias = bias_ndim == 1;               // the no-bias placeholder is 2-D
    const unsigned int row_sets = (OUT + R - 1u) / R;
    // 16-byte loads of packed words when every row starts 16-byte aligned (VW = 4 only)
    const bool wvec = VW == 4 && (WPR & 3u) == 0u && QMV_W_ALIGNED(packed);
    const bool xvec = QMV_X_ALIGNED(x);

    // This warp's work: NJ rounds (row sets taken grid-stride; the same count for every warp of a
    // block, so the barriers below are uniform) of NI chunk steps; item k = round k / NI, step k % NI.
    const unsigned int groups = (row_sets + RW - 1u) / RW;
    const unsigned int NJ = QMV_BLOCK < groups ? (groups - 1u - QMV_BLOCK) / QMV_BLOCKS + 1u : 0u;
    const unsigned int NI = (NCH + STRIDE - 1u) / STRIDE;
    const unsigned int NK = NJ * NI;
    const unsigned int c0 = ks * 32u + lane;
    auto ring = ring_s + tid * VW;                                 // slot s, row r: ring[(s * R + r) * NTB * VW ...]
    // Items 0 .. NST - 2 are requested before the codebook fill and the prologue; afterwards each step
    // requests the item NST - 1 ahead, across row sets: loads stay in flight through the reductions.
    unsigned int pj = 0u, pi = 0u;                      // the next item to request
    unsigned int cur[R][VW];                            // RING = 0: item k's words
    if (RING == 0) {
        qmv_load_rows<VW, R>(cur, packed, ((QMV_BLOCK + pj * QMV_BLOCKS) * RW + rw) * R, c0, OUT, WPR, NJ > 0u, NCH,
                             wvec);
        if (++pi == NI) { pi = 0u; ++pj; }
    }
    QMV_UNROLL
    for (int s = 0; s + 1 < NST; ++s) {
        const unsigned int prow0 = ((QMV_BLOCK + pj * QMV_BLOCKS) * RW + rw) * R;
        const unsigned int pc = c0 + pi * STRIDE;
        qmv_fetch<VW, R, NTB>(ring + (unsigned int)s * SLOT, packed, prow0, pc, OUT, WPR,
                              pj < NJ && prow0 < OUT && pc < NCH, wvec);
        if (++pi == NI) { pi = 0u; ++pj; }
    }
    for (unsigned int i = tid; i < (unsigned int)NLEV; i += NT) {
        cb_s[i] = static_cast<float>(codebook[i]);
    }
    if (LUT) {
        for (unsigned int e = tid; e < (unsigned int)(NPT * NCP); e += NT) {
            const unsigned int v = e / (unsigned int)NCP;
            pt_s[e] = qmv_f2(static_cast<float>(codebook[v & (NLEV - 1u)]), static_cast<float>(codebook[v >> BITS]));
        }
    }
    const unsigned int lcp = lane & (unsigned int)(NCP - 1);  // this lane's table copy
    if (BITS == 2 && LUT == 0 && tid < 16u) {
        cb2_s[tid] = qmv_f2(static_cast<float>(codebook[tid & 3u]), static_cast<float>(codebook[tid >> 2]));
    }
    // Prologue (XCAP > 0): xr = (L (x) S_B / sqrt(B)) (sd * x) for each row, x viewed as A x B
    // (S_B the Sylvester Hadamard matrix, B a power of two; L an A x A matrix: MLX's Hadamard base
    // matrix, the Kronecker factor Q, or [1]), in float32, every block for itself.
    unsigned int xoff = 0u;
    if (XCAP > 0) {
        const unsigned int A = rot_l_shape[0];
        const unsigned int B = DIN / A;
        const unsigned int PINP = (PIN + 31u) / 32u * 36u;  // padded floats per row (PIN may be 16 mod 32 at 8 bits)
        for (unsigned int idx = tid; idx < M * PIN; idx += NT) {
            const unsigned int m = idx / PIN, i = idx % PIN;
            xs_s[m * PINP + qmv_xi(i)] = i < DIN ? static_cast<float>(x[m * DIN + i]) * rot_s[i] : 0.0f;
        }
        QMV_BARRIER;
        const unsigned int NQ = M * A * (B / 2u);     // butterflies per stage
        const unsigned int LB = qmv_log2(B);           // B is a power of two: shifts, not divisions
        for (unsigned int lh = 0u; lh < LB; ++lh) {
            const unsigned int h = 1u << lh;
            // 4 butterflies per thread at a time, all loads before the stores: a stage's pairs are
            // disjoint, so this only lets the 8 shared-memory loads overlap
            for (unsigned int q0 = tid; q0 < NQ; q0 += 4u * NT) {
                unsigned int pi[4], pj[4];
                float u[4], v[4];
                QMV_UNROLL
                for (int t = 0; t < 4; ++t) {
                    const unsigned int q = qmv_umin(q0 + (unsigned int)t * NT, NQ - 1u);
                    const unsigned int row = q >> (LB - 1u), k = q & (B / 2u - 1u);
                    const unsigned int m = row / A;     // the one division per butterfly
                    const unsigned int i = (row - m * A) * B + ((k >> lh) << (lh + 1u)) + (k & (h - 1u));
                    pi[t] = m * PINP + qmv_xi(i);
                    pj[t] = m * PINP + qmv_xi(i + h);
                    u[t] = xs_s[pi[t]];
                    v[t] = xs_s[pj[t]];
                }
                QMV_UNROLL
                for (int t = 0; t < 4; ++t) {
                    if (q0 + (unsigned int)t * NT < NQ) {
                        xs_s[pi[t]] = u[t] + v[t];
                        xs_s[pj[t]] = u[t] - v[t];
                    }
                }
            }
            QMV_BARRIER;
        }
        const float scl = qmv_inv_sqrt((float)B);
        if (A > 1u) {  // out of place, into the second buffer
            xoff = M * PINP;
            for (unsigned int idx = tid; idx < M * PIN; idx += NT) {
                const unsigned int m = idx / PIN, e = idx % PIN;
                float s = 0.0f;
                if (e < DIN) {
                    // 4 independent sums: the loads of L and xs_s overlap instead of forming one
                    // dependent chain of A steps (A = 19..28 here: 4864 = 19 x 256, 896 = 28 x 32)
                    const unsigned int li = (e >> LB) * A, j = e & (B - 1u), xr0 = m * PINP;
                    float s0 = 0.0f, s1 = 0.0f, s2 = 0.0f, s3 = 0.0f;
                    unsigned int k = 0u;
                    for (; k + 4u <= A; k += 4u) {
                        s0 += rot_l[li + k] * xs_s[xr0 + qmv_xi(j + k * B)];
                        s1 += rot_l[li + k + 1u] * xs_s[xr0 + qmv_xi(j + (k + 1u) * B)];
                        s2 += rot_l[li + k + 2u] * xs_s[xr0 + qmv_xi(j + (k + 2u) * B)];
                        s3 += rot_l[li + k + 3u] * xs_s[xr0 + qmv_xi(j + (k + 3u) * B)];
                    }
                    for (; k < A; ++k) {
                        s0 += rot_l[li + k] * xs_s[xr0 + qmv_xi(j + k * B)];
                    }
                    s = (s0 + s1) + (s2 + s3);
                }
                xs_s[xoff + m * PINP + qmv_xi(e)] = s * scl;
            }
        } else {
            for (unsigned int idx = tid; idx < M * PIN; idx += NT) {
                const unsigned int m = idx / PIN, e = idx % PIN;
                xs_s[m * PINP + qmv_xi(e)] *= scl;
            }
        }
    }
    QMV_BARRIER;

    float acc[R][MT];
    QMV_UNROLL
    for (int r = 0; r < R; ++r) {
        QMV_UNROLL
        for (int m = 0; m < MT; ++m) {
            acc[r][m] = 0.0f;
        }
    }
    // The main loop, written once and with pair tables instantiated twice on CUDA (QMV_XV = 16-byte
    // activation loads or not, known at compile time): left to itself the compiler predicates both load
    // paths into one loop there (116 of 466 instructions per item, revision 7's first build)
    QMV_MAIN_BEGIN
    unsigned int slot = 0u, i = 0u, j = 0u;             // item k's ring slot, step and round
    for (unsigned int k = 0; k < NK; ++k) {
        unsigned int nxt[R][VW];                        // RING = 0: item k + 1's words, requested now
        if (RING == 0) {
            qmv_load_rows<VW, R>(nxt, packed, ((QMV_BLOCK + pj * QMV_BLOCKS) * RW + rw) * R, c0 + pi * STRIDE, OUT, WPR,
                                 pj < NJ, NCH, wvec);
        } else {
            qmv_async_wait<(NST > 1 ? NST - 2 : 0)>();  // item k has landed (at most NST - 2 pending)
            // request item k + NST - 1 into the slot item k - 1 used (read back a step ago)
            const unsigned int ps = slot == 0u ? (unsigned int)NST - 1u : slot - 1u;
            const unsigned int prow0 = ((QMV_BLOCK + pj * QMV_BLOCKS) * RW + rw) * R;
            const unsigned int pc = c0 + pi * STRIDE;
            qmv_fetch<VW, R, NTB>(ring + ps * SLOT, packed, prow0, pc, OUT, WPR, pj < NJ && prow0 < OUT && pc < NCH,
                                  wvec);
        }
        if (++pi == NI) { pi = 0u; ++pj; }
        const unsigned int set0 = (QMV_BLOCK + j * QMV_BLOCKS) * RW;  // this round's first row set
        const unsigned int row0 = (set0 + rw) * R;
        const unsigned int c = c0 + i * STRIDE;
        // uniform per warp: all 32 lanes share row0, so whole warps skip and the shuffles stay full
        if (row0 < OUT && c < NCH) {
            unsigned int win[R][VW];
            QMV_UNROLL
            for (int r = 0; r < R; ++r) {
                if (RING == 0) {
                    QMV_UNROLL
                    for (int w = 0; w < VW; ++w) {
                        win[r][w] = cur[r][w];
                    }
                } else {
                    qmv_ring_read<VW>(win[r], ring + (slot * R + (unsigned int)r) * (NTB * VW));
                }
            }
            float sg[R][NG];
            if (GS > 0) {
                QMV_UNROLL
                for (int r = 0; r < R; ++r) {
                    const unsigned int o = qmv_umin(row0 + (unsigned int)r, OUT - 1u);
                    QMV_UNROLL
                    for (int g = 0; g < NG; ++g) {
                        // chunks in the zero padding past in_features reuse the last group
                        sg[r][g] = static_cast<float>(scales[o * G + qmv_umin((c * VPC) / GSD + g, G - 1u)]);
                    }
                }
            }
            QMV_UNROLL
            for (int h = 0; h < VPC / SC; ++h) {
                float xv[MT][SC];
                QMV_UNROLL
                for (int m = 0; m < MT; ++m) {
                    // rows past M repeat the last row; their sums are never written
                    const unsigned int mm = qmv_umin((unsigned int)m, M - 1u);
                    if (XCAP > 0) {
                        QMV_LOAD_XS(xv[m], xs_s + xoff + mm * ((PIN + 31u) / 32u * 36u) + qmv_xi(c * VPC + h * SC));
                    } else {
                        QMV_LOAD_X(xv[m], x + mm * PIN + c * VPC + h * SC, QMV_XV);
                    }
                }
                QMV_UNROLL
                for (int r = 0; r < R; ++r) {
                    float part[MT];
                    QMV_UNROLL
                    for (int m = 0; m < MT; ++m) {
                        part[m] = 0.0f;
                    }
                    if (LUT) {  // revision 7: the same products in the same order, two values per lookup
                        QMV_UNROLL
                        for (int t = 0; t < SC; t += 2) {
                            const float2 w2 = qmv_pair<BITS, PLS>(pt_s, win[r], (h * SC + t) / 2, lcp);
                            QMV_UNROLL
                            for (int m = 0; m < MT; ++m) {
                                part[m] += w2.x * xv[m][t];
                                part[m] += w2.y * xv[m][t + 1];
                            }
                        }
                    } else if (BITS == 2) {  // the same products in the same order, two values per lookup
                        QMV_UNROLL
                        for (int t = 0; t < SC; t += 2) {
                            const float2 w2 = cb2_s[qmv_index<4, 8>(win[r], (h * SC + t) / 2)];
                            QMV_UNROLL
                            for (int m = 0; m < MT; ++m) {
                                part[m] += w2.x * xv[m][t];
                                part[m] += w2.y * xv[m][t + 1];
                            }
                        }
                    } else {
                        QMV_UNROLL
                        for (int t = 0; t < SC; ++t) {
                            const float w = cb_s[qmv_index<BITS, PER>(win[r], h * SC + t)];
                            QMV_UNROLL
                            for (int m = 0; m < MT; ++m) {
                                part[m] += w * xv[m][t];
                            }
                        }
                    }
                    QMV_UNROLL
                    for (int m = 0; m < MT; ++m) {
                        if (GS > 0) {
                            acc[r][m] += sg[r][NG > 1 ? (h * SC) / GSD : 0] * part[m];
                        } else {
                            acc[r][m] += part[m];
                        }
                    }
                }
            }
        }
        slot = slot + 1u == (unsigned int)NST ? 0u : slot + 1u;
        if (RING == 0) {
            QMV_UNROLL
            for (int r = 0; r < R; ++r) {
                QMV_UNROLL
                for (int w = 0; w < VW; ++w) {
                    cur[r][w] = nxt[r][w];
                }
            }
        }
        if (++i < NI) {
            continue;
        }
        // the round's last step: reduce the R x MT sums, then write them (warp-uniform branch)
        i = 0u;
        ++j;
        QMV_UNROLL
        for (int r = 0; r < R; ++r) {
            QMV_UNROLL
            for (int m = 0; m < MT; ++m) {
                float v = acc[r][m];
                QMV_UNROLL
                for (int s = 16; s > 0; s /= 2) {
                    v += qmv_shfl_xor(v, s);
                }
                acc[r][m] = v;
            }
        }
        if (KS == 1u) {
            // no other warp holds a part of these rows: lane r * MT + m writes (row r, activation m)
            float sum = 0.0f;
            QMV_UNROLL
            for (int r = 0; r < R; ++r) {
                QMV_UNROLL
                for (int m = 0; m < MT; ++m) {
                    sum = lane == (unsigned int)(r * MT + m) ? acc[r][m] : sum;
                    acc[r][m] = 0.0f;
                }
            }
            const unsigned int r = lane / MT, m = lane % MT, o = row0 + r;
            if (lane < (unsigned int)(R * MT) && o < OUT && m < M) {
                QMV_EPILOGUE
            }
        } else {
            if (lane == 0u) {
                QMV_UNROLL
                for (int r = 0; r < R; ++r) {
                    QMV_UNROLL
                    for (int m = 0; m < MT; ++m) {
                        red_s[((rw * KS + ks) * R + r) * MT + m] = acc[r][m];
                    }
                }
            }
            QMV_UNROLL
            for (int r = 0; r < R; ++r) {
                QMV_UNROLL
                for (int m = 0; m < MT; ++m) {
                    acc[r][m] = 0.0f;
                }
            }
            QMV_BARRIER;
            // one thread per (row set, row, m): the KS partials in warp order
            if (tid < RW * R * MT) {
                const unsigned int srw = tid / (R * MT);
                const unsigned int r = (tid / MT) % R;
                const unsigned int m = tid % MT;
                const unsigned int o = (set0 + srw) * R + r;
                if (o < OUT && m < M) {
                    float sum = red_s[((srw * KS) * R + r) * MT + m];
                    for (unsigned int q = 1; q < KS; ++q) {
                        sum += red_s[((srw * KS + q) * R + r) * MT + m];
                    }
                    QMV_EPILOGUE
                }
            }
            QMV_BARRIER;  // red_s is reused by the next round
        }
    }
    QMV_MAIN_END
    qmv_async_wait<0>();                                // nothing left in flight at exit
"""

INPUT_NAMES = ["x", "packed", "scales", "codebook", "bias", "rot_s", "rot_l", "seg"]
MAX_OUTPUTS = 3  # q|k|v: one launch writes up to 3 outputs (rows split at `seg`), so no slice ops follow


def output_names(n):
    return [f"out{k}" for k in range(n)]


def epilogue_code(n):
    """The epilogue for row o and activation row m of the float32 sum ``sum``: the row scale, the
    bias, one cast, the store into n outputs split at seg. It runs once per output element, after
    any split-K reduction."""
    return ("{ float s_ = sum; if (GS == 0) { s_ *= static_cast<float>(scales[o]); } "
            "if (has_bias) { s_ += static_cast<float>(bias[o]); } const T v = static_cast<T>(s_); "
            + store_code(n) + " }")


def body_source(n):
    """The kernel description with the epilogue for n outputs, dialect tokens still in place."""
    return _SOURCE.replace("QMV_EPILOGUE", epilogue_code(n))


def store_code(n):
    """The epilogue's store of value v for row o and activation row m into n outputs split at seg."""
    if n == 1:
        return "out0[m * OUT + o] = v;"
    lines, start = [], "0u"
    for k in range(n):
        end = "OUT" if k == n - 1 else f"(unsigned int)seg[{k}]"
        width = f"({end} - {start})"
        cond = "" if k == n - 1 else f"if (o < {end}) "
        prefix = "" if k == 0 else "else "
        lines.append(f"{prefix}{cond}{{ out{k}[m * {width} + (o - {start})] = v; }}")
        start = end
    return " ".join(lines)

_CUDA_HEADER = """
__device__ __forceinline__ unsigned int qmv_umin(unsigned int a, unsigned int b) { return a < b ? a : b; }
__device__ __forceinline__ float qmv_inv_sqrt(float v) { return 1.0f / sqrtf(v); }  // IEEE sqrt and division
__device__ __forceinline__ unsigned int qmv_log2(unsigned int v) { return (unsigned int)(__ffs((int)v) - 1); }  // v a power of two
__device__ __forceinline__ float qmv_shfl_xor(float v, int m) { return __shfl_xor_sync(0xffffffffu, v, m); }
__device__ __forceinline__ float2 qmv_f2(float a, float b) { return make_float2(a, b); }
template <bool B>
struct qmv_bool { static constexpr bool value = B; };

// Codebook index of value v (a compile-time constant once unrolled) of a chunk held in words w[]:
// 2/4/8 bits never straddle a word; a 3-bit value may straddle two (bits 30-32, 62-64 of the chunk).
template <int BITS, int PER>
__device__ __forceinline__ unsigned int qmv_index(const unsigned int* w, int v) {
    if (BITS != 3) {
        return (w[v / PER] >> (BITS * (v % PER))) & ((1u << BITS) - 1u);
    }
    const int bit = 3 * v, j = bit >> 5, sh = bit & 31;
    if (sh + 3 <= 32) {
        return (w[j] >> sh) & 7u;
    }
    return ((w[j] >> sh) | (w[j + 1] << (32 - sh))) & 7u;
}

// Revision 7's pair lookup: pair p of a chunk is the 2 * BITS-bit field at bit 2 * BITS * p of w[] (at 3 bits it
// may straddle two words: a funnel shift). Its entry's byte offset, field << PLS | copy << 3, comes from one
// shift and one and-or (LOP3) once unrolled; the load is then one LDS.64 from the table's fixed address.
template <int BITS, int PLS>
__device__ __forceinline__ unsigned int qmv_pair_off(const unsigned int* w, int p, unsigned int lcp) {
    const int bit = 2 * BITS * p, j = bit >> 5, sh = bit & 31;
    const unsigned int mask = ((1u << (2 * BITS)) - 1u) << PLS;
    unsigned int v;
    if (sh + 2 * BITS <= 32) {
        v = sh >= PLS ? (w[j] >> (sh - PLS)) : (w[j] << (PLS - sh));
    } else {
        v = __funnelshift_r(w[j], w[j + 1], sh - PLS);  // sh > 32 - 2 * BITS >= PLS here
    }
    return (v & mask) | (lcp << 3);
}
template <int BITS, int PLS>
__device__ __forceinline__ float2 qmv_pair(const float2* t, const unsigned int* w, int p, unsigned int lcp) {
    return *reinterpret_cast<const float2*>(reinterpret_cast<const unsigned char*>(t) + qmv_pair_off<BITS, PLS>(w, p, lcp));
}

// The ring (docs/qmv.md): R rows x VW packed words of one chunk, copied global -> shared without
// passing through registers (cp.async, Ampere and later), zeros where !valid or past the row's end;
// one 16-byte copy per row where rows are 16-byte aligned (vec), else VW 4-byte copies. Each call
// is one commit group; qmv_async_wait<N> waits until at most N groups of this thread are pending.
template <int VW, int R, int NTB>
__device__ __forceinline__ void qmv_fetch(unsigned int* dst, const unsigned int* p, unsigned int row0, unsigned int c,
                                          unsigned int OUT, unsigned int WPR, bool valid, bool vec) {
#pragma unroll
    for (int r = 0; r < R; ++r) {
        const unsigned int row = qmv_umin(row0 + (unsigned int)r, OUT - 1u) * WPR;
        const unsigned int left = valid ? WPR - c * VW : 0u;       // words of this row from the chunk on
        const unsigned int* src = p + row + (valid ? c * VW : 0u);  // a valid address even when nothing is read
        const unsigned int sa = (unsigned int)__cvta_generic_to_shared(dst + r * NTB * VW);
        if (VW == 4 && vec) {
            asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" :: "r"(sa), "l"(src),
                         "r"(left >= 4u ? 16u : 0u) : "memory");
        } else {
#pragma unroll
            for (int w = 0; w < VW; ++w) {
                asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;" :: "r"(sa + 4u * w),
                             "l"(src + ((unsigned int)w < left ? w : 0)), "r"((unsigned int)w < left ? 4u : 0u) : "memory");
            }
        }
    }
    asm volatile("cp.async.commit_group;" ::: "memory");
}
// RING = 0: the same R rows x VW words into registers: one 16-byte load per row where rows are
// 16-byte aligned (vec), else VW 4-byte loads; zeros where !valid, c >= NCH or past the row's end.
template <int VW, int R>
__device__ __forceinline__ void qmv_load_rows(unsigned int (*dst)[VW], const unsigned int* p, unsigned int row0,
                                              unsigned int c, unsigned int OUT, unsigned int WPR, bool valid,
                                              unsigned int NCH, bool vec) {
    valid = valid && row0 < OUT && c < NCH;
#pragma unroll
    for (int r = 0; r < R; ++r) {
        const unsigned int off = qmv_umin(row0 + (unsigned int)r, OUT - 1u) * WPR + c * VW;
        if (valid && VW == 4 && vec) {
            const uint4 v = *reinterpret_cast<const uint4*>(p + off);
            dst[r][0] = v.x; dst[r][1] = v.y; dst[r][2] = v.z; dst[r][3] = v.w;
        } else {
#pragma unroll
            for (int w = 0; w < VW; ++w) {
                dst[r][w] = (valid && c * VW + (unsigned int)w < WPR) ? p[off + w] : 0u;
            }
        }
    }
}
template <int N>
__device__ __forceinline__ void qmv_async_wait() { asm volatile("cp.async.wait_group %0;" :: "n"(N) : "memory"); }
// This lane's VW words of one ring slot (16-byte aligned when VW = 4).
template <int VW>
__device__ __forceinline__ void qmv_ring_read(unsigned int* dst, const unsigned int* src) {
    if (VW == 4) {
        const uint4 v = *reinterpret_cast<const uint4*>(src);
        dst[0] = v.x; dst[1] = v.y; dst[2] = v.z; dst[3] = v.w;
        return;
    }
#pragma unroll
    for (int w = 0; w < VW; ++w) {
        dst[w] = src[w];
    }
}

// N consecutive activations as float; 16-byte vector loads when x is 16-byte aligned (MLX passes
// views with their offset, so this is checked, not assumed).
template <typename T, int N>
struct alignas(sizeof(T) * N) qmv_vec {
    T val[N];
};

template <int N, typename T>
__device__ __forceinline__ void qmv_load_x(float* dst, const T* p, bool vec) {
    constexpr int P = (int)(N * sizeof(T)) > 16 ? (int)(16 / sizeof(T)) : N;
    if (vec) {
#pragma unroll
        for (int k = 0; k < N / P; ++k) {
            const qmv_vec<T, P> v = reinterpret_cast<const qmv_vec<T, P>*>(p)[k];
#pragma unroll
            for (int i = 0; i < P; ++i) {
                dst[k * P + i] = static_cast<float>(v.val[i]);
            }
        }
    } else {
#pragma unroll
        for (int i = 0; i < N; ++i) {
            dst[i] = static_cast<float>(p[i]);
        }
    }
}
#define QMV_LOAD_X(dst, p, vec) qmv_load_x<SC>(dst, p, vec)
#define QMV_X_ALIGNED(p) ((reinterpret_cast<unsigned long long>(p) & 15ull) == 0ull)
#define QMV_W_ALIGNED(p) ((reinterpret_cast<unsigned long long>(p) & 15ull) == 0ull)

// Index of element i of a staged activation row: 4 pad floats after every 32.
__device__ __forceinline__ unsigned int qmv_xi(unsigned int i) { return i + ((i >> 5) << 2); }
// 8 staged floats (16-byte aligned: the offsets are multiples of 4 floats) as two 16-byte loads.
#define QMV_LOAD_XS(dst, p) do { const float4 a_ = reinterpret_cast<const float4*>(p)[0]; \
    const float4 b_ = reinterpret_cast<const float4*>(p)[1]; \
    (dst)[0] = a_.x; (dst)[1] = a_.y; (dst)[2] = a_.z; (dst)[3] = a_.w; \
    (dst)[4] = b_.x; (dst)[5] = b_.y; (dst)[6] = b_.z; (dst)[7] = b_.w; } while (0)
"""

# Untested: no Apple GPU was available. Scalar loads throughout (Apple GPUs coalesce them).
_METAL_HEADER = """
inline unsigned int qmv_umin(unsigned int a, unsigned int b) { return a < b ? a : b; }
inline float qmv_inv_sqrt(float v) { return 1.0f / metal::precise::sqrt(v); }
inline unsigned int qmv_log2(unsigned int v) { return metal::ctz(v); }
inline float qmv_shfl_xor(float v, int m) { return metal::simd_shuffle_xor(v, ushort(m)); }
inline float2 qmv_f2(float a, float b) { return float2(a, b); }

template <int BITS, int PER>
inline unsigned int qmv_index(const thread unsigned int* w, int v) {
    if (BITS != 3) {
        return (w[v / PER] >> (BITS * (v % PER))) & ((1u << BITS) - 1u);
    }
    const int bit = 3 * v, j = bit >> 5, sh = bit & 31;
    if (sh + 3 <= 32) {
        return (w[j] >> sh) & 7u;
    }
    return ((w[j] >> sh) | (w[j + 1] << (32 - sh))) & 7u;
}

// Revision 7's pair lookup (see the CUDA header), as an entry index: field << (PLS - 3) | copy.
template <int BITS, int PLS>
inline float2 qmv_pair(const threadgroup float2* t, const thread unsigned int* w, int p, unsigned int lcp) {
    const int bit = 2 * BITS * p, j = bit >> 5, sh = bit & 31;
    const unsigned int f = sh + 2 * BITS <= 32 ? (w[j] >> sh) : ((w[j] >> sh) | (w[j + 1] << (32 - sh)));
    return t[((f & ((1u << (2 * BITS)) - 1u)) << (PLS - 3)) | lcp];
}

// The ring's copies are plain (synchronous) here: the wait is then nothing.
template <int VW, int R, int NTB>
inline void qmv_fetch(threadgroup unsigned int* dst, const device uint32_t* p, unsigned int row0, unsigned int c,
                      unsigned int OUT, unsigned int WPR, bool valid, bool vec) {
    for (int r = 0; r < R; ++r) {
        const unsigned int row = qmv_umin(row0 + (unsigned int)r, OUT - 1u) * WPR;
        const unsigned int left = valid ? WPR - c * VW : 0u;
        for (int w = 0; w < VW; ++w) {
            dst[r * NTB * VW + w] = (unsigned int)w < left ? p[row + c * VW + w] : 0u;
        }
    }
}
template <int VW, int R>
inline void qmv_load_rows(thread unsigned int (*dst)[VW], const device uint32_t* p, unsigned int row0, unsigned int c,
                          unsigned int OUT, unsigned int WPR, bool valid, unsigned int NCH, bool vec) {
    valid = valid && row0 < OUT && c < NCH;
    for (int r = 0; r < R; ++r) {
        const unsigned int off = qmv_umin(row0 + (unsigned int)r, OUT - 1u) * WPR + c * VW;
        for (int w = 0; w < VW; ++w) {
            dst[r][w] = (valid && c * VW + (unsigned int)w < WPR) ? p[off + w] : 0u;
        }
    }
}
template <int N>
inline void qmv_async_wait() {}
template <int VW>
inline void qmv_ring_read(thread unsigned int* dst, const threadgroup unsigned int* src) {
    for (int w = 0; w < VW; ++w) {
        dst[w] = src[w];
    }
}
#define QMV_LOAD_X(dst, p, vec) for (int t_ = 0; t_ < SC; ++t_) { (dst)[t_] = static_cast<float>((p)[t_]); }
#define QMV_X_ALIGNED(p) false
#define QMV_W_ALIGNED(p) false
inline unsigned int qmv_xi(unsigned int i) { return i + ((i >> 5) << 2); }
#define QMV_LOAD_XS(dst, p) for (int t_ = 0; t_ < SC; ++t_) { (dst)[t_] = (p)[t_]; }
"""

DIALECTS = {
    "cuda": {
        "header": _CUDA_HEADER,
        "tokens": {
            "QMV_SHARED16": "__shared__ __align__(16)",
            "QMV_SHARED": "__shared__",
            "QMV_BARRIER": "__syncthreads()",
            "QMV_LANE": "threadIdx.x",
            "QMV_KS_ID": "threadIdx.y",
            "QMV_KS": "blockDim.y",
            "QMV_RW_ID": "threadIdx.z",
            "QMV_RW": "blockDim.z",
            "QMV_BLOCKS": "gridDim.x",
            "QMV_BLOCK": "blockIdx.x",
            "QMV_UNROLL": "#pragma unroll",
            "QMV_MAIN_BEGIN": "auto qmv_main = [&](auto xv_) {",
            # pair tables only: with revision 6's lookups one instance (the compiler splits it itself, with
            # fewer registers at 2 bits: 86 against 96)
            "QMV_XV": "(LUT ? decltype(xv_)::value : xvec)",
            "QMV_MAIN_END": "}; if (LUT && xvec) { qmv_main(qmv_bool<true>()); } else { qmv_main(qmv_bool<false>()); }",
        },
    },
    "metal": {
        "header": _METAL_HEADER,
        "tokens": {
            "QMV_SHARED16": "threadgroup alignas(16)",
            "QMV_SHARED": "threadgroup",
            "QMV_BARRIER": "threadgroup_barrier(mem_flags::mem_threadgroup)",
            "QMV_LANE": "thread_position_in_threadgroup.x",
            "QMV_KS_ID": "thread_position_in_threadgroup.y",
            "QMV_KS": "threads_per_threadgroup.y",
            "QMV_RW_ID": "thread_position_in_threadgroup.z",
            "QMV_RW": "threads_per_threadgroup.z",
            "QMV_BLOCKS": "threadgroups_per_grid.x",
            "QMV_BLOCK": "threadgroup_position_in_grid.x",
            "QMV_UNROLL": "#pragma unroll",
            # scalar activation loads only (QMV_X_ALIGNED is false): one instance, no lambda
            "QMV_MAIN_BEGIN": "{ constexpr bool qmv_xv_ = false;",
            "QMV_XV": "qmv_xv_",
            "QMV_MAIN_END": "} /* main loop */",
        },
    },
}
# Tokens the dialect headers define as macros (left in the body on purpose).
_HEADER_MACROS = ("QMV_LOAD_X", "QMV_X_ALIGNED", "QMV_W_ALIGNED", "QMV_LOAD_XS")

_kernels = {}  # (dialect, outputs) -> MLX kernel object, built once
_instances = set()  # (dialect, dtype, bias dtype, bits, MT): one JIT-compiled kernel each
_enabled = None  # the switch; VQPIPE_QMV_KERNELS=0 (read at the first call) turns it off
_placeholders = {}  # dtype -> the 2-D stand-in passed as `bias` when a layer has none


def minify(source):
    """The source without comments, indentation and blank lines. MLX rebuilds the kernel's full
    source string and hashes it on every call (mlx/backend/cuda/custom_kernel.cpp), so its length
    is per-call host time. The kernel has no string literals, so // always starts a comment."""
    lines = (line.split("//", 1)[0].strip() for line in source.splitlines())
    return "\n".join(line for line in lines if line) + "\n"


def render(dialect, outputs=1):
    """(name, header, body) of the kernel in one dialect, writing ``outputs`` outputs, minified. The name carries a digest of the source: MLX caches
    compiled kernels (in memory and as PTX on disk) by name alone."""
    spec = DIALECTS[dialect]
    body = body_source(outputs)
    for token, text in spec["tokens"].items():
        body = re.sub(rf"\b{token}\b", text, body)
    header, body = minify(spec["header"]), minify(body)
    digest = hashlib.sha1((header + body).encode()).hexdigest()[:10]
    return f"vqpipe_qmv{outputs}_{digest}", header, body


def set_enabled(flag):
    """Global switch (also ``VQPIPE_QMV_KERNELS=0``). Returns the previous setting."""
    global _enabled
    previous, _enabled = is_enabled(), bool(flag)
    return previous


def is_enabled():
    global _enabled
    if _enabled is None:
        _enabled = os.environ.get("VQPIPE_QMV_KERNELS", "1") != "0"
    return _enabled


@contextlib.contextmanager
def enabled(flag):
    """``with qmv.enabled(False): ...`` runs the block with the switch set, then restores it."""
    previous = set_enabled(flag)
    try:
        yield
    finally:
        set_enabled(previous)


def kernels_active(use_kernels=None):
    """Whether a call with ``use_kernels`` runs the fused kernel: None follows the global switch and
    the backend; True insists (raises if there is no GPU backend); False never."""
    return gpu.active(use_kernels, is_enabled(), backend(), "the qmv kernel")


def rows_of(x):
    """M: the number of activation rows, the product of all but the last dimension."""
    return math.prod(x.shape[:-1])


def dispatch(x):
    """The decision of ``QuantizedLinear.__call__`` for activation ``x``: the dialect to launch in
    (switch on, 1 <= M <= MAX_M, a supported dtype, a GPU backend on the default device), else None:
    the layer then runs its dense path unchanged. Runs per layer per token, so it is kept cheap."""
    if not (_enabled if _enabled is not None else is_enabled()):
        return None
    shape = x.shape
    if not 0 < math.prod(shape[:-1]) <= MAX_M or x.dtype not in DTYPES:
        return None
    return backend()


def use_kernel(x):
    """``dispatch(x) is not None``."""
    return dispatch(x) is not None


def compiled_kernel_count():
    """Distinct kernels compiled so far (one per dialect, dtype, bias dtype, bits and MT)."""
    return len(_instances)


def _kernel(dialect, outputs=1):
    key = (dialect, outputs)
    if key not in _kernels:
        name, header, body = render(dialect, outputs)
        make = mx.fast.metal_kernel if dialect == "metal" else cuda_cache.cuda_kernel
        _kernels[key] = make(name=name, input_names=INPUT_NAMES,
                             output_names=output_names(outputs), source=body, header=header)
    return _kernels[key]


def _pow2_floor(n):
    return 1 << (max(int(n), 1).bit_length() - 1)


def _pow2_ceil(n):
    return 1 << max(int(n) - 1, 0).bit_length()


def check_args(in_features, m, packed_shape, packed_dtype, scales_shape, codebook_size, bias_shape, bits, dtype,
               group_size=None, scales_dtype=mx.float32):
    """Raise ValueError naming the first thing that does not fit the kernel."""
    if bits not in BITS:
        raise ValueError(f"qmv: bits must be one of {BITS}, got {bits!r}")
    if dtype not in DTYPES:
        raise ValueError(f"qmv: x dtype must be float16, bfloat16 or float32, got {dtype}")
    if in_features < 1:
        raise ValueError(f"qmv: x has an empty last dimension ({in_features})")
    if not 1 <= m <= MAX_M:
        raise ValueError(f"qmv: x has M = {m} rows (product of its leading dims); the kernel takes 1..{MAX_M}")
    if packed_dtype != mx.uint32:
        raise ValueError(f"qmv: packed must be uint32, got {packed_dtype}")
    if len(packed_shape) != 2:
        raise ValueError(f"qmv: packed must be 2-D [out, words], got shape {tuple(packed_shape)}")
    out_features, words = packed_shape
    if out_features < 1:
        raise ValueError("qmv: packed has no rows (out_features = 0)")
    if words != words_per_row(in_features, bits):
        raise ValueError(
            f"qmv: packed has {words} words per row; {in_features} input features at {bits} bits "
            f"need {words_per_row(in_features, bits)} (in_features of x and packed disagree?)"
        )
    if scales_dtype not in SCALE_DTYPES:
        raise ValueError(f"qmv: scales must be float16 or float32, got {scales_dtype}")
    if group_size is None:
        if tuple(scales_shape) != (out_features,):
            raise ValueError(f"qmv: scales must have shape ({out_features},), got {tuple(scales_shape)}")
    else:
        if group_size not in GROUP_SIZES:
            raise ValueError(f"qmv: group_size must be one of {GROUP_SIZES} (or None: per row), got {group_size!r}")
        if in_features % group_size:
            raise ValueError(f"qmv: in_features {in_features} is not a multiple of group_size {group_size}")
        want = (out_features, in_features // group_size)
        if tuple(scales_shape) != want:
            raise ValueError(f"qmv: group scales must have shape {want}, got {tuple(scales_shape)}")
    if codebook_size != 1 << bits:
        raise ValueError(f"qmv: a {bits}-bit codebook has {1 << bits} levels, got {codebook_size}")
    if bias_shape is not None and tuple(bias_shape) != (out_features,):
        raise ValueError(f"qmv: bias must have shape ({out_features},), got {tuple(bias_shape)}")
    padded = -(-in_features // chunk_values(bits)) * chunk_values(bits)
    if out_features * words >= 2**31 or m * out_features >= 2**31 or m * padded >= 2**31:
        raise ValueError("qmv: the kernel indexes with 32-bit integers; split the layer")


@functools.lru_cache(maxsize=1024)
def launch_spec(x_shape, packed_shape, scales_shape, codebook_size, bias_shape, bits, dtype, bias_dtype=None,
                packed_dtype=mx.uint32, group_size=None, scales_dtype=mx.float32, xcap=0, splits=None,
                max_blocks=None, stages=None, dialect="cuda", lut=None, rows=None):
    """Validate one call (ValueError naming the problem) and return its template arguments, grid,
    threadgroup and output shape (cached: per call this is one dict lookup; read-only). Only the
    template arguments select a compiled kernel, and they hold no shape: M enters as MT, M rounded
    up to a power of two (1, 2, 4, 8), and the row split KS as the threadgroup's y size."""
    in_features = x_shape[-1] if x_shape else 0
    m = math.prod(x_shape[:-1]) if x_shape else 0
    check_args(in_features, m, packed_shape, packed_dtype, scales_shape, codebook_size, bias_shape, bits, dtype,
               group_size, scales_dtype)
    out_features = packed_shape[0]
    vpc = chunk_values(bits)
    padded = -(-in_features // vpc) * vpc
    steps = -(-(padded // vpc) // 32)  # chunk steps per lane and row with one warp per row set
    ring = ring_for(_pow2_ceil(m), stages, dialect)
    lut = lut_for(bits, ring, xcap, lut, dialect)
    nr = rows_for(bits, lut, rows)
    row_sets = -(-out_features // nr)
    # Split rows over more warps only while there are too few warps to fill the GPU, and never so
    # far that a warp has less than one chunk step of work.
    cap = _pow2_floor(min(4, max(1, steps)))
    ks = min(cap, _pow2_ceil(-(-TARGET_WARPS // row_sets)))
    rw = warps_per_group(lut, bits) // ks  # row sets per threadgroup: 128 threads (the ring's size) or 256
    if max_blocks is None:
        max_blocks = MAX_BLOCKS_ROT if xcap else MAX_BLOCKS
    blocks = min(-(-row_sets // rw), max_blocks)
    ends = list(splits or ()) + [out_features]
    if len(ends) > MAX_OUTPUTS or any(b <= a for a, b in zip([0] + ends, ends)):
        raise ValueError(f"qmv: splits {splits} must increase strictly inside (0, {out_features}), at most "
                         f"{MAX_OUTPUTS - 1} of them")
    lead = tuple(x_shape[:-1])
    return {
        "template": [("T", dtype), ("BT", dtype if bias_dtype is None else bias_dtype), ("ST", scales_dtype),
                     ("BITS", int(bits)), ("MT", _pow2_ceil(m)), ("GS", int(group_size or 0)), ("XCAP", int(xcap)),
                     ("RING", ring), ("LUT", lut), ("NR", nr)],
        "grid": (32 * blocks, ks, rw),
        "threadgroup": (32, ks, rw),
        "output_shapes": [lead + (b - a,) for a, b in zip([0] + ends, ends)],
        "output_dtypes": [dtype] * len(ends),
        "m": m,
        "padded_in": padded,
    }


def _placeholder(dtype):
    if dtype not in _placeholders:
        # evaluated now: made lazily inside a compile trace (the split step's first launch), it would
        # be a Full primitive the compiled step replays on every call (docs/decode.md, "Prep kernels")
        _placeholders[dtype] = mx.zeros((1, 1), dtype)
        mx.eval(_placeholders[dtype])
    return _placeholders[dtype]


def reference(xr, packed, scales, codebook, bits, bias=None, group_size=None):
    """The dense path, exactly as ``QuantizedLinear.__call__`` computes it from the rotated input:
    rebuild C[q] in x's dtype, one matmul, then scales and bias in x's dtype."""
    return dense_forward(xr, packed, scales, codebook, bits, bias, group_size)


def quantized_matvec(xr, packed, scales, codebook, bits, bias=None, use_kernels=None, group_size=None):
    """``scales * (codebook[unpack(packed)] @ xr) + bias`` along the last axis of ``xr`` (the
    already rotated activation), in ``xr``'s dtype; with ``group_size``, scales [out, in // group_size]
    weight each group of rotated inputs.

    With the kernel active (``use_kernels``: None = switch and backend, True = insist, False = never)
    and M = prod(xr.shape[:-1]) <= MAX_M this is one fused launch; otherwise :func:`reference`.
    ``use_kernels=True`` raises on arguments the kernel cannot take (the message names the problem).
    """
    if not kernels_active(use_kernels):
        return reference(xr, packed, scales, codebook, bits, bias, group_size)
    if use_kernels is None and not (0 < rows_of(xr) <= MAX_M and xr.dtype in DTYPES):
        return reference(xr, packed, scales, codebook, bits, bias, group_size)
    return launch(backend(), xr, packed, scales, codebook, bits, bias, group_size)


XCAP_BUCKETS = (1024, 2048, 4096, 7168)  # floats of shared memory for the staged activation
# With the prologue the ring keeps 2 stages (16 KiB): 28 KiB + 16 + 1.5 stay under CUDA's 48 KiB static
# limit; Metal has 32 KiB. (A 4096-wide row at M = 1 needs 4608 floats; qwen's 4864-wide down_proj,
# 10944, no longer fits and is rotated by MLX ops first.)
MAX_XCAP = {"cuda": 7168, "metal": 2048}
MAX_ROT_A = 64  # the prologue's dense factor L is at most this many rows (A MACs per element)
# Off by default: on the H200 every threadgroup redoing the rotation cost more than the MLX ops it
# saves (docs/qmv.md, "Prologue rotation"), e.g. 174 us against 52 us for the kernel alone at 4096 -> 6144.
_rotate_in_kernel = False


def set_rotate_in_kernel(flag):
    """Whether the kernel rotates the activation in its prologue where it can (off by default);
    off, the rotation runs as MLX ops first.
    Returns the previous setting."""
    global _rotate_in_kernel
    previous, _rotate_in_kernel = _rotate_in_kernel, bool(flag)
    return previous


@contextlib.contextmanager
def block_limit(max_blocks):
    """``with qmv.block_limit(n): ...``: launches without the prologue use at most n threadgroups."""
    global MAX_BLOCKS
    previous, MAX_BLOCKS = MAX_BLOCKS, int(max_blocks)
    try:
        yield
    finally:
        MAX_BLOCKS = previous


@contextlib.contextmanager
def ring_stages(stages):
    """``with qmv.ring_stages(n): ...``: launches keep the next chunks in registers (n = 0) or in an
    n-stage ring (n - 1 chunks ahead); None restores the choice by M."""
    global STAGES
    if stages is not None and stages not in RING_CHOICES:
        raise ValueError(f"qmv: ring stages must be one of {RING_CHOICES} (or None: by M), got {stages!r}")
    previous, STAGES = STAGES, stages
    try:
        yield
    finally:
        STAGES = previous


@contextlib.contextmanager
def lut_tables(flag):
    """``with qmv.lut_tables(1): ...``: launches use revision 7's pair tables (1) where they apply, or
    revision 6's lookups (0 or None, the default)."""
    global LUT
    if flag is not None and flag not in (0, 1):
        raise ValueError(f"qmv: lut must be 0, 1 or None, got {flag!r}")
    previous, LUT = LUT, flag
    try:
        yield
    finally:
        LUT = previous


@contextlib.contextmanager
def rotating_in_kernel(flag, max_blocks=None):
    """``with qmv.rotating_in_kernel(True): ...``: the block runs with the prologue rotation on or
    off (and, if given, ``max_blocks`` threadgroups at most for it), then both are restored."""
    global MAX_BLOCKS_ROT
    previous, blocks = set_rotate_in_kernel(flag), MAX_BLOCKS_ROT
    MAX_BLOCKS_ROT = blocks if max_blocks is None else int(max_blocks)
    try:
        yield
    finally:
        set_rotate_in_kernel(previous)
        MAX_BLOCKS_ROT = blocks


def rotation_operands(rotation):
    """(sd, L) for the kernel's prologue, R = (L (x) S_B / sqrt(B)) diag(sd) with B = dim / L's size
    a power of two, or None where a rotation has no such form (qr, none) or L is too large."""
    key = ("qmv-prologue",)
    if key in rotation._cast:
        return rotation._cast[key]
    out = None
    if rotation.kind == "hadamard":
        d = rotation.dim
        base = next((b for b in rot.HADAMARD_BASES[1:] if d % b == 0 and rot._is_pow2(d // b)), 1)
        lmat = rot._hadamard_base(base) if base > 1 else mx.ones((1, 1))
        out = (rotation.signs.astype(mx.float32), lmat.astype(mx.float32))
    elif rotation.kind == "kron":
        base = next((b for b in rot.HADAMARD_BASES[1:] if rotation.p % b == 0 and rot._is_pow2(rotation.p // b)), 1)
        q = rotation.q.astype(mx.float32)
        lmat = q if base == 1 else mx.array(np.kron(np.array(q), np.array(rot._hadamard_base(base))))
        out = (mx.tile(rotation.signs.astype(mx.float32), (rotation.m,)), lmat)
    if out is not None and out[1].shape[0] > MAX_ROT_A:
        out = None
    if out is not None:
        mx.eval(*out)
    rotation._cast[key] = out
    return out


# The prologue rotation is used only where it passed its float64 test on the H200 (2026-12-01):
# the quantizer's widths and M <= 4. At 8 bits with M = 8 it missed the bound (2.94x; docs/qmv.md),
# so those launches rotate with MLX ops first until that is found.
PROLOGUE_BITS, PROLOGUE_MAX_M = (2, 3, 4), 4


def prologue_allowed(bits, m):
    return bits in PROLOGUE_BITS and m <= PROLOGUE_MAX_M


def prologue_floats(bits, in_features, m, a):
    """Shared floats the prologue needs: padded rows (4 pad floats per 32), twice when L is not [1]."""
    vpc = chunk_values(bits)
    padded = -(-in_features // vpc) * vpc
    return (2 if a > 1 else 1) * m * (-(-padded // 32) * 36)


_prepared = {}  # argument signature -> (spec, cast scales, cast codebook, rotate in kernel, seg array)


def _prepare(key, dialect, bits, rotation):
    (x_shape, x_dtype, p_shape, p_dtype, s_shape, s_dtype, c_shape, c_dtype, b_sig, _, _, group_size, _, splits,
     max_blocks, max_blocks_rot, stages, _) = key
    cast_scales = s_dtype not in SCALE_DTYPES  # e.g. bfloat16 scales: one cast to float32 per call
    m = math.prod(x_shape[:-1])
    ops = rotation_operands(rotation) if rotation is not None and _rotate_in_kernel and prologue_allowed(bits, m) else None
    xcap = 0
    if ops is not None:
        need = prologue_floats(bits, x_shape[-1], m, ops[1].shape[0])
        xcap = next((c for c in XCAP_BUCKETS if c >= need and c <= MAX_XCAP[dialect]), 0)
    spec = launch_spec(x_shape, p_shape, s_shape, math.prod(c_shape), None if b_sig is None else b_sig[0], bits,
                       x_dtype, None if b_sig is None else b_sig[1], p_dtype, group_size,
                       mx.float32 if cast_scales else s_dtype, xcap, splits, max_blocks_rot if xcap else max_blocks,
                       stages, dialect, LUT)
    _instances.add((dialect, len(spec["output_shapes"]), *(str(v) for _, v in spec["template"])))
    # the split points, read by every thread's store: never from MLX's small-array pool (vqpipe/kernels/small_arrays.py)
    seg = small_arrays.constant(splits or [0], mx.int32)
    _prepared[key] = entry = (spec, cast_scales, c_dtype != mx.float32, xcap > 0, seg)
    return entry


def launch(dialect, x, packed, scales, codebook, bits, bias=None, group_size=None, rotation=None, splits=None):
    """One fused launch in ``dialect`` (no switch or backend check: see :func:`quantized_matvec`).

    ``x`` is the activation, rotated already unless ``rotation`` is given: then the kernel rotates
    it in its prologue where :func:`rotation_operands` and the shared memory allow, else it is
    rotated first by MLX ops. ``splits`` (row indices) cut the output rows into up to 3 outputs,
    returned as a list. Arguments are validated once per signature, then looked up."""
    rkey = None if rotation is None else (rotation.kind, rotation.dim, rotation.seed, _rotate_in_kernel)
    key = (x.shape, x.dtype, packed.shape, packed.dtype, scales.shape, scales.dtype, codebook.shape,
           codebook.dtype, None if bias is None else (bias.shape, bias.dtype), bits, dialect, group_size, rkey,
           None if splits is None else tuple(splits), MAX_BLOCKS, MAX_BLOCKS_ROT, STAGES, LUT)
    entry = _prepared.get(key) or _prepare(key, dialect, int(bits), rotation)
    spec, cast_scales, cast_codebook, in_kernel, seg = entry
    if in_kernel:
        rot_s, rot_l = rotation_operands(rotation)
    else:
        if rotation is not None:
            x = rotation.apply(x)
        if spec["padded_in"] != x.shape[-1]:  # zeros past in_features: the padded indices then add nothing
            x = mx.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, spec["padded_in"] - x.shape[-1])])
        rot_s = rot_l = _placeholder(mx.float32)
    outs = _kernel(dialect, len(spec["output_shapes"]))(
        inputs=[
            x,
            packed,
            scales.astype(mx.float32) if cast_scales else scales,
            codebook.astype(mx.float32) if cast_codebook else codebook,
            _placeholder(x.dtype) if bias is None else bias,
            rot_s,
            rot_l,
            seg,
        ],
        template=spec["template"],
        grid=spec["grid"],
        threadgroup=spec["threadgroup"],
        output_shapes=spec["output_shapes"],
        output_dtypes=spec["output_dtypes"],
    )
    return outs if splits is not None else outs[0]

