#include "kernel.h"

#include <algorithm>
#include <array>
#include <atomic>
#include <cstring>
#include <vector>

#include "mlx/types/half_types.h"

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define VQ_X86 1
#include <immintrin.h>
#endif
#if defined(__aarch64__) && defined(__ARM_NEON)
#define VQ_NEON 1
#include <arm_neon.h>
#endif

namespace vqpipe {

namespace {

constexpr int kMaxM = 8; // rows of x per pass; more are done in passes of 8
std::atomic<bool> portable{false};

inline float scale_at(const MatvecArgs& a, int row, int group) {
  const int groups = a.in_features / a.group_size;
  const size_t k = static_cast<size_t>(row) * groups + group;
  if (a.group_scales_half) {
    return static_cast<float>(static_cast<const mlx::core::float16_t*>(a.group_scales)[k]);
  }
  return static_cast<const float*>(a.group_scales)[k];
}

// Scale of each of the 32 values of block k (group scales), zero past in_features.
inline void block_scales(const MatvecArgs& a, int row, int k, float* s) {
  const int groups = a.in_features / a.group_size;
  for (int j = 0; j < 32; ++j) {
    const int i = k * 32 + j;
    s[j] = i < a.in_features ? scale_at(a, row, std::min(i / a.group_size, groups - 1)) : 0.0f;
  }
}

// Portable path: decode a block's 32 codes through a 64-bit window, then plain loops.
void rows_scalar(const MatvecArgs& a, int r0, int r1, int m0, int mc) {
  const int bits = a.bits, blocks = a.padded / 32, words = bits * blocks;
  const uint32_t mask = (1u << bits) - 1;
  const bool whole = a.group_size % 32 == 0;
  float v[32], s[32];
  for (int r = r0; r < r1; ++r) {
    const uint32_t* w = a.packed + static_cast<size_t>(r) * words;
    float acc[kMaxM] = {};
    for (int k = 0; k < blocks; ++k, w += bits) {
      for (int j = 0; j < 32; ++j) {
        const int bit = j * bits, word = bit >> 5, shift = bit & 31;
        uint32_t q = w[word] >> shift;
        if (shift + bits > 32) {
          q |= w[word + 1] << (32 - shift);
        }
        v[j] = a.codebook[q & mask];
      }
      if (a.group_scales) {
        if (whole) {
          const float g = scale_at(a, r, k * 32 / a.group_size);
          for (int j = 0; j < 32; ++j) v[j] *= g;
        } else {
          block_scales(a, r, k, s);
          for (int j = 0; j < 32; ++j) v[j] *= s[j];
        }
      }
      for (int mm = 0; mm < mc; ++mm) {
        const float* xm = a.x + static_cast<size_t>(m0 + mm) * a.padded + k * 32;
        float t = 0.0f;
        for (int j = 0; j < 32; ++j) t += v[j] * xm[j];
        acc[mm] += t;
      }
    }
    for (int mm = 0; mm < mc; ++mm) {
      float y = acc[mm];
      if (a.row_scales) y *= a.row_scales[r];
      if (a.bias) y += a.bias[r];
      a.y[static_cast<size_t>(m0 + mm) * a.rows + r] = y;
    }
  }
}

#ifdef VQ_X86

// Where value j of a 32-value block lies in the block's `bits` words: word j*bits/32 at shift
// j*bits%32, and, for widths that straddle words, the rest in the next word.
struct Layout {
  alignas(32) int32_t lo[32], hi[32], shift[32], hshift[32];
};

constexpr Layout make_layout(int bits) {
  Layout l{};
  for (int j = 0; j < 32; ++j) {
    const int bit = j * bits, word = bit / 32, shift = bit % 32;
    l.lo[j] = word;
    l.shift[j] = shift;
    const bool straddle = shift + bits > 32;
    l.hi[j] = straddle ? word + 1 : 0;
    l.hshift[j] = straddle ? 32 - shift : 32; // a shift of 32 gives 0 in vpsllvd
  }
  return l;
}

template <int B>
constexpr Layout kLayout = make_layout(B);

// 8 codes (values 8g..8g+7 of the block) as int32 lanes.
template <int B>
__attribute__((target("avx2,fma"))) inline __m256i codes8(const uint32_t* w, __m256i block, int g) {
  const __m256i mask = _mm256_set1_epi32((1 << B) - 1);
  if constexpr (B == 4) {
    const __m256i sh = _mm256_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28);
    return _mm256_and_si256(_mm256_srlv_epi32(_mm256_set1_epi32(static_cast<int>(w[g])), sh), mask);
  } else if constexpr (B == 2) {
    const __m256i sh = _mm256_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14);
    const __m256i s = _mm256_add_epi32(sh, _mm256_set1_epi32((g & 1) * 16));
    return _mm256_and_si256(_mm256_srlv_epi32(_mm256_set1_epi32(static_cast<int>(w[g >> 1])), s), mask);
  } else if constexpr (B == 8) {
    __m128i bytes;
    std::memcpy(&bytes, reinterpret_cast<const uint8_t*>(w) + 8 * g, 8);
    return _mm256_cvtepu8_epi32(bytes);
  } else {
    const Layout& l = kLayout<B>;
    const __m256i lo = _mm256_permutevar8x32_epi32(block, _mm256_load_si256(reinterpret_cast<const __m256i*>(l.lo + 8 * g)));
    const __m256i hi = _mm256_permutevar8x32_epi32(block, _mm256_load_si256(reinterpret_cast<const __m256i*>(l.hi + 8 * g)));
    const __m256i v = _mm256_or_si256(
        _mm256_srlv_epi32(lo, _mm256_load_si256(reinterpret_cast<const __m256i*>(l.shift + 8 * g))),
        _mm256_sllv_epi32(hi, _mm256_load_si256(reinterpret_cast<const __m256i*>(l.hshift + 8 * g))));
    return _mm256_and_si256(v, mask);
  }
}

