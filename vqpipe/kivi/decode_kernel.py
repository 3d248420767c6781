"""Fused decode attention over a packed KIVI cache: one kernel description, CUDA and Metal dialects.

One launch per layer and decode step (query length 1). Grid: (splits, B * H KV heads) blocks of
NW warps. The tokens are taken in chunks of 32 (the quantized ones, then the full-precision
residual, ragged at its end); block ``split`` owns a contiguous run of chunks and its warps take
them in turn. Per chunk, a warp:

1. folds the chunk's per-channel key scales into the query (``q·scale·s_d``, in shared memory,
   all R query heads of the KV head side by side) and the zeros into one bias per head
   (``Σ_d q_d·scale·z_d``): the keys are then scored straight from their codes;
2. scores: lane t owns token t of the chunk and reads its key words, 32 lanes reading 32
   consecutive words (:mod:`vqpipe.kivi.bitpack`);
3. online softmax: the chunk's max per head (a butterfly over the warp), the running max, sum and
   accumulator rescaled by ``exp(m_old - m_new)`` when the max grows;
4. p·V: lane (w, j) owns word w of tokens j, j + 32/W, ...; the value's per-token scale is folded
   into p, its zero into one sum per head, so codes multiply p directly.

Every query head of the GQA group is served by one read of the codes. At the end a block merges
its warps (shared memory), writes its partial (max, sum, accumulator per head) to the cache's
scratch buffer and counts itself done; the last block of a KV head merges all splits
(log-sum-exp weights) and writes the output. The counter is reset by that block, so the scratch
needs no clearing between launches. In float32 throughout; codes become floats exactly.

Versions (:data:`VERSIONS`; the default :data:`DEFAULT`, "auto", is v4 where it serves, v3 elsewhere): "v3" does the above with all of a chunk's global loads
issued before its arithmetic (optionally a chunk ahead); "v2" (the same arithmetic, loads next to
their use: one round trip per token-word in its values loop, docs/tried.md) is kept to be timed
side by side (the kernel of H200 run 2, equal to v2 at 4 bits, was removed when v3 beat both).
"v4" (CUDA only, 2 and 4 bits, :func:`v4_unsupported`) does the dot products of the quantized
chunks on tensor cores (``mma.sync.m16n8k16`` bf16 -> f32: the codes exact in bf16, the folded
query and p times the value scale as bf16 hi + lo in the mma's rows 0-7 and 8-15), each warp's
chunks staged in shared memory by cp.async, double buffered; the residual chunks through the same
mma path and running state (their keys and values as bf16 hi + lo: exact for float16 and bfloat16),
then a final merge whose loads of all splits are in flight together. Its bound is the float32 one
plus 2^-16 of the score and value magnitudes (twice that with a float32 residual; docs/kivi-packed.md).
"v4r" (the first v4: the residual on CUDA cores with its own partial, v3's final merge) and "v4m"
(v4r with v4's merge) are kept to be timed against it.
"""

import functools
import hashlib
import re
import struct
import typing

import mlx.core as mx

from .. import gpu
from ..kernels import cuda_cache
from . import kernels

NSMAX = 128  # most splits per KV head (the scratch holds one partial per split)
WARPS = 8

# Pieces v2 and v3 share, pasted in at @SETUP@ (shared-memory layout, indices, this block's
# chunks), @SOFTMAX@ (the online softmax step over one chunk's scores) and @P_STORE@ (the chunk's
# p into shared memory, its row sums).
_SETUP = """
    constexpr unsigned int SHA = SHQ > NW * PS ? SHQ : NW * PS;
    constexpr unsigned int SHB = (NSMAX + 1) * R + 3;
    constexpr unsigned int SH = SHA > SHB ? SHA : SHB;
    KA_SHARED float4 sh4[SH / 4];
    KA_SHARED unsigned int last;
    KA_TG float* sh = (KA_TG float*)sh4;

    const unsigned int tid = KA_THREAD;
    const unsigned int lane = tid % 32u;
    const unsigned int warp = tid / 32u;
    const unsigned int split = KA_BLOCK_X;
    const unsigned int nsplit = KA_NBLOCKS_X;
    const unsigned int bh = KA_BLOCK_Y;  // b * H + h
    const unsigned int NGC = kc_shape[2];
    const unsigned int SC = vc_shape[2];
    const unsigned int RC = rk_shape[2];
    @COUNTS@
    const unsigned int NSP = scratch_shape[1];  // partials per KV head the scratch holds
    const unsigned int nqc = nq / 32u;
    const unsigned int nc = nqc + (nr + 31u) / 32u;
    const unsigned int per = (nc + nsplit - 1u) / nsplit;
    const unsigned int c0 = split * per;
    const unsigned int c1 = ka_umin(c0 + per, nc);
    const float ninf = ka_neg_inf();
"""[1:]

_P_STORE = """
        KA_TG float4* po = (KA_TG float4*)(ps + lane * RP);
        KA_UNROLL
        for (unsigned int r4 = 0; r4 < RP / 4; ++r4) {
            float pv4[4];
            KA_UNROLL
            for (unsigned int k = 0; k < 4; ++k) {
                const unsigned int r = 4 * r4 + k < R ? 4 * r4 + k : 0;
                pv4[k] = valid && 4 * r4 + k < R ? ka_exp(s[4 * r4 + k] - m[r]) : 0.0f;
                lsum[r] += 4 * r4 + k < R ? pv4[k] : 0.0f;
            }
            po[r4] = ka_f4(pv4[0], pv4[1], pv4[2], pv4[3]);
        }
"""[1:]

_SOFTMAX = """
        // online softmax over the chunk; the warp's max is updated only when a score exceeds it
        // (then exactly as max(m, chunk max) would: otherwise that max is m and the rescale 1)
        bool grows = false;
        KA_UNROLL
        for (unsigned int r = 0; r < R; ++r) {
            grows = grows || (valid && s[r] > m[r]);
        }
        if (ka_any(grows)) {
            KA_UNROLL
            for (unsigned int r = 0; r < R; ++r) {
                float cm = valid ? s[r] : ninf;
                KA_UNROLL
                for (unsigned int o = 16; o > 0; o /= 2) {
                    cm = ka_max(cm, ka_shfl_xor(cm, o));
                }
                const float mn = ka_max(m[r], cm);
                const float alpha = ka_exp(m[r] - mn);  // 0 on the first chunk (m = -inf)
                lsum[r] *= alpha;
                zacc[r] *= alpha;
                KA_UNROLL
                for (unsigned int cc = 0; cc < CPW; ++cc) {
                    acc[r][cc] *= alpha;
                }
                m[r] = mn;
            }
        }
"""[1:]

