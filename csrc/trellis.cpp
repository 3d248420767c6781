#include "trellis.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <utility>
#include <vector>

#include "kernel.h"

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define VQ_X86 1
#include <immintrin.h>
#endif

// Built with -ffp-contract=off (CMakeLists.txt): the Viterbi's (x - t)^2 + cost must round twice,
// as numpy does, or a tie could break differently from the reference.

namespace vqpipe {

namespace {

// ---- Viterbi --------------------------------------------------------------------------------

struct Buffers {
  std::vector<float> cost, next;
  std::vector<uint8_t> back; // [T, P]: the chosen predecessor's top k bits, per step and low state
};

// The path ending in the cheapest final state (the lowest on ties), read back through `back`.
void traceback(const float* cost, const uint8_t* back, int T, int L, int k, int32_t* out) {
  const int S = 1 << L, P = S >> k;
  int t = 0;
  for (int u = 1; u < S; ++u) {
    if (cost[u] < cost[t]) t = u;
  }
  for (int i = T - 1; i >= 0; --i) {
    out[i] = t;
    t = (back[static_cast<size_t>(i) * P + (t >> k)] << (L - k)) | (t >> k);
  }
}

// State t's predecessors are top << (L - k) | t >> k: their costs, for t >> k = j, are
// cost[top * P + j], contiguous in j. The first minimum (strict <, top ascending) is numpy's argmin.
void viterbi_portable(const float* x, int T, int L, int k, const float* table, int32_t* out, Buffers& b) {
  const int S = 1 << L, K = 1 << k, P = S >> k;
  float *cost = b.cost.data(), *next = b.next.data();
  std::vector<float> m(P);
  std::fill(cost, cost + S, std::numeric_limits<float>::infinity());
  cost[0] = 0.0f;
  for (int i = 0; i < T; ++i) {
    uint8_t* bk = b.back.data() + static_cast<size_t>(i) * P;
    for (int j = 0; j < P; ++j) {
      m[j] = cost[j];
      bk[j] = 0;
    }
    for (int top = 1; top < K; ++top) {
      const float* c = cost + top * P;
      for (int j = 0; j < P; ++j) {
        if (c[j] < m[j]) {
          m[j] = c[j];
          bk[j] = static_cast<uint8_t>(top);
        }
      }
    }
    const float xi = x[i];
    for (int t = 0; t < S; ++t) {
      const float d = xi - table[t];
      next[t] = d * d + m[t >> k];
    }
    std::swap(cost, next);
  }
  traceback(cost, b.back.data(), T, L, k, out);
}

#ifdef VQ_X86

// Eight low states j at a time: the min over the K predecessor rows (min_ps keeps the earlier on
// ties, as strict < does), then their K * 8 successors t = j * K + b, each (x - table[t])^2 + m[j].
template <int k>
__attribute__((target("avx2"))) void viterbi_avx2(
    const float* x, int T, int L, const float* table, int32_t* out, Buffers& b) {
  constexpr int K = 1 << k;
  const int S = 1 << L, P = S >> k;
  float *cost = b.cost.data(), *next = b.next.data();
  std::fill(cost, cost + S, std::numeric_limits<float>::infinity());
  cost[0] = 0.0f;
  // byte 0 of each 32-bit lane to the low 4 bytes of its 128-bit half
  const __m256i pick = _mm256_setr_epi8(0, 4, 8, 12, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1,
                                        0, 4, 8, 12, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1);
  const __m256i halves = _mm256_setr_epi32(0, 4, 0, 0, 0, 0, 0, 0);
  const __m256i iota = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  for (int i = 0; i < T; ++i) {
    uint8_t* bk = b.back.data() + static_cast<size_t>(i) * P;
    const __m256 xv = _mm256_set1_ps(x[i]);
    for (int j = 0; j < P; j += 8) {
      __m256 m = _mm256_loadu_ps(cost + j);
      __m256 arg = _mm256_setzero_ps();
      for (int top = 1; top < K; ++top) {
        const __m256 c = _mm256_loadu_ps(cost + top * P + j);
        const __m256 lt = _mm256_cmp_ps(c, m, _CMP_LT_OQ);
        m = _mm256_min_ps(c, m);
        arg = _mm256_blendv_ps(arg, _mm256_castsi256_ps(_mm256_set1_epi32(top)), lt);
      }
      const __m256i bytes = _mm256_permutevar8x32_epi32(_mm256_shuffle_epi8(_mm256_castps_si256(arg), pick), halves);
      _mm_storel_epi64(reinterpret_cast<__m128i*>(bk + j), _mm256_castsi256_si128(bytes));
      float* nt = next + j * K;
      const float* tb = table + j * K;
      for (int v = 0; v < K; ++v) {
        // successor 8v + l of this block comes from low state (8v + l) >> k
        const __m256i from = _mm256_srli_epi32(_mm256_add_epi32(iota, _mm256_set1_epi32(8 * v)), k);
        const __m256 d = _mm256_sub_ps(xv, _mm256_loadu_ps(tb + 8 * v));
        _mm256_storeu_ps(nt + 8 * v, _mm256_add_ps(_mm256_mul_ps(d, d), _mm256_permutevar8x32_ps(m, from)));
      }
    }
    std::swap(cost, next);
  }
  traceback(cost, b.back.data(), T, L, k, out);
}

bool viterbi_fast(const float* x, int T, int L, int k, const float* table, int32_t* out, Buffers& b) {
  if (!has_avx2() || (L - k) < 3) return false; // needs 8 low states per block
  switch (k) {
    case 1: viterbi_avx2<1>(x, T, L, table, out, b); return true;
    case 2: viterbi_avx2<2>(x, T, L, table, out, b); return true;
    case 3: viterbi_avx2<3>(x, T, L, table, out, b); return true;
    case 4: viterbi_avx2<4>(x, T, L, table, out, b); return true;
    case 5: viterbi_avx2<5>(x, T, L, table, out, b); return true;
    case 6: viterbi_avx2<6>(x, T, L, table, out, b); return true;
    default: return false;
  }
}

#endif // VQ_X86

} // namespace

void trellis_viterbi(const float* x, int64_t s0, int64_t s1, int T, int L, int k, const float* table,
                     int32_t* states) {
  const int S = 1 << L;
  Buffers b;
  b.cost.resize(S);
  b.next.resize(S);
  b.back.resize(static_cast<size_t>(T) * (S >> k));
  for (int64_t s = s0; s < s1; ++s) {
    const float* xs = x + s * T;
    int32_t* out = states + s * T;
#ifdef VQ_X86
    if (viterbi_fast(xs, T, L, k, table, out, b)) continue;
#endif
    viterbi_portable(xs, T, L, k, table, out, b);
  }
}

// ---- mat-vec --------------------------------------------------------------------------------

float trellis_code(uint32_t state, float a, float b) {
  const uint32_t h = state * kLcgMul + kLcgAdd;
  const int sum = (h & 255) + ((h >> 8) & 255) + ((h >> 16) & 255) + (h >> 24);
  return std::fma(a, static_cast<float>(sum), b);
}

namespace {

constexpr int kMaxM = 4; // rows of x per pass

// Each tile's states in sequence (s = (s << k | b) mod 2^L), values from a table of the code.
void blocks_portable(const TrellisArgs& a, int b0, int b1, int m0, int mc) {
  const int k = a.k, words = 8 * k, tiles = a.cols / kTileCols;
  const uint32_t mask = (1u << a.L) - 1;
  std::vector<float> table(size_t{1} << a.L);
  for (uint32_t t = 0; t <= mask; ++t) table[t] = trellis_code(t, a.a, a.b);
  float acc[kMaxM][kTileRows];
  for (int rb = b0; rb < b1; ++rb) {
    std::fill(&acc[0][0], &acc[0][0] + kMaxM * kTileRows, 0.0f);
    for (int cb = 0; cb < tiles; ++cb) {
      const uint32_t* tile = a.packed + (static_cast<size_t>(rb) * tiles + cb) * words;
      uint32_t s = 0;
      for (int i = 0; i < kTileRows * kTileCols; ++i) {
        s = next_state(tile, i, k, s, mask);
        const float v = table[s];
        const int col = cb * kTileCols + i / kTileRows;
        for (int mm = 0; mm < mc; ++mm) acc[mm][i % kTileRows] += v * a.x[static_cast<size_t>(m0 + mm) * a.cols + col];
      }
    }
    for (int mm = 0; mm < mc; ++mm) {
      for (int r = 0; r < kTileRows; ++r) {
        const int row = rb * kTileRows + r;
        float y = acc[mm][r] * a.row_scales[row];
        if (a.bias) y += a.bias[row];
        a.y[static_cast<size_t>(m0 + mm) * a.rows + row] = y;
      }
    }
  }
}

#ifdef VQ_X86

// A tile's stream with its k-bit steps reversed, so that a state is a plain bit field: weight i's
// at bit k(255 - i), the newest step lowest, older ones above it and zeros above the tile's first
// step (rev[4k] = 0). Widths that divide 8: the byte order, then the steps inside each byte.
template <int k>
inline void reverse_steps(const uint8_t* tile, uint64_t* rev) {
  constexpr int n = 4 * k; // 64-bit words in a tile
  for (int j = 0; j < n; ++j) {
    uint64_t x;
    std::memcpy(&x, tile + 8 * (n - 1 - j), 8);
    x = __builtin_bswap64(x);
    if constexpr (k <= 4) x = ((x >> 4) & 0x0F0F0F0F0F0F0F0Full) | ((x & 0x0F0F0F0F0F0F0F0Full) << 4);
    if constexpr (k <= 2) x = ((x >> 2) & 0x3333333333333333ull) | ((x & 0x3333333333333333ull) << 2);
    if constexpr (k == 1) x = ((x >> 1) & 0x5555555555555555ull) | ((x & 0x5555555555555555ull) << 1);
    rev[j] = x;
  }
  rev[n] = 0;
}

// Four 3-bit steps (12 bits) in reverse order: reverse_steps<3>'s table (8 KB).
const uint16_t* reverse12() {
  static const auto table = [] {
    std::vector<uint16_t> t(4096);
    for (uint32_t v = 0; v < 4096; ++v) {
      t[v] = static_cast<uint16_t>((v >> 9) | ((v >> 3) & 0x38) | ((v << 3) & 0x1C0) | ((v & 7) << 9));
    }
    return t;
  }();
  return table.data();
}

// k = 3: the tile's 32 units of 3 bytes (8 steps each) in reverse order, each through the table.
// Scalar work, beside the vector work of the tile before.
template <>
inline void reverse_steps<3>(const uint8_t* tile, uint64_t* rev) {
  const uint16_t* t = reverse12();
  auto* out = reinterpret_cast<uint8_t*>(rev);
  for (int p = 0; p < 32; ++p) {
    const uint8_t* in = tile + 3 * (31 - p);
    const uint32_t u = in[0] | (in[1] << 8) | (in[2] << 16);
    const uint32_t r = t[u >> 12] | (static_cast<uint32_t>(t[u & 4095]) << 12);
    std::memcpy(out + 3 * p, &r, 4); // its fourth byte is the next unit's first (or padding)
  }
  rev[12] = 0;
}

template <int k>
constexpr bool kReversed = 8 % k == 0 || k == 3;

// The states of weights 8G..8G+7 of a tile (rows 8(G % 4).. of column G / 4) as int32 lanes.
// Reversed widths: one 64-bit load of the reversed stream. Others: the eight natural windows of
// ceil(L / k) steps from 64 stream bits at byte kG - 2 (bitpack's order, the newest step on top),
// then each window's steps reversed in the lanes.
template <int k>
__attribute__((target("avx2,fma"), always_inline)) inline __m256i states8(
    const uint8_t* tile, const uint64_t* rev, int G, int L, __m256i mask) {
  if constexpr (kReversed<k>) {
    const int bit = k * (248 - 8 * G); // lane 7's state; lane l's is k(7 - l) bits above
    uint64_t u;
    std::memcpy(&u, reinterpret_cast<const uint8_t*>(rev) + bit / 8, 8);
    u >>= bit % 8;
    __m256i w;
    if (7 * k + L <= 32) {
      w = _mm256_srlv_epi32(_mm256_set1_epi32(static_cast<int>(u)),
                            _mm256_setr_epi32(7 * k, 6 * k, 5 * k, 4 * k, 3 * k, 2 * k, k, 0));
    } else {
      const __m256i both = _mm256_inserti128_si256(
          _mm256_castsi128_si256(_mm_set1_epi32(static_cast<int>(u >> (4 * k)))), _mm_set1_epi32(static_cast<int>(u)), 1);
      w = _mm256_srlv_epi32(both, _mm256_setr_epi32(3 * k, 2 * k, k, 0, 3 * k, 2 * k, k, 0));
    }
    return _mm256_and_si256(w, mask);
  } else {
    constexpr int bytes = 32 * k;
    const int n = (L + k - 1) / k, W = n * k;
    const int at = G * k - 2, o = std::clamp(at, 0, bytes - 8);
    uint64_t u;
    std::memcpy(&u, tile + o, 8);
    u = at >= o ? u >> (8 * (at - o)) : u << (8 * (o - at)); // bit 0 = stream bit 8kG - 16
    const int s0 = 16 + k - W; // lane 0's window; lane l's k l bits above
    const uint32_t lo = static_cast<uint32_t>(u >> s0), hi = static_cast<uint32_t>(u >> (s0 + 4 * k));
    __m256i w = _mm256_inserti128_si256(_mm256_castsi128_si256(_mm_set1_epi32(static_cast<int>(lo))),
                                        _mm_set1_epi32(static_cast<int>(hi)), 1);
    w = _mm256_srlv_epi32(w, _mm256_setr_epi32(0, k, 2 * k, 3 * k, 0, k, 2 * k, 3 * k));
    // step j of the window (bits kj..) is step n - 1 - j of the state
    __m256i s = _mm256_setzero_si256();
    for (int j = 0; j < n; ++j) {
      const int d = k * (n - 1 - 2 * j); // up by d bits
      const __m256i part = d >= 0 ? _mm256_slli_epi32(w, d) : _mm256_srli_epi32(w, -d);
      s = _mm256_or_si256(s, _mm256_and_si256(part, _mm256_set1_epi32(((1 << k) - 1) << (k * (n - 1 - j)))));
    }
    return _mm256_and_si256(s, mask);
  }
}

// 1MAD of eight states: the LCG, the sum of its four bytes, one fused multiply-add.
__attribute__((target("avx2,fma"), always_inline)) inline __m256 code8(__m256i s, __m256 a, __m256 b) {
  const __m256i h = _mm256_add_epi32(_mm256_mullo_epi32(s, _mm256_set1_epi32(static_cast<int>(kLcgMul))),
                                     _mm256_set1_epi32(static_cast<int>(kLcgAdd)));
  const __m256i sum = _mm256_madd_epi16(_mm256_maddubs_epi16(h, _mm256_set1_epi8(1)), _mm256_set1_epi16(1));
  return _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum), a, b);
}