// Codebook values of 8 codes: register permutes for up to 32 levels, a gather above.
template <int B>
__attribute__((target("avx2,fma"))) inline __m256 lookup8(__m256i q, const __m256* cb, const float* table) {
  if constexpr (B <= 3) {
    return _mm256_permutevar8x32_ps(cb[0], q);
  } else if constexpr (B == 4) {
    const __m256 hi = _mm256_castsi256_ps(_mm256_slli_epi32(q, 28)); // bit 3 -> sign
    return _mm256_blendv_ps(_mm256_permutevar8x32_ps(cb[0], q), _mm256_permutevar8x32_ps(cb[1], q), hi);
  } else if constexpr (B == 5) {
    const __m256 b3 = _mm256_castsi256_ps(_mm256_slli_epi32(q, 28));
    const __m256 b4 = _mm256_castsi256_ps(_mm256_slli_epi32(q, 27));
    const __m256 lo = _mm256_blendv_ps(_mm256_permutevar8x32_ps(cb[0], q), _mm256_permutevar8x32_ps(cb[1], q), b3);
    const __m256 hi = _mm256_blendv_ps(_mm256_permutevar8x32_ps(cb[2], q), _mm256_permutevar8x32_ps(cb[3], q), b3);
    return _mm256_blendv_ps(lo, hi, b4);
  } else {
    return _mm256_i32gather_ps(table, q, 4);
  }
}

__attribute__((target("avx2,fma"))) inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// The codebook into registers (cb) and a 256-entry table (table, zeroed by the caller); returns the
// mask that loads a block's B words.
template <int B>
__attribute__((target("avx2,fma"), always_inline)) inline __m256i load_codebook(
    const MatvecArgs& a, __m256* cb, float* table) {
  std::memcpy(table, a.codebook, sizeof(float) << B);
  for (int t = 0; t < 4; ++t) cb[t] = _mm256_load_ps(table + 8 * t);
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(B), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}