_BODY = """
    constexpr unsigned int W = D * BITS / 32;  // words per token
    constexpr unsigned int CPW = 32 / BITS;  // codes per word
    constexpr unsigned int MASK = (1u << BITS) - 1u;
    // Codes are read in place: field cc of a word, masked where it sits and or'ed into the mantissa
    // of 2^23, is c * 2^off once 2^23 is subtracted (exact while the field ends below bit 23). The
    // LOW fields that do are read from the word, the rest from the word shifted by LOW * BITS; the
    // 2^-off goes into the folded query (keys) or the accumulator's final scaling (values).
    constexpr unsigned int LOW = 23 / BITS < CPW ? 23 / BITS : CPW;
    constexpr unsigned int P = 32 / W;  // tokens per pass of the values loop
    constexpr unsigned int DL = D / 32;  // channels per lane in per-channel loops
    constexpr unsigned int RP = (R + 3) / 4 * 4;  // query heads padded to float4
    constexpr unsigned int NGV = (D + G - 1) / G;
    constexpr unsigned int PS = R * (D + 2);  // one partial: acc[R][D], m[R], l[R]
    // shared: the scaled query [D][RP], then per warp its folded query [D][RP] and p [32][RP];
    // after the loop the warps' partials, at the end the final merge's weights
    constexpr unsigned int SHQ = D * RP + NW * (D + 32) * RP;
@SETUP@

    KA_TG float* qsh = sh;  // [D][RP]: the query times the softmax scale, every head of the group
    KA_TG float* qs = sh + D * RP + warp * (D + 32) * RP;  // [D][RP]: this warp's folded query
    KA_TG float* ps = qs + D * RP;  // [32][RP]: this warp's p of the chunk's tokens
    for (unsigned int e = tid; e < D * RP; e += NW * 32u) {
        const unsigned int d = e / RP, r = e % RP;
        qsh[e] = r < R ? static_cast<float>(q[(bh * R + r) * D + d]) * sm : 0.0f;
    }
    KA_BARRIER;
    float m[R], lsum[R], zacc[R], acc[R][CPW];
    KA_UNROLL
    for (unsigned int r = 0; r < R; ++r) {
        m[r] = ninf;
        lsum[r] = 0.0f;
        zacc[r] = 0.0f;
        KA_UNROLL
        for (unsigned int c = 0; c < CPW; ++c) {
            acc[r][c] = 0.0f;
        }
    }
    const unsigned int vw = lane % W;  // values loop: this lane's word
    const unsigned int vj = lane / W;  // and its first token
    const unsigned int jj = (vw * CPW) / G;  // its value group

    for (unsigned int c = c0 + warp; c < c1; c += NW) {
        const bool quant = c < nqc;
        const unsigned int t0 = c * 32u;
        const unsigned int g = t0 / G;
        // the keys' loads first, so their latencies overlap the fold
        unsigned int kw[W];
        float2 kpar[DL];
        if (quant) {
            const KA_DEV unsigned int* kb = kc + ((bh * NGC + g) * W) * G + (t0 + lane) % G;
            KA_UNROLL
            for (unsigned int w = 0; w < W; ++w) {
                kw[w] = kb[w * G];
            }
            KA_UNROLL
            for (unsigned int i = 0; i < DL; ++i) {
                kpar[i] = ka_pair(kp, (bh * NGC + g) * D + lane + 32u * i);
            }
        }
        float bias[R];
        KA_UNROLL
        for (unsigned int r = 0; r < R; ++r) {
            bias[r] = 0.0f;
        }
        KA_SYNCWARP;  // the previous chunk is done with qs and ps
        KA_UNROLL
        for (unsigned int i = 0; i < DL; ++i) {
            const unsigned int d = lane + 32u * i;
            const unsigned int cc = d % CPW;
            const float f = quant ? ka_pow2m(cc < LOW ? cc * BITS : (cc - LOW) * BITS) : 1.0f;
            const float s = quant ? kpar[i].x * f : 1.0f;
            const float z = quant ? kpar[i].y : 0.0f;
            const KA_TG float4* qa = (const KA_TG float4*)(qsh + d * RP);
            KA_TG float4* qo = (KA_TG float4*)(qs + d * RP);
            KA_UNROLL
            for (unsigned int r4 = 0; r4 < RP / 4; ++r4) {
                const float4 a = qa[r4];
                qo[r4] = ka_f4(a.x * s, a.y * s, a.z * s, a.w * s);
                const float av[4] = {a.x, a.y, a.z, a.w};
                KA_UNROLL
                for (unsigned int k = 0; k < 4; ++k) {
                    if (4 * r4 + k < R) {
                        bias[4 * r4 + k < R ? 4 * r4 + k : 0] += av[k] * z;
                    }
                }
            }
        }
        if (quant) {
            KA_UNROLL
            for (unsigned int r = 0; r < R; ++r) {
                KA_UNROLL
                for (unsigned int o = 16; o > 0; o /= 2) {
                    bias[r] += ka_shfl_xor(bias[r], o);
                }
            }
        }
        KA_SYNCWARP;
        // scores: lane = token t0 + lane
        float s[RP];
        KA_UNROLL
        for (unsigned int r = 0; r < RP; ++r) {
            s[r] = r < R ? bias[r < R ? r : 0] : 0.0f;
        }
        const unsigned int rt = t0 + lane - nq;  // residual token (residual chunks only)
        const bool valid = quant || rt < nr;
        if (quant) {
            KA_UNROLL
            for (unsigned int w = 0; w < W; ++w) {
                const unsigned int hi = kw[w] >> (LOW * BITS);
                KA_UNROLL
                for (unsigned int cc = 0; cc < CPW; ++cc) {
                    const float x = cc < LOW ? ka_code(kw[w] & (MASK << (cc * BITS))) : ka_code(hi & (MASK << ((cc - LOW) * BITS)));
                    const KA_TG float4* f = (const KA_TG float4*)(qs + (w * CPW + cc) * RP);
                    KA_UNROLL
                    for (unsigned int r4 = 0; r4 < RP / 4; ++r4) {
                        const float4 v = f[r4];
                        s[4 * r4] += v.x * x;
                        s[4 * r4 + 1] += v.y * x;
                        s[4 * r4 + 2] += v.z * x;
                        s[4 * r4 + 3] += v.w * x;
                    }
                }
            }
        } else if (valid) {
            const KA_DEV T* kr = rk + (bh * RC + rt) * D;
            KA_UNROLL_4
            for (unsigned int d = 0; d < D; ++d) {
                const float x = static_cast<float>(kr[d]);
                const KA_TG float4* f = (const KA_TG float4*)(qs + d * RP);
                KA_UNROLL
                for (unsigned int r4 = 0; r4 < RP / 4; ++r4) {
                    const float4 v = f[r4];
                    s[4 * r4] += v.x * x;
                    s[4 * r4 + 1] += v.y * x;
                    s[4 * r4 + 2] += v.z * x;
                    s[4 * r4 + 3] += v.w * x;
                }
            }
        }
@SOFTMAX@
@P_STORE@
        KA_SYNCWARP;
        // p·V: lane (vw, vj) takes word vw of tokens vj, vj + P, ...
        KA_UNROLL
        for (unsigned int i = 0; i < W; ++i) {
            const unsigned int tl = i * P + vj;
            float pt[RP];
            const KA_TG float4* pin = (const KA_TG float4*)(ps + tl * RP);
            KA_UNROLL
            for (unsigned int r4 = 0; r4 < RP / 4; ++r4) {
                const float4 v = pin[r4];
                pt[4 * r4] = v.x;
                pt[4 * r4 + 1] = v.y;
                pt[4 * r4 + 2] = v.z;
                pt[4 * r4 + 3] = v.w;
            }
            if (quant) {
                const unsigned int word = vc[(bh * SC + t0 + tl) * W + vw];
                const float2 vpar = ka_pair(vp, (bh * SC + t0 + tl) * NGV + jj);
                const unsigned int hi = word >> (LOW * BITS);
                float pv[R];
                KA_UNROLL
                for (unsigned int r = 0; r < R; ++r) {
                    pv[r] = pt[r] * vpar.x;
                    zacc[r] += pt[r] * vpar.y;
                }
                KA_UNROLL
                for (unsigned int cc = 0; cc < CPW; ++cc) {
                    const float x = cc < LOW ? ka_code(word & (MASK << (cc * BITS))) : ka_code(hi & (MASK << ((cc - LOW) * BITS)));
                    KA_UNROLL
                    for (unsigned int r = 0; r < R; ++r) {
                        acc[r][cc] += pv[r] * x;
                    }
                }
            } else if (t0 + tl - nq < nr) {
                const KA_DEV T* vr = rv + (bh * RC + t0 + tl - nq) * D + vw * CPW;
                KA_UNROLL
                for (unsigned int cc = 0; cc < CPW; ++cc) {
                    // times 2^off, which the final scaling of acc undoes (exactly: powers of two)
                    const float x = static_cast<float>(vr[cc]) * ka_pow2(cc < LOW ? cc * BITS : (cc - LOW) * BITS);
                    KA_UNROLL
                    for (unsigned int r = 0; r < R; ++r) {
                        acc[r][cc] += pt[r] * x;
                    }
                }
            }
        }
    }
    // the warp's totals: sums over the lanes that share a word, the sum over all lanes
    KA_UNROLL
    for (unsigned int r = 0; r < R; ++r) {
        KA_UNROLL
        for (unsigned int o = 16; o > 0; o /= 2) {
            lsum[r] += ka_shfl_xor(lsum[r], o);
        }
        KA_UNROLL
        for (unsigned int o = W; o < 32; o *= 2) {
            zacc[r] += ka_shfl_xor(zacc[r], o);
            KA_UNROLL
            for (unsigned int cc = 0; cc < CPW; ++cc) {
                acc[r][cc] += ka_shfl_xor(acc[r][cc], o);
            }
        }
    }
    KA_BARRIER;  // every warp is done with qs and ps
    KA_TG float* mine = sh + warp * PS;
    if (vj == 0u) {
        KA_UNROLL
        for (unsigned int r = 0; r < R; ++r) {
            KA_UNROLL
            for (unsigned int cc = 0; cc < CPW; ++cc) {
                const float f = ka_pow2m(cc < LOW ? cc * BITS : (cc - LOW) * BITS);
                mine[r * (D + 2) + vw * CPW + cc] = acc[r][cc] * f + zacc[r];
            }
            if (lane == 0u) {
                mine[r * (D + 2) + D] = m[r];
                mine[r * (D + 2) + D + 1] = lsum[r];
            }
        }
    }
    KA_BARRIER;
    // the block's partial: its warps merged
    KA_DEV float* part = (KA_DEV float*)scratch + (bh * NSP + split) * PS;
    for (unsigned int e = tid; e < R * (D + 2); e += NW * 32u) {
        const unsigned int r = e / (D + 2), d = e % (D + 2);
        float mx_ = ninf;
        for (unsigned int w = 0; w < NW; ++w) {
            mx_ = ka_max(mx_, sh[w * PS + r * (D + 2) + D]);
        }
        float tot = 0.0f;
        if (d == D) {
            tot = mx_;
        } else if (mx_ != ninf) {
            for (unsigned int w = 0; w < NW; ++w) {
                const float mw = sh[w * PS + r * (D + 2) + D];
                const float a = mw == ninf ? 0.0f : ka_exp(mw - mx_);
                tot += a * sh[w * PS + r * (D + 2) + d];
            }
        }
        part[e] = tot;
    }
    KA_FENCE;
    KA_BARRIER;
    if (tid == 0u) {
        last = ka_atomic_inc(counters, bh) == nsplit - 1u ? 1u : 0u;
    }
    KA_BARRIER;
    if (last != 0u) {
        // every split's max per head, in parallel, then their weights exp(m_k - M) in shared memory,
        // then each output a sum over the splits (independent loads)
        KA_FENCE;
        const KA_DEV float* all = (const KA_DEV float*)scratch + bh * NSP * PS;
        KA_TG float* wts = sh;  // [nsplit][R]
        KA_TG float* mxs = sh + NSMAX * R;  // [R]
        for (unsigned int e = tid; e < nsplit * R; e += NW * 32u) {
            wts[e] = ka_load(all + (e / R) * PS + (e % R) * (D + 2) + D);
        }
        KA_BARRIER;
        for (unsigned int r = tid; r < R; r += NW * 32u) {
            float mx_ = ninf;
            for (unsigned int k = 0; k < nsplit; ++k) {
                mx_ = ka_max(mx_, wts[k * R + r]);
            }
            mxs[r] = mx_;
        }
        KA_BARRIER;
        for (unsigned int e = tid; e < nsplit * R; e += NW * 32u) {
            const float mk = wts[e];
            wts[e] = mk == ninf ? 0.0f : ka_exp(mk - mxs[e % R]);
        }
        KA_BARRIER;
        for (unsigned int e = tid; e < R * D; e += NW * 32u) {
            const unsigned int r = e / D, d = e % D;
            float num = 0.0f, den = 0.0f;
            KA_UNROLL_8
            for (unsigned int k = 0; k < nsplit; ++k) {
                const float a = wts[k * R + r];
                num += a * ka_load(all + k * PS + r * (D + 2) + d);
                den += a * ka_load(all + k * PS + r * (D + 2) + D + 1);
            }
            out[(bh * R + r) * D + d] = static_cast<T>(num / den);
        }
        if (tid == 0u) {
            ka_atomic_reset(counters, bh);
        }
    }
"""