template <int k, int M>
__attribute__((target("avx2,fma"))) void blocks_avx2(const TrellisArgs& a, int b0, int b1, int m0) {
  const int tiles = a.cols / kTileCols;
  const __m256i mask = _mm256_set1_epi32((1 << a.L) - 1);
  const __m256 ca = _mm256_set1_ps(a.a), cb_ = _mm256_set1_ps(a.b);
  const float* x = a.x + static_cast<size_t>(m0) * a.cols;
  // two buffers: a tile's reversed stream is written one tile ahead of its reads, so its loads
  // (at byte offsets that straddle the stores) do not wait on store forwarding
  uint64_t revs[2][4 * 4 + 1];
  for (int rb = b0; rb < b1; ++rb) {
    __m256 acc[M][4];
    for (int mm = 0; mm < M; ++mm) {
      for (int g = 0; g < 4; ++g) acc[mm][g] = _mm256_setzero_ps();
    }
    const uint8_t* row = reinterpret_cast<const uint8_t*>(a.packed + static_cast<size_t>(rb) * tiles * 8 * k);
    if constexpr (kReversed<k>) reverse_steps<k>(row, revs[0]);
    for (int cb = 0; cb < tiles; ++cb) {
      const uint8_t* tile = row + cb * 32 * k;
      const uint64_t* rev = revs[cb & 1];
      if constexpr (kReversed<k>) {
        if (cb + 1 < tiles) reverse_steps<k>(tile + 32 * k, revs[(cb + 1) & 1]);
      }
#pragma GCC unroll 8
      for (int c = 0; c < kTileCols; ++c) {
        __m256 xb[M];
        for (int mm = 0; mm < M; ++mm) xb[mm] = _mm256_broadcast_ss(x + static_cast<size_t>(mm) * a.cols + cb * kTileCols + c);
#pragma GCC unroll 4
        for (int g = 0; g < 4; ++g) {
          const __m256 v = code8(states8<k>(tile, rev, 4 * c + g, a.L, mask), ca, cb_);
          for (int mm = 0; mm < M; ++mm) acc[mm][g] = _mm256_fmadd_ps(v, xb[mm], acc[mm][g]);
        }
      }
    }
    const int r0 = rb * kTileRows;
    for (int g = 0; g < 4; ++g) {
      const __m256 s = _mm256_loadu_ps(a.row_scales + r0 + 8 * g);
      const __m256 bias = a.bias ? _mm256_loadu_ps(a.bias + r0 + 8 * g) : _mm256_setzero_ps();
      for (int mm = 0; mm < M; ++mm) {
        _mm256_storeu_ps(a.y + static_cast<size_t>(m0 + mm) * a.rows + r0 + 8 * g,
                         _mm256_add_ps(_mm256_mul_ps(acc[mm][g], s), bias));
      }
    }
  }
}