// Block k of row r (its B words at w): the 32 codebook values, group scales applied, into v[0..3].
template <int B>
__attribute__((target("avx2,fma"), always_inline)) inline void block_values(
    const MatvecArgs& a, int r, int k, const uint32_t* w, __m256i load_mask, const __m256* cb,
    const float* table, bool whole, float* s, __m256* v) {
  __m256i block = _mm256_setzero_si256();
  if constexpr (B != 2 && B != 4 && B != 8) {
    block = _mm256_maskload_epi32(reinterpret_cast<const int*>(w), load_mask);
  }
  for (int g = 0; g < 4; ++g) v[g] = lookup8<B>(codes8<B>(w, block, g), cb, table);
  if (a.group_scales) {
    if (whole) {
      const __m256 sg = _mm256_set1_ps(scale_at(a, r, k * 32 / a.group_size));
      for (int g = 0; g < 4; ++g) v[g] = _mm256_mul_ps(v[g], sg);
    } else {
      block_scales(a, r, k, s);
      for (int g = 0; g < 4; ++g) v[g] = _mm256_mul_ps(v[g], _mm256_load_ps(s + 8 * g));
    }
  }
}

template <int B, int M>
__attribute__((target("avx2,fma"))) void rows_avx2(const MatvecArgs& a, int r0, int r1, int m0) {
  const int blocks = a.padded / 32, words = B * blocks;
  const bool whole = a.group_size % 32 == 0;
  __m256 cb[4];
  alignas(32) float table[256] = {};
  const __m256i load_mask = load_codebook<B>(a, cb, table);
  const float* x = a.x + static_cast<size_t>(m0) * a.padded;
  alignas(32) float s[32];
  for (int r = r0; r < r1; ++r) {
    const uint32_t* w = a.packed + static_cast<size_t>(r) * words;
    __m256 acc[M][2];
    for (int mm = 0; mm < M; ++mm) acc[mm][0] = acc[mm][1] = _mm256_setzero_ps();
    for (int k = 0; k < blocks; ++k, w += B) {
      __m256 v[4];
      block_values<B>(a, r, k, w, load_mask, cb, table, whole, s, v);
      const float* xk = x + k * 32;
      for (int mm = 0; mm < M; ++mm) {
        const float* xm = xk + static_cast<size_t>(mm) * a.padded;
        acc[mm][0] = _mm256_fmadd_ps(v[0], _mm256_loadu_ps(xm), acc[mm][0]);
        acc[mm][1] = _mm256_fmadd_ps(v[1], _mm256_loadu_ps(xm + 8), acc[mm][1]);
        acc[mm][0] = _mm256_fmadd_ps(v[2], _mm256_loadu_ps(xm + 16), acc[mm][0]);
        acc[mm][1] = _mm256_fmadd_ps(v[3], _mm256_loadu_ps(xm + 24), acc[mm][1]);
      }
    }
    for (int mm = 0; mm < M; ++mm) {
      float y = hsum(_mm256_add_ps(acc[mm][0], acc[mm][1]));
      if (a.row_scales) y *= a.row_scales[r];
      if (a.bias) y += a.bias[r];
      a.y[static_cast<size_t>(m0 + mm) * a.rows + r] = y;
    }
  }
}