# v3 (this window): v2's arithmetic with the loads restructured for latency. Nsight Compute on v2
# (third H200 window): 25 % occupancy, warps waiting 51 % of their time on their own global loads.
# Here a chunk's loads (key words and parameters, value words, the value parameters of the lane's
# token) are all issued at once, one round trip per chunk instead of three; with PF = 1 they are
# issued one chunk ahead (registers double-buffered), so a chunk's arithmetic covers the next one's
# latency. The value parameters go through shared memory (one load per token, not per token and
# word), and p and those parameters reuse the folded query's shared memory (it is dead by then).
_BODY_V3 = """
    constexpr unsigned int W = D * BITS / 32;  // words per token
    constexpr unsigned int CPW = 32 / BITS;  // codes per word
    constexpr unsigned int MASK = (1u << BITS) - 1u;
    constexpr unsigned int LOW = 23 / BITS < CPW ? 23 / BITS : CPW;  // fields read in place (see v2)
    constexpr unsigned int P = 32 / W;  // tokens per pass of the values loop
    constexpr unsigned int DL = D / 32;  // channels per lane in per-channel loops
    constexpr unsigned int RP = (R + 3) / 4 * 4;  // query heads padded to float4
    constexpr unsigned int NGV = (D + G - 1) / G;
    constexpr unsigned int PS = R * (D + 2);  // one partial: acc[R][D], m[R], l[R]
    constexpr unsigned int AHEAD = PF;  // chunks whose loads are in flight ahead of the arithmetic
    // shared: the scaled query [D][RP]; per warp its folded query [D][RP], which after the scores
    // holds p [32][RP] and the value parameters [32][NGV]; after the loop the warps' partials, at
    // the end the final merge's weights
    constexpr unsigned int PV = 32 * (RP + NGV);
    constexpr unsigned int WS = D * RP > PV ? D * RP : PV;
    constexpr unsigned int SHQ = D * RP + NW * WS;
@SETUP@

    KA_TG float* qsh = sh;  // [D][RP]: the query times the softmax scale, every head of the group
    KA_TG float* qs = sh + D * RP + warp * WS;  // [D][RP]: this warp's folded query
    KA_TG float* ps = qs;  // [32][RP]: p of the chunk's tokens (after the scores)
    KA_TG unsigned int* vps = (KA_TG unsigned int*)(qs + 32 * RP);  // [32][NGV]: their value parameters
    for (unsigned int e = tid; e < D * RP; e += NW * 32u) {
        const unsigned int d = e / RP, r = e % RP;
        qsh[e] = r < R ? static_cast<float>(q[(bh * R + r) * D + d]) * sm : 0.0f;
    }
    KA_BARRIER;
    float m[R], lsum[R], zacc[R], acc[R][CPW];
    KA_UNROLL
    for (unsigned int r = 0; r < R; ++r) {
        m[r] = ninf;
        lsum[r] = 0.0f;
        zacc[r] = 0.0f;
        KA_UNROLL
        for (unsigned int c = 0; c < CPW; ++c) {
            acc[r][c] = 0.0f;
        }
    }
    const unsigned int vw = lane % W;  // values loop: this lane's word
    const unsigned int vj = lane / W;  // and its first token
    const unsigned int jj = (vw * CPW) / G;  // its value group

    // a chunk's loads: key words (lane = token), key parameters (lane = channel), value words
    // (lane = word vw of tokens vj, vj + P, ...), value parameters (lane = token)
    unsigned int kw[W], kq[DL], vv[W], vq[NGV];  // the chunk the arithmetic works on
    unsigned int nkw[W], nkq[DL], nvv[W], nvq[NGV];  // the chunk whose loads were issued last
    for (unsigned int it = 0;; ++it) {
        const unsigned int cl = c0 + warp + it * NW;  // the chunk whose loads this pass issues
        if (AHEAD) {
            KA_UNROLL
            for (unsigned int i = 0; i < W; ++i) {
                kw[i] = nkw[i];
                vv[i] = nvv[i];
            }
            KA_UNROLL
            for (unsigned int i = 0; i < DL; ++i) {
                kq[i] = nkq[i];
            }
            KA_UNROLL
            for (unsigned int i = 0; i < NGV; ++i) {
                vq[i] = nvq[i];
            }
        }
        if (cl < c1 && cl < nqc) {
            const unsigned int g = cl * 32u / G;
            const KA_DEV unsigned int* kb = kc + ((bh * NGC + g) * W) * G + (cl * 32u + lane) % G;
            KA_UNROLL
            for (unsigned int w = 0; w < W; ++w) {
                nkw[w] = kb[w * G];
            }
            KA_UNROLL
            for (unsigned int i = 0; i < DL; ++i) {
                nkq[i] = ka_pair_bits(kp, (bh * NGC + g) * D + lane + 32u * i);
            }
            const KA_DEV unsigned int* vb = vc + (bh * SC + cl * 32u + vj) * W + vw;
            KA_UNROLL
            for (unsigned int i = 0; i < W; ++i) {
                nvv[i] = vb[i * P * W];
            }
            KA_UNROLL
            for (unsigned int j = 0; j < NGV; ++j) {
                nvq[j] = ka_pair_bits(vp, (bh * SC + cl * 32u + lane) * NGV + j);
            }
        }
        if (!AHEAD) {
            KA_UNROLL
            for (unsigned int i = 0; i < W; ++i) {
                kw[i] = nkw[i];
                vv[i] = nvv[i];
            }
            KA_UNROLL
            for (unsigned int i = 0; i < DL; ++i) {
                kq[i] = nkq[i];
            }
            KA_UNROLL
            for (unsigned int i = 0; i < NGV; ++i) {
                vq[i] = nvq[i];
            }
        }
        if (it < AHEAD) {
            continue;
        }
        const unsigned int c = cl - AHEAD * NW;  // the chunk the arithmetic works on
        if (c >= c1) {
            break;
        }
        const bool quant = c < nqc;
        const unsigned int t0 = c * 32u;
        float bias[R];
        KA_UNROLL
        for (unsigned int r = 0; r < R; ++r) {
            bias[r] = 0.0f;
        }
        KA_SYNCWARP;  // the previous chunk is done with p and the value parameters (qs's memory)
        KA_UNROLL
        for (unsigned int i = 0; i < DL; ++i) {
            const unsigned int d = lane + 32u * i;
            const unsigned int cc = d % CPW;
            const float2 kpar = ka_unpair(kq[i]);
            const float f = quant ? ka_pow2m(cc < LOW ? cc * BITS : (cc - LOW) * BITS) : 1.0f;
            const float s = quant ? kpar.x * f : 1.0f;
            const float z = quant ? kpar.y : 0.0f;
            const KA_TG float4* qa = (const KA_TG float4*)(qsh + d * RP);
            KA_TG float4* qo = (KA_TG float4*)(qs + d * RP);
            KA_UNROLL
            for (unsigned int r4 = 0; r4 < RP / 4; ++r4) {
                const float4 a = qa[r4];
                qo[r4] = ka_f4(a.x * s, a.y * s, a.z * s, a.w * s);
                const float av[4] = {a.x, a.y, a.z, a.w};
                KA_UNROLL
                for (unsigned int k = 0; k < 4; ++k) {
                    if (4 * r4 + k < R) {
                        bias[4 * r4 + k < R ? 4 * r4 + k : 0] += av[k] * z;
                    }
                }
            }
        }
        if (quant) {
            KA_UNROLL
            for (unsigned int r = 0; r < R; ++r) {
                KA_UNROLL
                for (unsigned int o = 16; o > 0; o /= 2) {
                    bias[r] += ka_shfl_xor(bias[r], o);
                }
            }
        }
        KA_SYNCWARP;
        // scores: lane = token t0 + lane
        float s[RP];
        KA_UNROLL
        for (unsigned int r = 0; r < RP; ++r) {
            s[r] = r < R ? bias[r < R ? r : 0] : 0.0f;
        }
        const unsigned int rt = t0 + lane - nq;  // residual token (residual chunks only)
        const bool valid = quant || rt < nr;
        if (quant) {
            KA_UNROLL
            for (unsigned int w = 0; w < W; ++w) {
                const unsigned int hi = kw[w] >> (LOW * BITS);
                KA_UNROLL
                for (unsigned int cc = 0; cc < CPW; ++cc) {
                    const float x = cc < LOW ? ka_field(kw[w], MASK << (cc * BITS)) : ka_field(hi, MASK << ((cc - LOW) * BITS));
                    const KA_TG float4* f = (const KA_TG float4*)(qs + (w * CPW + cc) * RP);
                    KA_UNROLL
                    for (unsigned int r4 = 0; r4 < RP / 4; ++r4) {
                        const float4 v = f[r4];
                        s[4 * r4] += v.x * x;
                        s[4 * r4 + 1] += v.y * x;
                        s[4 * r4 + 2] += v.z * x;
                        s[4 * r4 + 3] += v.w * x;
                    }
                }
            }
        } else if (valid) {
            const KA_DEV T* kr = rk + (bh * RC + rt) * D;
            KA_UNROLL_4
            for (unsigned int d = 0; d < D; ++d) {
                const float x = static_cast<float>(kr[d]);
                const KA_TG float4* f = (const KA_TG float4*)(qs + d * RP);
                KA_UNROLL
                for (unsigned int r4 = 0; r4 < RP / 4; ++r4) {
                    const float4 v = f[r4];
                    s[4 * r4] += v.x * x;
                    s[4 * r4 + 1] += v.y * x;
                    s[4 * r4 + 2] += v.z * x;
                    s[4 * r4 + 3] += v.w * x;
                }
            }
        }
@SOFTMAX@
        KA_SYNCWARP;  // every lane is done with the folded query: p and the parameters take its place
@P_STORE@
        if (quant) {
            KA_UNROLL
            for (unsigned int j = 0; j < NGV; ++j) {
                vps[lane * NGV + j] = vq[j];
            }
        }
        KA_SYNCWARP;
        // p·V: lane (vw, vj) takes word vw of tokens vj, vj + P, ...; the branch outside the loop,
        // so the compiler schedules across tokens
        if (quant) {
            KA_UNROLL
            for (unsigned int i = 0; i < W; ++i) {
                const unsigned int tl = i * P + vj;
                const float4 p4 = ((const KA_TG float4*)(ps + tl * RP))[0];
                const float2 vpar = ka_unpair(vps[tl * NGV + jj]);
                const unsigned int hi = vv[i] >> (LOW * BITS);
                float pv[R];
                KA_UNROLL
                for (unsigned int r = 0; r < R; ++r) {
                    const float pr = r % 4 == 0 ? p4.x : r % 4 == 1 ? p4.y : r % 4 == 2 ? p4.z : p4.w;
                    const float pt = r < 4 ? pr : ps[tl * RP + r];
                    pv[r] = pt * vpar.x;
                    zacc[r] += pt * vpar.y;
                }
                KA_UNROLL
                for (unsigned int cc = 0; cc < CPW; ++cc) {
                    const float x = cc < LOW ? ka_field(vv[i], MASK << (cc * BITS)) : ka_field(hi, MASK << ((cc - LOW) * BITS));
                    KA_UNROLL
                    for (unsigned int r = 0; r < R; ++r) {
                        acc[r][cc] += pv[r] * x;
                    }
                }
            }
        } else {
            KA_UNROLL
            for (unsigned int i = 0; i < W; ++i) {
                const unsigned int tl = i * P + vj;
                if (t0 + tl - nq < nr) {
                    const KA_DEV T* vr = rv + (bh * RC + t0 + tl - nq) * D + vw * CPW;
                    KA_UNROLL
                    for (unsigned int cc = 0; cc < CPW; ++cc) {
                        // times 2^off, which the final scaling of acc undoes (exactly: powers of two)
                        const float x = static_cast<float>(vr[cc]) * ka_pow2(cc < LOW ? cc * BITS : (cc - LOW) * BITS);
                        KA_UNROLL
                        for (unsigned int r = 0; r < R; ++r) {
                            acc[r][cc] += ps[tl * RP + r] * x;
                        }
                    }
                }
            }
        }
    }
"""
_BODY_V3 += _BODY[_BODY.index("    // the warp's totals"):]
_BODY, _BODY_V3 = (
    b.replace("@SETUP@\n", _SETUP).replace("@SOFTMAX@\n", _SOFTMAX).replace("@P_STORE@\n", _P_STORE)
    for b in (_BODY, _BODY_V3)
)

# v4: the dot products on tensor cores. mma.sync m16n8k16 bf16 -> f32. Codes are
# small integers, exact in bfloat16; the other operand (the folded query for the scores, p times the
# value scale for p·V) is a float32 split into bf16 hi + lo, hi in rows 0-7 of the mma's A operand
# and lo in rows 8-15 (the GQA group has at most 8 heads, so the padding rows carry the low halves:
# one mma does both), the two row halves' sums added at the end. Per warp, its chunks (32 quantized
# tokens) are staged in its own shared memory with cp.async, double buffered (the next chunk's
# bytes in flight during this one's arithmetic); residual chunks (after the quantized ones) go
# through CUDA cores, their own running state, merged with the block's other partials.
# CUDA only (Metal has no mma.sync; the dispatch keeps v3 there).
_V4_HEADER = r"""
// (x & (M | M << 16)) | bf16x2(128, 128) is bf16x2(128 + c0, 128 + c1) for codes c < 128 (the code
// in the mantissa of 128.0); one fma takes 128 off exactly: bf16x2(c0, c1)
template <unsigned int M2>
__device__ __forceinline__ unsigned int kv4_pair(unsigned int x) {
    unsigned int r;
    asm("lop3.b32 %0, %1, %2, %3, 0xEA;" : "=r"(r) : "r"(x), "r"(M2), "r"(0x43004300u));
    asm("fma.rn.bf16x2 %0, %1, %2, %3;" : "=r"(r) : "r"(r), "r"(0x3F803F80u), "r"(0xC300C300u));
    return r;
}
// (a, b) -> bf16x2 hi = (rn(a), rn(b)) in the low and high halves, lo = rn of what hi misses
__device__ __forceinline__ void kv4_split(float a, float b, unsigned int& hi, unsigned int& lo) {
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(hi) : "f"(b), "f"(a));
    const float ra = a - __uint_as_float(hi << 16), rb = b - __uint_as_float(hi & 0xffff0000u);
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(lo) : "f"(rb), "f"(ra));
}
__device__ __forceinline__ void kv4_mma(float* c, const unsigned int* a, unsigned int b0, unsigned int b1) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
__device__ __forceinline__ void kv4_cp16(const void* dst, const void* src) {
    const unsigned int d = (unsigned int)__cvta_generic_to_shared(dst);
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" :: "r"(d), "l"(src));
}
// 4 consecutive values of the residual (T: float16/bfloat16 in 8 bytes, float32 in 16) in one load
template <typename T>
__device__ __forceinline__ void kv4_ld4(const T* p, float* x) {
    const uint2 w = *reinterpret_cast<const uint2*>(p);
    const T* h = reinterpret_cast<const T*>(&w);
    x[0] = static_cast<float>(h[0]); x[1] = static_cast<float>(h[1]);
    x[2] = static_cast<float>(h[2]); x[3] = static_cast<float>(h[3]);
}
template <>
__device__ __forceinline__ void kv4_ld4<float>(const float* p, float* x) {
    const float4 w = *reinterpret_cast<const float4*>(p);
    x[0] = w.x; x[1] = w.y; x[2] = w.z; x[3] = w.w;
}
__device__ __forceinline__ void kv4_commit() { asm volatile("cp.async.commit_group;"); }
__device__ __forceinline__ void kv4_wait1() { asm volatile("cp.async.wait_group 1;" ::: "memory"); }
__device__ __forceinline__ void kv4_wait0() { asm volatile("cp.async.wait_all;" ::: "memory"); }
"""