template <int k>
void blocks_avx2_m(const TrellisArgs& a, int b0, int b1, int m0, int mc) {
  switch (mc) {
    case 1: return blocks_avx2<k, 1>(a, b0, b1, m0);
    case 2: return blocks_avx2<k, 2>(a, b0, b1, m0);
    case 3: return blocks_avx2<k, 3>(a, b0, b1, m0);
    default: return blocks_avx2<k, 4>(a, b0, b1, m0);
  }
}

bool blocks_fast(const TrellisArgs& a, int b0, int b1, int m0, int mc) {
  // the windows of eight weights in 64 bits (k <= 6, L <= 16), four in 32 bits (3k + W <= 32)
  if (!has_avx2() || a.L > 16 || 3 * a.k + (a.L + a.k - 1) / a.k * a.k > 32) return false;
  switch (a.k) {
    case 1: blocks_avx2_m<1>(a, b0, b1, m0, mc); return true;
    case 2: blocks_avx2_m<2>(a, b0, b1, m0, mc); return true;
    case 3: blocks_avx2_m<3>(a, b0, b1, m0, mc); return true;
    case 4: blocks_avx2_m<4>(a, b0, b1, m0, mc); return true;
    case 5: blocks_avx2_m<5>(a, b0, b1, m0, mc); return true;
    case 6: blocks_avx2_m<6>(a, b0, b1, m0, mc); return true;
    default: return false;
  }
}

#endif // VQ_X86

} // namespace

void trellis_matvec_blocks(const TrellisArgs& a, int b0, int b1) {
  for (int m0 = 0; m0 < a.m; m0 += kMaxM) {
    const int mc = std::min(kMaxM, a.m - m0);
#ifdef VQ_X86
    if (blocks_fast(a, b0, b1, m0, mc)) continue;
#endif
    blocks_portable(a, b0, b1, m0, mc);
  }
}

} // namespace vqpipe