// Larger M (prefill-sized): each row decoded once into a buffer, then one dot product per row of x.
template <int B>
__attribute__((target("avx2,fma"))) void rows_avx2_wide(const MatvecArgs& a, int r0, int r1) {
  const int blocks = a.padded / 32, words = B * blocks;
  const bool whole = a.group_size % 32 == 0;
  __m256 cb[4];
  alignas(32) float table[256] = {};
  const __m256i load_mask = load_codebook<B>(a, cb, table);
  std::vector<float> row(a.padded);
  alignas(32) float s[32];
  for (int r = r0; r < r1; ++r) {
    const uint32_t* w = a.packed + static_cast<size_t>(r) * words;
    for (int k = 0; k < blocks; ++k, w += B) {
      __m256 v[4];
      block_values<B>(a, r, k, w, load_mask, cb, table, whole, s, v);
      for (int g = 0; g < 4; ++g) _mm256_storeu_ps(row.data() + k * 32 + 8 * g, v[g]);
    }
    for (int mm = 0; mm < a.m; ++mm) {
      const float* xm = a.x + static_cast<size_t>(mm) * a.padded;
      __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
      for (int i = 0; i < a.padded; i += 16) {
        acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(row.data() + i), _mm256_loadu_ps(xm + i), acc0);
        acc1 = _mm256_fmadd_ps(_mm256_loadu_ps(row.data() + i + 8), _mm256_loadu_ps(xm + i + 8), acc1);
      }
      float y = hsum(_mm256_add_ps(acc0, acc1));
      if (a.row_scales) y *= a.row_scales[r];
      if (a.bias) y += a.bias[r];
      a.y[static_cast<size_t>(mm) * a.rows + r] = y;
    }
  }
}

template <int B>
void rows_avx2_m(const MatvecArgs& a, int r0, int r1, int m0, int mc) {
  switch (mc) {
    case 1: return rows_avx2<B, 1>(a, r0, r1, m0);
    case 2: return rows_avx2<B, 2>(a, r0, r1, m0);
    case 3: return rows_avx2<B, 3>(a, r0, r1, m0);
    case 4: return rows_avx2<B, 4>(a, r0, r1, m0);
    case 5: return rows_avx2<B, 5>(a, r0, r1, m0);
    case 6: return rows_avx2<B, 6>(a, r0, r1, m0);
    case 7: return rows_avx2<B, 7>(a, r0, r1, m0);
    default: return rows_avx2<B, 8>(a, r0, r1, m0);
  }
}

void rows_avx2_wide_any(const MatvecArgs& a, int r0, int r1) {
  switch (a.bits) {
    case 2: return rows_avx2_wide<2>(a, r0, r1);
    case 3: return rows_avx2_wide<3>(a, r0, r1);
    case 4: return rows_avx2_wide<4>(a, r0, r1);
    case 5: return rows_avx2_wide<5>(a, r0, r1);
    case 6: return rows_avx2_wide<6>(a, r0, r1);
    default: return rows_avx2_wide<8>(a, r0, r1);
  }
}

void rows_avx2_any(const MatvecArgs& a, int r0, int r1, int m0, int mc) {
  switch (a.bits) {
    case 2: return rows_avx2_m<2>(a, r0, r1, m0, mc);
    case 3: return rows_avx2_m<3>(a, r0, r1, m0, mc);
    case 4: return rows_avx2_m<4>(a, r0, r1, m0, mc);
    case 5: return rows_avx2_m<5>(a, r0, r1, m0, mc);
    case 6: return rows_avx2_m<6>(a, r0, r1, m0, mc);
    default: return rows_avx2_m<8>(a, r0, r1, m0, mc);
  }
}

#endif // VQ_X86

#ifdef VQ_NEON