_BODY_V4 = """
    constexpr unsigned int W = D * BITS / 32;  // words per token
    constexpr unsigned int CPW = 32 / BITS;  // codes per word
    constexpr unsigned int MASK = (1u << BITS) - 1u;
    constexpr unsigned int M2 = MASK | (MASK << 16);
    constexpr unsigned int HC = CPW / 2;  // a pair: fields j and j + HC of one word (bits 16 apart)
    constexpr unsigned int KT = D / 16;  // score k-tiles (16 channels)
    constexpr unsigned int KI = W / 4;  // key words per lane and token (lane t: words t, t + 4, ...)
    constexpr unsigned int KH = CPW / 4;  // k-tiles per key word
    constexpr unsigned int NB = D / 32;  // value blocks of 32 channels (inside one value group)
    constexpr unsigned int NT = D / 8;  // value n-tiles (8 channels)
    constexpr unsigned int NGV = (D + G - 1) / G;
    constexpr unsigned int WQ = W / 4;  // 16-byte pieces per token's value words
    constexpr unsigned int RP = (R + 3) / 4 * 4;
    constexpr unsigned int DL = D / 32;
    constexpr unsigned int PS = R * (D + 2);
    // a stage: key words [W][32] (16-byte pieces swizzled by the word, no bank conflicts when lanes
    // (g, t) read word t + 4i of token g), key parameters [D], value words [32][W] (pieces swizzled by
    // the token pair), value parameters [32][NGV]
    constexpr unsigned int SK = 0, SKP = W * 32, SV = SKP + D, SVP = SV + 32 * W, STG = SVP + 32 * NGV;
    constexpr unsigned int RES = (D + 32) * RP;  // the residual loop's query and p, over the stages
    constexpr unsigned int WA = 2 * STG > RES ? 2 * STG : RES;
    constexpr unsigned int SHQ = NW * WA > V4P * NW * PS ? NW * WA : V4P * NW * PS;
@SETUP@
    const unsigned int g = lane / 4u, t = lane % 4u;  // the mma's lane coordinates
    KA_TG unsigned int* wsh = (KA_TG unsigned int*)(sh + warp * WA);
    // this lane's query channels (head g), times the softmax scale: k-tile (i, h), k = 2t + e is
    // channel CPW (t + 4i) + 2h + e HC, k = 2t + 8 + e is that + 1
    float qv[KT][4];
    KA_UNROLL
    for (unsigned int i = 0; i < KI; ++i) {
        KA_UNROLL
        for (unsigned int h = 0; h < KH; ++h) {
            const unsigned int c = CPW * (t + 4u * i) + 2u * h;
            const unsigned int cs[4] = {c, c + HC, c + 1u, c + 1u + HC};
            KA_UNROLL
            for (unsigned int k = 0; k < 4; ++k) {
                qv[i * KH + h][k] = g < R ? static_cast<float>(q[(bh * R + g) * D + cs[k]]) * sm : 0.0f;
            }
        }
    }
    // value n-tile v = 4 kb + u, column n: channel 32 kb + hw(n) * (16 / BITS) + fo(n) + u; lane g's
    // column: half-word hw of the block's words, fields fo .. fo + 3 of it
    const unsigned int hw = g % (2u * BITS), fo = (g / (2u * BITS)) * 4u;
    const unsigned int sel = hw % 2u ? 0x7632u : 0x5410u;  // prmt: the two tokens' high or low halves
    float m = ninf, l = 0.0f, zacc[NGV], acc[NT][4];
    KA_UNROLL
    for (unsigned int j = 0; j < NGV; ++j) {
        zacc[j] = 0.0f;
    }
    KA_UNROLL
    for (unsigned int v = 0; v < NT; ++v) {
        acc[v][0] = acc[v][1] = acc[v][2] = acc[v][3] = 0.0f;
    }
    const unsigned int cq1 = ka_umin(c1, nqc);
    // issue chunk c's copies into stage st (16 bytes each, the warp's lanes in turn)
    // issue chunk cl's copies into stage st (16 bytes each, the warp's lanes in turn)
    auto load = [&](unsigned int cl, unsigned int st) {
        KA_TG unsigned int* sb = wsh + st * STG;
        const unsigned int grp = cl * 32u / G;
        const unsigned int* kb = kc + ((bh * NGC + grp) * W) * G + (cl * 32u) % G;
        for (unsigned int e = lane; e < W * 8u; e += 32u) {
            const unsigned int w = e / 8u, tc = e % 8u;
            kv4_cp16(sb + SK + w * 32u + ((tc ^ (2u * (w % 4u))) * 4u), kb + w * G + tc * 4u);
        }
        const unsigned int* pb = (const unsigned int*)kp + (bh * NGC + grp) * D;
        for (unsigned int e = lane; e < D / 4u; e += 32u) {
            kv4_cp16(sb + SKP + e * 4u, pb + e * 4u);
        }
        const unsigned int* vb = vc + (bh * SC + cl * 32u) * W;
        for (unsigned int e = lane; e < 8u * W; e += 32u) {
            const unsigned int tk = e / WQ, pc = e % WQ;
            kv4_cp16(sb + SV + tk * W + ((pc ^ ((tk / 2u) % WQ)) * 4u), vb + e * 4u);
        }
        const unsigned int* qb = (const unsigned int*)vp + (bh * SC + cl * 32u) * NGV;
        for (unsigned int e = lane; e < 8u * NGV; e += 32u) {
            kv4_cp16(sb + SVP + e * 4u, qb + e * 4u);
        }
    };
    unsigned int c = c0 + warp;
    if (c < cq1) {
        load(c, 0u);
    }
    kv4_commit();
    for (unsigned int st = 0; c < cq1; c += NW, st ^= 1u) {
        if (c + NW < cq1) {
            load(c + NW, st ^ 1u);
        }
        kv4_commit();
        kv4_wait1();
        KA_SYNCWARP;
        const KA_TG unsigned int* sb = wsh + st * STG;
        // the folded query (A: rows g = hi, g + 8 = lo) and the zeros' bias of head g
        unsigned int af[KT][4];
        float bias = 0.0f;
        KA_UNROLL
        for (unsigned int i = 0; i < KI; ++i) {
            KA_UNROLL
            for (unsigned int h = 0; h < KH; ++h) {
                const unsigned int c_ = CPW * (t + 4u * i) + 2u * h;
                const unsigned int cs[4] = {c_, c_ + HC, c_ + 1u, c_ + 1u + HC};
                float x[4];
                KA_UNROLL
                for (unsigned int k = 0; k < 4; ++k) {
                    const float2 sz = ka_unpair(sb[SKP + cs[k]]);
                    x[k] = qv[i * KH + h][k] * sz.x;
                    bias += qv[i * KH + h][k] * sz.y;
                }
                kv4_split(x[0], x[1], af[i * KH + h][0], af[i * KH + h][1]);
                kv4_split(x[2], x[3], af[i * KH + h][2], af[i * KH + h][3]);
            }
        }
        bias += ka_shfl_xor(bias, 1u);
        bias += ka_shfl_xor(bias, 2u);
        // scores: n-tile u = tokens 8u .. 8u + 7 (B column g = token 8u + g); lane (g, t) gets head
        // g's scores of tokens 8u + 2t + e as rows g (hi) + g + 8 (lo)
        float s[4][2];
        KA_UNROLL
        for (unsigned int u = 0; u < 4; ++u) {
            float cc[4] = {bias, bias, 0.0f, 0.0f};
            const unsigned int tok = 8u * u + g;
            KA_UNROLL
            for (unsigned int i = 0; i < KI; ++i) {
                const unsigned int w = t + 4u * i;
                const unsigned int x = sb[SK + w * 32u + (((tok / 4u) ^ (2u * t)) * 4u) + tok % 4u];
                KA_UNROLL
                for (unsigned int h = 0; h < KH; ++h) {
                    kv4_mma(cc, af[i * KH + h], kv4_pair<M2>(x >> (BITS * 2u * h)), kv4_pair<M2>(x >> (BITS * (2u * h + 1u))));
                }
            }
            s[u][0] = cc[0] + cc[2];
            s[u][1] = cc[1] + cc[3];
        }
@V4SOFTMAX@
        // p·V: k-tile kk = tokens 16 kk .. 16 kk + 15: k = 2t + e is token 16 kk + 2t + e (p of
        // n-tile 2 kk), k = 2t + 8 + e token 16 kk + 8 + 2t + e (n-tile 2 kk + 1)
        KA_UNROLL
        for (unsigned int kk = 0; kk < 2; ++kk) {
            const unsigned int tk[4] = {16u * kk + 2u * t, 16u * kk + 2u * t + 1u, 16u * kk + 8u + 2u * t, 16u * kk + 9u + 2u * t};
            const float pk[4] = {s[2 * kk][0], s[2 * kk][1], s[2 * kk + 1][0], s[2 * kk + 1][1]};
            KA_UNROLL
            for (unsigned int kb = 0; kb < NB; ++kb) {
                const unsigned int j = 32u * kb / G;
                unsigned int a[4];
                float xs[4];
                KA_UNROLL
                for (unsigned int e = 0; e < 4; ++e) {
                    const float2 sz = ka_unpair(sb[SVP + tk[e] * NGV + j]);
                    xs[e] = pk[e] * sz.x;
                    if (32u * kb % G == 0u) {
                        zacc[j] += pk[e] * sz.y;
                    }
                }
                kv4_split(xs[0], xs[1], a[0], a[1]);
                kv4_split(xs[2], xs[3], a[2], a[3]);
                const unsigned int wd = BITS * kb + hw / 2u;  // the word of lane g's half-word
                unsigned int xw[4];
                KA_UNROLL
                for (unsigned int e = 0; e < 4; ++e) {
                    xw[e] = sb[SV + tk[e] * W + (((wd / 4u) ^ ((tk[e] / 2u) % WQ)) * 4u) + wd % 4u];
                }
                const unsigned int y01 = __byte_perm(xw[0], xw[1], sel), y23 = __byte_perm(xw[2], xw[3], sel);
                KA_UNROLL
                for (unsigned int u = 0; u < 4; ++u) {
                    kv4_mma(acc[4 * kb + u], a, kv4_pair<M2>(y01 >> (BITS * (fo + u))), kv4_pair<M2>(y23 >> (BITS * (fo + u))));
                }
            }
        }
        KA_SYNCWARP;  // every lane is done with this stage before the next pass refills it
    }
    kv4_wait0();
@V4TAIL@
"""

_V4_SOFTMAX = """
        // online softmax: lane (g, t) holds 8 of head g's 32 scores; the max over t by two shuffles
        float cm = ka_max(ka_max(ka_max(s[0][0], s[0][1]), ka_max(s[1][0], s[1][1])),
                          ka_max(ka_max(s[2][0], s[2][1]), ka_max(s[3][0], s[3][1])));
        cm = ka_max(cm, ka_shfl_xor(cm, 1u));
        cm = ka_max(cm, ka_shfl_xor(cm, 2u));
        if (ka_any(cm > m)) {
            const float mn = ka_max(m, cm);
            const float alpha = ka_exp(m - mn);  // 0 on the first chunk (m = -inf)
            l *= alpha;
            KA_UNROLL
            for (unsigned int j = 0; j < NGV; ++j) {
                zacc[j] *= alpha;
            }
            KA_UNROLL
            for (unsigned int v = 0; v < NT; ++v) {
                acc[v][0] *= alpha;
                acc[v][1] *= alpha;
                acc[v][2] *= alpha;
                acc[v][3] *= alpha;
            }
            m = mn;
        }
        KA_UNROLL
        for (unsigned int u = 0; u < 4; ++u) {
            s[u][0] = ka_exp(s[u][0] - m);
            s[u][1] = ka_exp(s[u][1] - m);
            l += s[u][0] + s[u][1];
        }
"""

_V4_RES_CUDA_CORES = """
    l += ka_shfl_xor(l, 1u);
    l += ka_shfl_xor(l, 2u);
    KA_UNROLL
    for (unsigned int j = 0; j < NGV; ++j) {
        zacc[j] += ka_shfl_xor(zacc[j], 1u);
        zacc[j] += ka_shfl_xor(zacc[j], 2u);
    }
    // the residual chunks of this warp (after the quantized ones): CUDA cores, lane = token, as v3
    // does them, their own running state; the warp's stages hold the scaled query and p
    KA_SYNCWARP;
    KA_TG float* qres = (KA_TG float*)wsh;  // [D][RP]
    KA_TG float* ps = qres + D * RP;  // [32][RP]
    for (unsigned int e = lane; e < D * RP; e += 32u) {
        const unsigned int d = e / RP, r = e % RP;
        qres[e] = r < R ? static_cast<float>(q[(bh * R + r) * D + d]) * sm : 0.0f;
    }
    KA_SYNCWARP;
    float m2[R], l2[R], a2[R][DL];
    KA_UNROLL
    for (unsigned int r = 0; r < R; ++r) {
        m2[r] = ninf;
        l2[r] = 0.0f;
        KA_UNROLL
        for (unsigned int i = 0; i < DL; ++i) {
            a2[r][i] = 0.0f;
        }
    }
    for (unsigned int cr = c; cr < c1; cr += NW) {
        const unsigned int rt = cr * 32u + lane - nq;
        const bool valid = rt < nr;
        float sr[R];
        KA_UNROLL
        for (unsigned int r = 0; r < R; ++r) {
            sr[r] = 0.0f;
        }
        if (valid) {
            const KA_DEV T* kr = rk + (bh * RC + rt) * D;
            KA_UNROLL_4
            for (unsigned int d = 0; d < D; ++d) {
                const float x = static_cast<float>(kr[d]);
                KA_UNROLL
                for (unsigned int r = 0; r < R; ++r) {
                    sr[r] += qres[d * RP + r] * x;
                }
            }
        }
        KA_UNROLL
        for (unsigned int r = 0; r < R; ++r) {
            float cm = valid ? sr[r] : ninf;
            KA_UNROLL
            for (unsigned int o = 16; o > 0; o /= 2) {
                cm = ka_max(cm, ka_shfl_xor(cm, o));
            }
            const float mn = ka_max(m2[r], cm);
            const float alpha = ka_exp(m2[r] - mn);
            l2[r] *= alpha;
            KA_UNROLL
            for (unsigned int i = 0; i < DL; ++i) {
                a2[r][i] *= alpha;
            }
            m2[r] = mn;
            ps[lane * RP + r] = valid ? ka_exp(sr[r] - mn) : 0.0f;
        }
        KA_SYNCWARP;
        const unsigned int nt = ka_umin(32u, nq + nr - cr * 32u);
        for (unsigned int tt = 0; tt < nt; ++tt) {
            const KA_DEV T* vr = rv + (bh * RC + cr * 32u + tt - nq) * D;
            KA_UNROLL
            for (unsigned int r = 0; r < R; ++r) {
                const float pr = ps[tt * RP + r];
                l2[r] += pr;
                KA_UNROLL
                for (unsigned int i = 0; i < DL; ++i) {
                    a2[r][i] += pr * static_cast<float>(vr[lane + 32u * i]);
                }
            }
        }
        KA_SYNCWARP;
    }
    KA_BARRIER;  // every warp is done with its stages: the partials take their place
    KA_TG float* mine = sh + 2u * warp * PS;  // the tensor-core partial, then the residual one
    if (g < R) {
        KA_UNROLL
        for (unsigned int v = 0; v < NT; ++v) {
            const unsigned int kb = v / 4u, u = v % 4u;
            KA_UNROLL
            for (unsigned int e = 0; e < 2; ++e) {
                const unsigned int n = 2u * t + e;
                const unsigned int ch = 32u * kb + (n % (2u * BITS)) * (16u / BITS) + (n / (2u * BITS)) * 4u + u;
                mine[g * (D + 2) + ch] = (acc[v][e] + acc[v][2 + e]) + zacc[ch / G];
            }
        }
        if (t == 0u) {
            mine[g * (D + 2) + D] = m;
            mine[g * (D + 2) + D + 1] = l;
        }
    }
    KA_UNROLL
    for (unsigned int r = 0; r < R; ++r) {
        KA_UNROLL
        for (unsigned int i = 0; i < DL; ++i) {
            mine[PS + r * (D + 2) + lane + 32u * i] = a2[r][i];
        }
        if (lane == 0u) {
            mine[PS + r * (D + 2) + D] = m2[r];
            mine[PS + r * (D + 2) + D + 1] = l2[r];
        }
    }
    KA_BARRIER;
"""[1:]

_V4_RES_MMA = """
    // the residual chunks of this warp (after its quantized ones) through the same mma path and the
    // same running state: B from the full-precision keys and values (float16/bfloat16 -> bf16 hi + lo
    // is exact, float32 misses 2^-16), A the query times the softmax scale (no key scales, no zeros);
    // lane (g, t) loads key channels CPW (t + 4i) .. + CPW - 1 of token 8u + g (the k order of qv) and
    // value channels 32 kb + hw (16 / BITS) + fo .. + 3 of its four tokens (the n order of acc)
    if (c < c1) {
        unsigned int ar[KT][4];
        KA_UNROLL
        for (unsigned int k = 0; k < KT; ++k) {
            kv4_split(qv[k][0], qv[k][1], ar[k][0], ar[k][1]);
            kv4_split(qv[k][2], qv[k][3], ar[k][2], ar[k][3]);
        }
        const unsigned int vo = hw * (16u / BITS) + fo;
        for (; c < c1; c += NW) {
            const unsigned int r0 = c * 32u - nq;  // the chunk's first residual token
            float s[4][2];
            KA_UNROLL
            for (unsigned int u = 0; u < 4; ++u) {
                float cc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
                const unsigned int rt = r0 + 8u * u + g;
                const KA_DEV T* kr = rk + (bh * RC + (rt < nr ? rt : 0u)) * D;  // past the end: a real row, score dropped
                KA_UNROLL
                for (unsigned int i = 0; i < KI; ++i) {
                    float x[CPW];
                    KA_UNROLL
                    for (unsigned int f = 0; f < CPW; f += 4) {
                        kv4_ld4(kr + CPW * (t + 4u * i) + f, x + f);
                    }
                    KA_UNROLL
                    for (unsigned int h = 0; h < KH; ++h) {
                        unsigned int h0, l0, h1, l1;
                        kv4_split(x[2u * h], x[2u * h + HC], h0, l0);
                        kv4_split(x[2u * h + 1u], x[2u * h + 1u + HC], h1, l1);
                        kv4_mma(cc, ar[i * KH + h], h0, h1);
                        kv4_mma(cc, ar[i * KH + h], l0, l1);
                    }
                }
                s[u][0] = r0 + 8u * u + 2u * t < nr ? cc[0] + cc[2] : ninf;
                s[u][1] = r0 + 8u * u + 2u * t + 1u < nr ? cc[1] + cc[3] : ninf;
            }
@V4SOFTMAX@
            KA_UNROLL
            for (unsigned int kk = 0; kk < 2; ++kk) {
                const unsigned int tk[4] = {16u * kk + 2u * t, 16u * kk + 2u * t + 1u, 16u * kk + 8u + 2u * t, 16u * kk + 9u + 2u * t};
                unsigned int a[4];
                kv4_split(s[2 * kk][0], s[2 * kk][1], a[0], a[1]);
                kv4_split(s[2 * kk + 1][0], s[2 * kk + 1][1], a[2], a[3]);
                KA_UNROLL
                for (unsigned int kb = 0; kb < NB; ++kb) {
                    float y[4][4];
                    KA_UNROLL
                    for (unsigned int e = 0; e < 4; ++e) {
                        const unsigned int rt = r0 + tk[e];
                        kv4_ld4(rv + (bh * RC + (rt < nr ? rt : 0u)) * D + 32u * kb + vo, y[e]);
                        KA_UNROLL
                        for (unsigned int u = 0; u < 4; ++u) {
                            y[e][u] = rt < nr ? y[e][u] : 0.0f;  // p is 0 there; 0 * inf would not be
                        }
                    }
                    KA_UNROLL
                    for (unsigned int u = 0; u < 4; ++u) {
                        unsigned int h0, l0, h1, l1;
                        kv4_split(y[0][u], y[1][u], h0, l0);
                        kv4_split(y[2][u], y[3][u], h1, l1);
                        kv4_mma(acc[4 * kb + u], a, h0, h1);
                        kv4_mma(acc[4 * kb + u], a, l0, l1);
                    }
                }
            }
        }
    }
    l += ka_shfl_xor(l, 1u);
    l += ka_shfl_xor(l, 2u);
    KA_UNROLL
    for (unsigned int j = 0; j < NGV; ++j) {
        zacc[j] += ka_shfl_xor(zacc[j], 1u);
        zacc[j] += ka_shfl_xor(zacc[j], 2u);
    }
    KA_BARRIER;  // every warp is done with its stages: the partials take their place
    KA_TG float* mine = sh + warp * PS;
    if (g < R) {
        KA_UNROLL
        for (unsigned int v = 0; v < NT; ++v) {
            const unsigned int kb = v / 4u, u = v % 4u;
            KA_UNROLL
            for (unsigned int e = 0; e < 2; ++e) {
                const unsigned int n = 2u * t + e;
                const unsigned int ch = 32u * kb + (n % (2u * BITS)) * (16u / BITS) + (n / (2u * BITS)) * 4u + u;
                mine[g * (D + 2) + ch] = (acc[v][e] + acc[v][2 + e]) + zacc[ch / G];
            }
        }
        if (t == 0u) {
            mine[g * (D + 2) + D] = m;
            mine[g * (D + 2) + D + 1] = l;
        }
    }
    KA_BARRIER;
"""[1:]