// The 32 codes of a block as bytes: vector nibble/crumb splits at 2 and 4 bits, a 64-bit window
// elsewhere.
template <int B>
inline void codes32(const uint32_t* w, uint8_t* q) {
  if constexpr (B == 4) {
    const uint8x16_t b = vld1q_u8(reinterpret_cast<const uint8_t*>(w));
    const uint8x16_t lo = vandq_u8(b, vdupq_n_u8(15)), hi = vshrq_n_u8(b, 4);
    vst1q_u8(q, vzip1q_u8(lo, hi));
    vst1q_u8(q + 16, vzip2q_u8(lo, hi));
  } else if constexpr (B == 2) {
    const uint8x8_t b = vld1_u8(reinterpret_cast<const uint8_t*>(w));
    const uint8x8_t m = vdup_n_u8(3);
    const uint8x8_t c0 = vand_u8(b, m), c1 = vand_u8(vshr_n_u8(b, 2), m);
    const uint8x8_t c2 = vand_u8(vshr_n_u8(b, 4), m), c3 = vshr_n_u8(b, 6);
    // byte i holds codes 4i..4i+3 in (c0, c1, c2, c3)
    const uint8x8x4_t t = {{c0, c1, c2, c3}};
    vst4_u8(q, t);
  } else if constexpr (B == 8) {
    std::memcpy(q, w, 32);
  } else {
    const uint32_t mask = (1u << B) - 1;
    for (int j = 0; j < 32; ++j) {
      const int bit = j * B, word = bit >> 5, shift = bit & 31;
      uint64_t window = w[word];
      if (shift + B > 32) window |= static_cast<uint64_t>(w[word + 1]) << 32;
      q[j] = static_cast<uint8_t>((window >> shift) & mask);
    }
  }
}

// Codebook values of 16 codes (bytes): a byte-table lookup of the float bytes up to 16 levels,
// loads above.
template <int B>
inline void lookup16(const uint8_t* q, const uint8x16x4_t& cb, const float* table, float32x4_t* v) {
  if constexpr (B <= 4) {
    static const uint8_t rep[4][16] = {
        {0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3}, {4, 4, 4, 4, 5, 5, 5, 5, 6, 6, 6, 6, 7, 7, 7, 7},
        {8, 8, 8, 8, 9, 9, 9, 9, 10, 10, 10, 10, 11, 11, 11, 11},
        {12, 12, 12, 12, 13, 13, 13, 13, 14, 14, 14, 14, 15, 15, 15, 15}};
    static const uint8_t lane[16] = {0, 1, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3};
    const uint8x16_t idx = vld1q_u8(q), off = vld1q_u8(lane);
    for (int g = 0; g < 4; ++g) {
      const uint8x16_t byte = vaddq_u8(vshlq_n_u8(vqtbl1q_u8(idx, vld1q_u8(rep[g])), 2), off);
      v[g] = vreinterpretq_f32_u8(vqtbl4q_u8(cb, byte));
    }
  } else {
    for (int g = 0; g < 4; ++g) {
      const float t[4] = {table[q[4 * g]], table[q[4 * g + 1]], table[q[4 * g + 2]], table[q[4 * g + 3]]};
      v[g] = vld1q_f32(t);
    }
  }
}

template <int B, int M>
void rows_neon(const MatvecArgs& a, int r0, int r1, int m0) {
  const int blocks = a.padded / 32, words = B * blocks;
  const bool whole = a.group_size % 32 == 0;
  alignas(16) float table[256] = {};
  std::memcpy(table, a.codebook, sizeof(float) << B);
  uint8x16x4_t cb;
  cb.val[0] = vld1q_u8(reinterpret_cast<const uint8_t*>(table));
  cb.val[1] = vld1q_u8(reinterpret_cast<const uint8_t*>(table + 4));
  cb.val[2] = vld1q_u8(reinterpret_cast<const uint8_t*>(table + 8));
  cb.val[3] = vld1q_u8(reinterpret_cast<const uint8_t*>(table + 12));
  const float* x = a.x + static_cast<size_t>(m0) * a.padded;
  alignas(16) float s[32];
  alignas(16) uint8_t q[32];
  for (int r = r0; r < r1; ++r) {
    const uint32_t* w = a.packed + static_cast<size_t>(r) * words;
    float32x4_t acc[M][2];
    for (int mm = 0; mm < M; ++mm) acc[mm][0] = acc[mm][1] = vdupq_n_f32(0.0f);
    for (int k = 0; k < blocks; ++k, w += B) {
      float32x4_t v[8];
      codes32<B>(w, q);
      lookup16<B>(q, cb, table, v);
      lookup16<B>(q + 16, cb, table, v + 4);
      if (a.group_scales) {
        if (whole) {
          const float32x4_t sg = vdupq_n_f32(scale_at(a, r, k * 32 / a.group_size));
          for (int g = 0; g < 8; ++g) v[g] = vmulq_f32(v[g], sg);
        } else {
          block_scales(a, r, k, s);
          for (int g = 0; g < 8; ++g) v[g] = vmulq_f32(v[g], vld1q_f32(s + 4 * g));
        }
      }
      const float* xk = x + k * 32;
      for (int mm = 0; mm < M; ++mm) {
        const float* xm = xk + static_cast<size_t>(mm) * a.padded;
        for (int g = 0; g < 8; g += 2) {
          acc[mm][0] = vfmaq_f32(acc[mm][0], v[g], vld1q_f32(xm + 4 * g));
          acc[mm][1] = vfmaq_f32(acc[mm][1], v[g + 1], vld1q_f32(xm + 4 * g + 4));
        }
      }
    }
    for (int mm = 0; mm < M; ++mm) {
      float y = vaddvq_f32(vaddq_f32(acc[mm][0], acc[mm][1]));
      if (a.row_scales) y *= a.row_scales[r];
      if (a.bias) y += a.bias[r];
      a.y[static_cast<size_t>(m0 + mm) * a.rows + r] = y;
    }
  }
}