_V4_MERGE = """
    if (last != 0u) {
        // the final merge, in two barriers: warp r' takes heads r', r' + NW, ... with its lanes over the
        // splits (max and weighted sum by shuffles), leaving w_k = exp(m_k - M) / Σ_j exp(m_j - M) l_j
        // in shared memory; then every thread sums V4O outputs (pairs of channels) over the splits,
        // the loads of several splits and outputs in flight together (the seventh window's merge
        // waited for one split's two loads per output at a time, 4 outputs per thread in series)
        KA_FENCE;
        const KA_DEV float* all = (const KA_DEV float*)scratch + bh * NSP * PS;
        KA_TG float* wts = sh;  // [nsplit][R]
        for (unsigned int r = warp; r < R; r += NW) {
            float mk[NSMAX / 32], lk[NSMAX / 32], mx_ = ninf;
            KA_UNROLL
            for (unsigned int j = 0; j < NSMAX / 32; ++j) {
                const unsigned int k = lane + 32u * j;
                mk[j] = k < nsplit ? ka_load(all + k * PS + r * (D + 2) + D) : ninf;
                lk[j] = k < nsplit ? ka_load(all + k * PS + r * (D + 2) + D + 1) : 0.0f;
                mx_ = ka_max(mx_, mk[j]);
            }
            KA_UNROLL
            for (unsigned int o = 16; o > 0; o /= 2) {
                mx_ = ka_max(mx_, ka_shfl_xor(mx_, o));
            }
            float den = 0.0f;
            KA_UNROLL
            for (unsigned int j = 0; j < NSMAX / 32; ++j) {
                mk[j] = mk[j] == ninf ? 0.0f : ka_exp(mk[j] - mx_);
                den += mk[j] * lk[j];
            }
            KA_UNROLL
            for (unsigned int o = 16; o > 0; o /= 2) {
                den += ka_shfl_xor(den, o);
            }
            KA_UNROLL
            for (unsigned int j = 0; j < NSMAX / 32; ++j) {
                const unsigned int k = lane + 32u * j;
                if (k < nsplit) {
                    wts[k * R + r] = mk[j] / den;
                }
            }
        }
        KA_BARRIER;
        constexpr unsigned int V4O = (R * D / 2 + NW * 32 - 1) / (NW * 32);
        float2 num[V4O];
        unsigned int at[V4O], rr[V4O];
        KA_UNROLL
        for (unsigned int o = 0; o < V4O; ++o) {
            const unsigned int e = ka_umin(tid + o * NW * 32u, R * D / 2 - 1u);  // past the end: a repeat, not stored
            rr[o] = e / (D / 2);
            at[o] = rr[o] * (D + 2) + 2u * (e % (D / 2));
            num[o] = make_float2(0.0f, 0.0f);
        }
        KA_UNROLL_4
        for (unsigned int k = 0; k < nsplit; ++k) {
            KA_UNROLL
            for (unsigned int o = 0; o < V4O; ++o) {
                const float2 x = __ldcg((const float2*)(all + k * PS + at[o]));
                const float a = wts[k * R + rr[o]];
                num[o].x += a * x.x;
                num[o].y += a * x.y;
            }
        }
        KA_UNROLL
        for (unsigned int o = 0; o < V4O; ++o) {
            const unsigned int e = tid + o * NW * 32u;
            if (e < R * D / 2) {
                const unsigned int d = 2u * (e % (D / 2));
                out[(bh * R + rr[o]) * D + d] = static_cast<T>(num[o].x);
                out[(bh * R + rr[o]) * D + d + 1] = static_cast<T>(num[o].y);
            }
        }
        if (tid == 0u) {
            ka_atomic_reset(counters, bh);
        }
    }
"""[1:]
_BLOCK_MERGE = _BODY[_BODY.index("    // the block's partial: its warps merged"):_BODY.index("    if (last != 0u) {")]
_V4_COMMON = _BODY_V4.replace("@SETUP@\n", _SETUP).replace("@V4SOFTMAX@\n", _V4_SOFTMAX)
# v4r, the first v4 (kept to be timed against): the residual on CUDA cores with its own
# partial (2 NW partials per block), v3's final merge
_BODY_V4R = (_V4_COMMON.replace("@V4TAIL@\n", _V4_RES_CUDA_CORES).replace("V4P", "2u")
             + _BODY[_BODY.index("    // the block's partial: its warps merged"):].replace("w < NW;", "w < 2u * NW;"))
# v4m: v4r with v4's final merge (to time v4's two later changes apart)
_BODY_V4M = (_V4_COMMON.replace("@V4TAIL@\n", _V4_RES_CUDA_CORES).replace("V4P", "2u")
             + _BLOCK_MERGE.replace("w < NW;", "w < 2u * NW;") + _V4_MERGE)
# v4: the residual through the mma path into the one running state (NW partials per
# block), the final merge with its loads in flight together (_V4_MERGE)
_BODY_V4 = (_V4_COMMON.replace("@V4TAIL@\n", _V4_RES_MMA.replace("@V4SOFTMAX@\n", re.sub("(?m)^(?=.)", "    ", _V4_SOFTMAX)))
            .replace("V4P", "1u") + _BLOCK_MERGE + _V4_MERGE)

# NVRTC may contract a*b+c into FMAs here: unlike the quantizer, attention is only held to the
# float32 accumulation bound, which contraction keeps.
_CUDA_HEADER = """
__device__ __forceinline__ unsigned int ka_umin(unsigned int a, unsigned int b) { return a < b ? a : b; }
__device__ __forceinline__ float ka_max(float a, float b) { return a > b ? a : b; }
__device__ __forceinline__ float ka_neg_inf() { return __int_as_float(0xff800000); }
__device__ __forceinline__ float ka_bits_float(int b) { return __int_as_float(b); }
__device__ __forceinline__ float ka_exp(float x) { return expf(x); }
// a code < 2^23 as the mantissa of 2^23, minus 2^23: exact, and cheaper than an int-to-float
__device__ __forceinline__ float ka_code(unsigned int c) { return __uint_as_float(0x4B000000u | c) - 8388608.0f; }
// the field ``mask`` of ``w`` in place, as ka_code reads it: (w & mask) | 2^23's bits is one LOP3
// with the mask as its immediate and 2^23's bits in a register; written in C, ptxas emits two LOP3s
// (two immediates), one more instruction per code
__device__ __forceinline__ float ka_field(unsigned int w, unsigned int mask) {
#ifdef __CUDA_ARCH__
    unsigned int r;
    asm("lop3.b32 %0, %1, %2, %3, 0xEA;" : "=r"(r) : "r"(w), "r"(mask), "r"(0x4B000000u));
    return __uint_as_float(r) - 8388608.0f;
#else
    return __uint_as_float(0x4B000000u | (w & mask)) - 8388608.0f;
#endif
}
// 2^-e and 2^e (e < 127), exact
__device__ __forceinline__ float ka_pow2m(unsigned int e) { return __uint_as_float((127u - e) << 23); }
__device__ __forceinline__ float ka_pow2(unsigned int e) { return __uint_as_float((127u + e) << 23); }
__device__ __forceinline__ float4 ka_f4(float a, float b, float c, float d) { return make_float4(a, b, c, d); }
// a float16 (scale, zero) pair, one 4-byte load
__device__ __forceinline__ float2 ka_pair(const __half* p, unsigned int i) {
    return __half22float2(reinterpret_cast<const __half2*>(p)[i]);
}
// the same pair's 4 bytes as loaded, and as floats (registers in flight hold the smaller form)
__device__ __forceinline__ unsigned int ka_pair_bits(const __half* p, unsigned int i) {
    return reinterpret_cast<const unsigned int*>(p)[i];
}
__device__ __forceinline__ float2 ka_unpair(unsigned int u) {
    return make_float2(static_cast<float>(__ushort_as_half((unsigned short)(u & 0xffffu))),
                       static_cast<float>(__ushort_as_half((unsigned short)(u >> 16))));
}
__device__ __forceinline__ bool ka_any(bool p) { return __any_sync(0xffffffffu, p) != 0; }
__device__ __forceinline__ float ka_shfl_xor(float v, unsigned int m) { return __shfl_xor_sync(0xffffffffu, v, m); }
// other blocks' partials: through L2, not a stale L1 line
__device__ __forceinline__ float ka_load(const float* p) { return __ldcg(p); }
__device__ __forceinline__ unsigned int ka_atomic_inc(const unsigned int* c, unsigned int i) {
    return atomicAdd(const_cast<unsigned int*>(c) + i, 1u);
}
__device__ __forceinline__ void ka_atomic_reset(const unsigned int* c, unsigned int i) {
    atomicExch(const_cast<unsigned int*>(c) + i, 0u);
}
"""

# Untested: no Apple GPU was available.
_METAL_HEADER = """
inline unsigned int ka_umin(unsigned int a, unsigned int b) { return a < b ? a : b; }
inline float ka_max(float a, float b) { return a > b ? a : b; }
inline float ka_neg_inf() { return -INFINITY; }
inline float ka_bits_float(int b) { return as_type<float>(b); }
inline float ka_exp(float x) { return metal::precise::exp(x); }
inline float ka_code(unsigned int c) { return as_type<float>(0x4B000000u | c) - 8388608.0f; }
inline float ka_field(unsigned int w, unsigned int mask) { return as_type<float>(0x4B000000u | (w & mask)) - 8388608.0f; }
inline float ka_pow2m(unsigned int e) { return as_type<float>((127u - e) << 23); }
inline float ka_pow2(unsigned int e) { return as_type<float>((127u + e) << 23); }
inline float4 ka_f4(float a, float b, float c, float d) { return float4(a, b, c, d); }
inline float2 ka_pair(const device half* p, unsigned int i) { return float2(((const device half2*)p)[i]); }
inline unsigned int ka_pair_bits(const device half* p, unsigned int i) { return ((const device unsigned int*)p)[i]; }
inline float2 ka_unpair(unsigned int u) { return float2(as_type<half2>(u)); }
inline bool ka_any(bool p) { return metal::simd_any(p); }
inline float ka_shfl_xor(float v, unsigned int m) { return metal::simd_shuffle_xor(v, ushort(m)); }
inline float ka_load(const device float* p) { return *((const volatile device float*)p); }
inline unsigned int ka_atomic_inc(const device unsigned int* c, unsigned int i) {
    return atomic_fetch_add_explicit((device atomic_uint*)(c + i), 1u, memory_order_relaxed);
}
inline void ka_atomic_reset(const device unsigned int* c, unsigned int i) {
    atomic_store_explicit((device atomic_uint*)(c + i), 0u, memory_order_relaxed);
}
"""

DIALECTS = {
    "cuda": {
        "header": _CUDA_HEADER,
        "tokens": {
            "KA_THREAD": "threadIdx.x",
            "KA_BLOCK_X": "blockIdx.x",
            "KA_BLOCK_Y": "blockIdx.y",
            "KA_NBLOCKS_X": "gridDim.x",
            "KA_SHARED": "__shared__",
            "KA_TG": "",
            "KA_DEV": "",
            "KA_SYNCWARP": "__syncwarp()",
            "KA_BARRIER": "__syncthreads()",
            "KA_FENCE": "__threadfence()",
            "KA_UNROLL_8": "#pragma unroll 8",
            "KA_UNROLL_4": "#pragma unroll 4",
            "KA_UNROLL": "#pragma unroll",
        },
    },
    "metal": {
        "header": _METAL_HEADER,
        "tokens": {
            "KA_THREAD": "thread_position_in_threadgroup.x",
            "KA_BLOCK_X": "threadgroup_position_in_grid.x",
            "KA_BLOCK_Y": "threadgroup_position_in_grid.y",
            "KA_NBLOCKS_X": "threadgroups_per_grid.x",
            "KA_SHARED": "threadgroup",
            "KA_TG": "threadgroup",
            "KA_DEV": "device",
            "KA_SYNCWARP": "simdgroup_barrier(mem_flags::mem_threadgroup)",
            "KA_BARRIER": "threadgroup_barrier(mem_flags::mem_threadgroup)",
            "KA_FENCE": "atomic_thread_fence(mem_flags::mem_device, memory_order_seq_cst, thread_scope_device)",
            "KA_UNROLL_8": "#pragma unroll(8)",
            "KA_UNROLL_4": "#pragma unroll(4)",
            "KA_UNROLL": "#pragma unroll",
        },
    },
}

# "after": the previous output of the same cache, unused by the body. Two launches on one cache share
# its scratch and counters, which MLX sees only as inputs: without a data dependency between them, a
# CUDA graph may run them concurrently (measured on the H200: garbage). Passing the last output
# orders every launch after the previous one on the same cache.
INPUTS = ["q", "kc", "kp", "vc", "vp", "rk", "rv", "meta", "scratch", "counters", "after"]


VERSIONS = ("v3", "v2", "v4", "v4r", "v4m")
# the tensor-core kernels: v4r the first v4 (its residual on CUDA cores, v3's final merge), v4m
# v4r with v4's final merge; both kept to be timed against v4
V4_FAMILY = ("v4", "v4r", "v4m")
# the kernel a launch uses unless told: "auto", the default, is v4 where it
# serves the geometry on CUDA (:func:`v4_unsupported`), v3 elsewhere (Metal, 8 bits, more than 8 query
# heads per KV head): in the model's order, chained, v4 was 15-35 % faster than v3 at 4k-64k at 2 and
# 4 bits on the H200 (docs/results/2026-12-05-logs/kivi.md, "Eighth window"); "v4" the same with v3 as the fallback. VERSION
# is the CUDA-core kernel geometry-free callers (the host rendering, the fallback) take
DEFAULT = "auto"
VERSION = "v3"

# How the launch hands the kernel the softmax scale and the token counts (quantized, residual):
# - "small" (the default): the scale as a template argument (its float32 bits, exact; one compile
#   per scale, i.e. per model) and the two counts as a float32 pair, 8 bytes. MLX's CUDA allocator
#   serves host-made arrays of at most 8 bytes from a small pool that the GPU reads in place
#   (cudaMemAdviseSetAccessedBy).
# - "float3" (the second H200 window's launch): [scale, quantized, residual] as float32, 12 bytes.
#   Larger than 8 bytes, it gets its own managed allocation (cudaMallocManaged), which the host
#   writes and the kernel then reads: a page that may migrate between host and device every launch.
META_MODES = ("small", "float3")
META = "small"
_COUNTS = {
    "small": "const float sm = ka_bits_float(SCALE_BITS);\n"
    "    const unsigned int nq = (unsigned int)meta[0];\n"
    "    const unsigned int nr = (unsigned int)meta[1];",
    "float3": "const float sm = meta[0];\n"
    "    const unsigned int nq = (unsigned int)meta[1];\n"
    "    const unsigned int nr = (unsigned int)meta[2];",
}


_IDENT = set("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_")
_OPS = set("+-*/%&|^<>=!~?:.")


def _squeezed(code):
    """One line of C without the whitespace the tokens do not need: a space stays only between two
    identifier characters (``unsigned int``) or two operator characters (``a - -b``); string
    literals are copied as they are."""
    out, i, n = [], 0, len(code)
    while i < n:
        ch = code[i]
        if ch == '"':
            j = code.index('"', i + 1)
            out.append(code[i : j + 1])
            i = j + 1
        elif ch.isspace():
            while i < n and code[i].isspace():
                i += 1
            prev, nxt = (out[-1][-1] if out else ""), (code[i] if i < n else "")
            if (prev in _IDENT and nxt in _IDENT) or (prev in _OPS and nxt in _OPS):
                out.append(" ")
        else:
            out.append(ch)
            i += 1
    return "".join(out)


def _minified(src):
    """``src`` without comments, indentation and the whitespace its tokens do not need, one line
    but for the preprocessor's; ``unsigned int`` as ``unsigned``. MLX's cuda_kernel rebuilds the
    whole kernel source string on every call (mlx/backend/cuda/custom_kernel.cpp, build_kernel) and
    copies it into the primitive, and the fifth H200 window measured a launch's host time growing
    ~0.3 us per kB of what MLX is handed: the source's length is host time per launch."""
    lines = [re.sub(r"\bunsigned int\b", "unsigned", line.split("//")[0].strip()) for line in src.splitlines()]
    out, run = [], []
    for line in lines:
        if line.startswith("#"):  # preprocessor lines stay lines of their own
            out += [_squeezed(" ".join(run))] if run else []
            out.append(line)
            run = []
        elif line:
            run.append(line)
    out += [_squeezed(" ".join(run))] if run else []
    return "\n".join(x for x in out if x) + "\n"


# __launch_bounds__ through the header: MLX writes the kernel's "__global__ void name(...)" itself,
# after the header, and __global__ is a macro (crt/host_defines.h: __location__(global)), so the
# header can redefine it to carry the bounds, the one way to set them through mx.fast.cuda_kernel.
_BOUNDS = "#undef __global__\n#define __global__ __location__(global) __launch_bounds__({threads}, {blocks})\n"


def render(dialect, version=None, meta=None, warps=WARPS, minblocks=0, minify=True):
    """(name, header, body) in one dialect; the name carries a digest of the source (MLX caches
    compiled kernels by name). ``version``: :data:`VERSIONS` (default :data:`VERSION`); ``meta``:
    how scale and counts arrive (:data:`META_MODES`, default :data:`META`); ``minblocks`` > 0
    (CUDA only): __launch_bounds__(32 * warps, minblocks), registers capped so that many blocks of
    ``warps`` warps fit an SM; ``minify``: strip comments and indentation (:func:`_minified`)."""
    spec = DIALECTS[dialect]
    version = version or VERSION
    if version in V4_FAMILY and dialect != "cuda":
        raise ValueError("kernel v4 is CUDA only (mma.sync); Metal takes v3")
    body = {"v3": _BODY_V3, "v2": _BODY, "v4": _BODY_V4, "v4r": _BODY_V4R, "v4m": _BODY_V4M}[version].replace("NSMAX", str(NSMAX))
    body = body.replace("@COUNTS@", _COUNTS[meta or META])
    for token in sorted(spec["tokens"], key=len, reverse=True):  # KA_TG before KA_T..., longest first
        body = body.replace(token, spec["tokens"][token])
    header = spec["header"] + (_V4_HEADER if version in V4_FAMILY else "")
    if minblocks and dialect == "cuda":
        header = _BOUNDS.format(threads=32 * warps, blocks=minblocks) + header
    if minify:
        header, body = _minified(header), _minified(body)
    digest = hashlib.sha1((header + body).encode()).hexdigest()[:10]
    return f"kivi_decode_attn_{digest}", header, body