template <int B>
void rows_neon_m(const MatvecArgs& a, int r0, int r1, int m0, int mc) {
  switch (mc) {
    case 1: return rows_neon<B, 1>(a, r0, r1, m0);
    case 2: return rows_neon<B, 2>(a, r0, r1, m0);
    case 3: return rows_neon<B, 3>(a, r0, r1, m0);
    case 4: return rows_neon<B, 4>(a, r0, r1, m0);
    case 5: return rows_neon<B, 5>(a, r0, r1, m0);
    case 6: return rows_neon<B, 6>(a, r0, r1, m0);
    case 7: return rows_neon<B, 7>(a, r0, r1, m0);
    default: return rows_neon<B, 8>(a, r0, r1, m0);
  }
}

void rows_neon_any(const MatvecArgs& a, int r0, int r1, int m0, int mc) {
  switch (a.bits) {
    case 2: return rows_neon_m<2>(a, r0, r1, m0, mc);
    case 3: return rows_neon_m<3>(a, r0, r1, m0, mc);
    case 4: return rows_neon_m<4>(a, r0, r1, m0, mc);
    case 5: return rows_neon_m<5>(a, r0, r1, m0, mc);
    case 6: return rows_neon_m<6>(a, r0, r1, m0, mc);
    default: return rows_neon_m<8>(a, r0, r1, m0, mc);
  }
}

#endif // VQ_NEON

} // namespace

bool has_avx2() {
#ifdef VQ_X86
  static const bool yes = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  return yes && !portable.load(std::memory_order_relaxed);
#else
  return false;
#endif
}

bool has_neon() {
#ifdef VQ_NEON
  return !portable.load(std::memory_order_relaxed);
#else
  return false;
#endif
}

bool set_portable(bool flag) {
  return portable.exchange(flag);
}

void matvec_rows(const MatvecArgs& a, int r0, int r1) {
#ifdef VQ_X86
  if (has_avx2() && a.m > kMaxM) {
    rows_avx2_wide_any(a, r0, r1);
    return;
  }
#endif
  // Rows of x in passes of kMaxM (the portable path decodes the weights again per pass).
  for (int m0 = 0; m0 < a.m; m0 += kMaxM) {
    const int mc = std::min(kMaxM, a.m - m0);
#ifdef VQ_X86
    if (has_avx2()) {
      rows_avx2_any(a, r0, r1, m0, mc);
      continue;
    }
#endif
#ifdef VQ_NEON
    if (has_neon()) {
      rows_neon_any(a, r0, r1, m0, mc);
      continue;
    }
#endif
    rows_scalar(a, r0, r1, m0, mc);
  }
}

} // namespace vqpipe