def shared_floats(head_dim, ratio, warps=WARPS, group_size=32, version=None, bits=4):
    """Floats of shared memory a kernel version declares (its SH)."""
    rp = -(-ratio // 4) * 4
    if version in V4_FAMILY:  # per warp two stages (key words and parameters, value words and parameters)
        w, ngv = head_dim * bits // 32, -(-head_dim // group_size)
        stg = 64 * w + head_dim + 32 * ngv
        wa = max(2 * stg, (head_dim + 32) * rp)
        parts = 1 if version == "v4" else 2  # v4r, v4m: a residual partial per warp beside the tensor-core one
        return max(warps * wa, parts * warps * ratio * (head_dim + 2), (NSMAX + 1) * ratio + 3)
    if (version or VERSION) == "v3":
        shq = head_dim * rp + warps * max(head_dim * rp, 32 * (rp + -(-head_dim // group_size)))
    else:
        shq = head_dim * rp + warps * (head_dim + 32) * rp
    return max(shq, warps * ratio * (head_dim + 2), (NSMAX + 1) * ratio + 3)


@functools.lru_cache(maxsize=256)  # asked per layer and step; the answer depends on these ints only
def unsupported(head_dim, value_dim, bits, group_size, ratio, warps=None, version=None):
    """Why the kernel cannot serve this geometry (a sentence), or None. ``warps``: per block
    (default: the launch shape's, :func:`default_shape`)."""
    w = head_dim * bits // 32
    if value_dim != head_dim:
        return f"keys and values have different head dims ({head_dim}, {value_dim})"
    if head_dim % 32 or w > 32 or 32 % w:
        return f"head dim {head_dim} at {bits} bits: needs D % 32 == 0 and D * bits / 32 dividing 32"
    if group_size % 32:
        return f"group_size {group_size} is not a multiple of 32 (the kernel's chunk)"
    if not 1 <= ratio <= 8:
        return f"{ratio} query heads per KV head (the kernel serves 1 to 8)"
    warps = warps or default_shape(bits, version).warps
    if 4 * (shared_floats(head_dim, ratio, warps, group_size, version) + 1) > 48 * 1024:
        return f"shared memory over 48 KiB ({warps} warps, D {head_dim}, {ratio} query heads per KV head)"
    return None


@functools.lru_cache(maxsize=256)
def v4_unsupported(head_dim, value_dim, bits, group_size, ratio, warps=None, version="v4"):
    """Why kernel v4 cannot serve this geometry (a sentence; :func:`pick_version` then takes v3), or None."""
    w = head_dim * bits // 32
    if bits not in (2, 4):
        return f"{bits}-bit codes (v4 unpacks 2 and 4 bits: bf16(128 + c) needs c < 128)"
    if value_dim != head_dim or head_dim % 32 or w % 4 or (w // 4) & (w // 4 - 1):
        return f"head dim {head_dim} at {bits} bits: v4 needs D % 32 == 0 and D * bits / 128 a power of two"
    if group_size % 32:
        return f"group_size {group_size} is not a multiple of 32"
    if not 1 <= ratio <= 8:
        return f"{ratio} query heads per KV head (v4's mma rows hold at most 8)"
    warps = warps or V4_SHAPE.warps
    if 4 * (shared_floats(head_dim, ratio, warps, group_size, version, bits) + 1) > 48 * 1024:
        return f"shared memory over 48 KiB ({warps} warps, D {head_dim}, {bits} bits)"
    return None


def pick_version(version, head_dim, value_dim, bits, group_size, ratio, warps=None, dialect=None):
    """The kernel a launch runs: ``version`` (None: :data:`DEFAULT`); "auto" is v4 on CUDA where it
    serves the geometry, else v3; an explicit "v4" it cannot serve (or off CUDA) falls back to v3."""
    version = version or DEFAULT
    if version in ("auto",) + V4_FAMILY:
        dialect = dialect or gpu.backend()
        want = "v4" if version == "auto" else version
        if (version != "auto" or dialect == "cuda") and dialect != "metal" and \
                v4_unsupported(head_dim, value_dim, bits, group_size, ratio, warps, want) is None:
            return want
        return "v3"
    return version


_kernels = {}


def _kernel(dialect, version=None, meta=None, warps=WARPS, minblocks=0, minify=True):
    key = (dialect, version or VERSION, meta or META, warps if minblocks else 0, minblocks, minify)
    if key not in _kernels:
        name, header, body = render(dialect, key[1], key[2], warps, minblocks, minify)
        make = mx.fast.metal_kernel if dialect == "metal" else cuda_cache.cuda_kernel
        _kernels[key] = make(name=name, input_names=INPUTS, output_names=["out"], source=body, header=header)
    return _kernels[key]


def active(use_kernels):
    return gpu.active(use_kernels, kernels.is_enabled(), gpu.backend(), "KIVI decode attention")


def applies(queries, cache, use_kernels=None):
    """Whether :func:`decode_attention` serves this call; with ``use_kernels=True`` a geometry it
    cannot serve raises instead."""
    if not active(use_kernels):
        return False
    rk, rv, _ = cache.residual_buffers()
    why = unsupported(rk.shape[3], rv.shape[3], cache.kv_bits, cache.group_size, queries.shape[1] // rk.shape[1])
    if why and use_kernels:
        raise ValueError(f"KIVI decode attention: {why}")
    return why is None and queries.shape[1] % rk.shape[1] == 0


CHUNKS_PER_WARP = 2


class Shape(typing.NamedTuple):
    """How a launch is laid out: warps per block, chunks per warp (sets the splits; 0: as many
    splits as fill the GPU, :func:`fill_splits`), chunks whose loads run ahead of the arithmetic
    (v3's PF, 0 or 1), the blocks per SM that __launch_bounds__ asks the compiler to fit (0: no
    bounds) and the kernel version ("": the default's)."""

    warps: int
    per_warp: int
    ahead: int = 0
    minblocks: int = 0
    version: str = ""


def default_shape(bits, version=None):
    """The launch shape of a kernel version at a bit width. v2, from the H200 op benchmark at 32k
    (docs/results/2026-12-01-h200-kivi2): 4 x 2 at 2 bits (its registers let one 8-warp block fit an
    SM), 8 x 4 at 4 bits. v3, the fastest in the chained (model-order) latency benchmark at
    4k-64k on the H200 (docs/results/2026-12-02-h200-kivi6): 8 warps with splits that fill the GPU
    (one wave of 2 blocks per SM) and the loads not ahead at 4 bits, 4 warps filling it (3 blocks
    per SM) with the loads one chunk ahead at 2 bits; 8 bits untimed, as 4 (the same registers)."""
    if version in V4_FAMILY:
        return V4_SHAPE._replace(version=version)
    if (version or VERSION) == "v3":
        return V3_SHAPES.get(bits, V3_SHAPES[4])
    return Shape(4, 2) if bits == 2 else Shape(8, 4)


def parse_shape(text):
    """"8x2", "8xf" or "8x2:pf1:mb2" (warps x chunks per warp or f: fill the GPU, loads ahead,
    launch-bounds blocks), optionally ":v4" (a version) -> Shape."""
    head, *rest = text.split(":")
    version = next((x for x in rest if x in VERSIONS), "")
    rest = [x for x in rest if x not in VERSIONS]
    try:
        w, per = head.split("x")
        w, per = int(w), 0 if per == "f" else int(per)
        opts = {x[:2]: int(x[2:]) for x in rest}
    except ValueError:
        raise ValueError(f"launch shape {text!r}: expected WARPSx(CHUNKS|f)[:pfN][:mbN]") from None
    if set(opts) - {"pf", "mb"} or opts.get("pf", 0) not in (0, 1) or not 1 <= w <= 32 or per < 0:
        raise ValueError(f"launch shape {text!r}: expected WARPSx(CHUNKS|f)[:pfN][:mbN], pf 0 or 1")
    return Shape(w, per, opts.get("pf", 0), opts.get("mb", 0), version)


def shape_text(shape):
    """The inverse of :func:`parse_shape`."""
    return f"{shape.warps}x{shape.per_warp or 'f'}:pf{shape.ahead}:mb{shape.minblocks}" + (f":{shape.version}" if shape.version else "")


# v3's launch per bit width (the throughput picks, 8x4 at 4 bits and 4x4:pf1 at 2,
# were 0.5-18 % slower chained); a benchmark replaces one by assigning V3_SHAPES[bits]
V3_SHAPES = {2: Shape(4, 0, 1, 0), 4: Shape(8, 0, 0, 0), 8: Shape(8, 0, 0, 0)}
# v4: 4-warp blocks filling the GPU, two resident per SM (40 KiB of stages each at D 128, 4 bits;
# registers up to 255 leave two)
V4_SHAPE = parse_shape("4xf")._replace(version="v4")
V4_BLOCKS = 2


def default_splits(chunks, warps=WARPS, per_warp=None, heads=None, per_sm=None):
    """Splits per KV head: about ``per_warp`` chunks (default CHUNKS_PER_WARP) per warp, at most
    NSMAX; ``per_warp`` 0: :func:`fill_splits` over ``heads`` (B * KV heads) blocks per split and
    ``per_sm`` resident blocks per SM (default: as 128 registers per thread allow)."""
    if per_warp == 0:
        if heads is None:
            raise ValueError("splits that fill the GPU need the number of KV heads")
        return fill_splits(chunks, warps, heads, per_sm or max(1, 16 // warps))
    return max(1, min(NSMAX, -(-chunks // ((per_warp or CHUNKS_PER_WARP) * warps))))


# Registers per thread of v3 by (bits, loads ahead) at the 8B geometry (fp16, D 128, 4 query heads
# per KV head; nvcc 13.0 ptxas for sm_90, scripts/kivi_ptxas.py; 128 at 4 bits is what Nsight
# Compute saw on the H200). 2 bits needs more than 4: a lane accumulates 16 channels per word, not 8.
V3_REGISTERS = {(4, 0): 128, (4, 1): 167, (2, 0): 157, (2, 1): 167, (8, 0): 128, (8, 1): 250}


def resident_blocks(bits, shape):
    """Blocks of ``shape`` one SM holds at once, from the registers (65536 per SM, allocated 256 per
    warp at a time); launch bounds set it. Other geometries are assumed to fit as the 8B one."""
    if shape.minblocks:
        return shape.minblocks
    if shape.version in V4_FAMILY:
        return max(1, V4_BLOCKS * 4 // shape.warps)
    per_warp = -(-V3_REGISTERS.get((bits, shape.ahead), 128) * 32 // 256) * 256
    return max(1, 65536 // (per_warp * shape.warps))


@functools.lru_cache(maxsize=1)
def multiprocessors():
    """SMs of CUDA device 0 (the driver's attribute 16); 132 (an H200) where it does not answer,
    e.g. on Metal or without the driver library."""
    try:
        import ctypes

        cu = ctypes.CDLL("libcuda.so.1")
        dev, sms = ctypes.c_int(), ctypes.c_int()
        if cu.cuInit(0) == 0 and cu.cuDeviceGet(ctypes.byref(dev), 0) == 0 and \
                cu.cuDeviceGetAttribute(ctypes.byref(sms), 16, dev) == 0 and sms.value > 0:
            return sms.value
    except OSError:
        pass
    return 132


def fill_splits(chunks, warps, heads, per_sm):
    """Splits per KV head for latency: one wave of resident blocks over the whole GPU
    (SMs x ``per_sm`` / heads), each warp keeping at least one chunk. A decode step's layers run
    one after another, so a layer's time is its longest block: a throughput-picked shape launches
    64 blocks for 132 SMs at 8k on the H200 (docs/results/2026-12-05-logs/kivi.md, "Fifth window")."""
    want = -(-multiprocessors() * per_sm // heads)
    return max(1, min(NSMAX, want, -(-chunks // warps)))


def _slots(ns):
    """Partials per KV head the scratch holds for ``ns`` splits: a power of two >= 8, so the buffer
    is reallocated a few times as the context grows (it never shrinks), not at every new split count."""
    return min(NSMAX, max(8, 1 << (ns - 1).bit_length()))


def scale_bits(scale):
    """The float32 bits of ``scale`` as a signed int (a template argument; exact)."""
    return struct.unpack("<i", struct.pack("<f", scale))[0]


def launch_shape(bits, version=None, warps=None, ahead=None, minblocks=None):
    """The default shape of ``version`` at ``bits`` with the given fields replaced; ``warps`` given
    alone keeps the default chunks per warp of an explicit warp count (CHUNKS_PER_WARP)."""
    shape = default_shape(bits, version)._replace(version=version or "")
    if warps is not None:
        shape = shape._replace(warps=warps, per_warp=CHUNKS_PER_WARP)
    if ahead is not None:
        shape = shape._replace(ahead=ahead)
    if minblocks is not None:
        shape = shape._replace(minblocks=minblocks)
    return shape


def _launch_spec(queries, rk, bits, g, scale, chunks, splits, warps, meta, version, ahead, minblocks):
    """(launch keywords, Shape, splits): what a launch takes that changes only with the counts'
    chunk total (every 32 tokens) or the call's settings; :func:`launch_args` keeps the last one."""
    b, h, _, d = rk.shape
    shape = launch_shape(bits, version, warps, ahead, minblocks)
    ns = splits or default_splits(chunks, shape.warps, shape.per_warp, b * h, resident_blocks(bits, shape))
    if not 1 <= ns <= NSMAX:
        raise ValueError(f"splits must be in 1..{NSMAX}, got {ns}")
    template = [("T", rk.dtype), ("BITS", bits), ("G", g), ("D", d), ("R", queries.shape[1] // h), ("NW", shape.warps)]
    if version == "v3":
        template.append(("PF", shape.ahead))
    if version in V4_FAMILY and queries.shape[1] // h > 8:
        raise ValueError("kernel v4 serves at most 8 query heads per KV head")
    if meta == "small":
        template.append(("SCALE_BITS", scale_bits(scale)))
    spec = {
        "template": template,
        "grid": (ns * shape.warps * 32, b * h, 1),
        "threadgroup": (shape.warps * 32, 1, 1),
        "output_shapes": [tuple(queries.shape)],
        "output_dtypes": [rk.dtype],
    }
    return spec, shape, ns


def launch_args(queries, cache, scale, splits=None, warps=None, meta=None, version=None, ahead=None, minblocks=None):
    """(inputs, launch keywords, Shape) of one call: everything :func:`decode_attention` hands MLX
    but the kernel object. ``meta``: :data:`META_MODES` (default :data:`META`). The keywords are
    kept on the cache and reused while nothing they depend on changes (host time per launch)."""
    rk, rv, nres = cache.residual_buffers()
    b, h, _, d = rk.shape
    g, bits = cache.group_size, cache.kv_bits
    version = pick_version(version, d, rv.shape[3], bits, g, queries.shape[1] // h, warps)
    meta = meta or META
    if cache.kc is None:  # nothing quantized yet: one zero group stands in for the buffers
        w = d * bits // 32
        kc, kp = mx.zeros((b, h, 1, w, g), mx.uint32), mx.zeros((b, h, 1, d, 2), mx.float16)
        vc, vp = mx.zeros((b, h, g, w), mx.uint32), mx.zeros((b, h, g, -(-d // g), 2), mx.float16)
    else:
        kc, kp, vc, vp = cache.kc, cache.kp, cache.vc, cache.vp
    chunks = cache.quantized // 32 + -(-nres // 32)
    key = (queries.shape, queries.dtype, rk.shape, rk.dtype, scale, chunks, splits, warps, meta, version, ahead, minblocks)
    memo = cache.launch_memo
    if memo is None or memo[0] != key:
        spec = _launch_spec(queries, rk, bits, g, scale, chunks, splits, warps, meta, version, ahead, minblocks)
        memo = cache.launch_memo = (key, spec)
    spec, shape, ns = memo[1]
    r = queries.shape[1] // h
    have = None if cache.scratch is None else cache.scratch[0].shape
    if have is None or have[0] != b * h or have[2] != r * (d + 2) or have[1] < ns:
        cache.scratch = (mx.zeros((b * h, _slots(ns), r * (d + 2)), mx.float32), mx.zeros((b * h,), mx.uint32))
    if cache.step_counts is not None:  # a compiled step's view: the counts are one of its inputs
        if meta != "small":
            raise ValueError("a compiled KIVI step passes its counts as the 8-byte pair (meta 'small')")
        counts = cache.step_counts
    elif meta == "small":
        counts = mx.array([cache.quantized, nres], mx.float32)
    else:
        counts = mx.array([scale, cache.quantized, nres], mx.float32)
    q = queries if queries.dtype == rk.dtype else queries.astype(rk.dtype)
    after = cache.last_out if cache.last_out is not None else counts
    return [q, kc, kp, vc, vp, rk, rv, counts, *cache.scratch, after], spec, shape


def decode_attention(queries, cache, scale, splits=None, warps=None, version=None, meta=None, ahead=None, minblocks=None):
    """softmax(q·K̂ᵀ·scale)·V̂ for queries [B, Hq, 1, D] over a :class:`PackedKIVICache`, in one
    launch. ``splits`` (blocks per KV head), ``warps`` (per block), ``ahead`` and ``minblocks``
    (:class:`Shape`; defaults :func:`default_shape`) change only the order of float32 sums;
    ``version`` picks the kernel (:data:`VERSIONS`), ``meta`` how scale and counts reach it
    (:data:`META_MODES`)."""
    if isinstance(cache.offset, int) and cache.offset >= 2**24:  # (a compiled step checks its own)
        raise ValueError("decode attention passes token counts as float32: at most 2**24 tokens")
    inputs, spec, shape = launch_args(queries, cache, scale, splits, warps, meta, version, ahead, minblocks)
    out = _kernel(gpu.backend(), shape.version, meta, shape.warps, shape.minblocks)(inputs=inputs, **spec)[0]
    cache.last_out = out
    return out if out.dtype == queries.dtype else out.astype(queries.dtype)
