// Bitshift-trellis kernels (vqpipe/codec/trellis.py is the reference): the Viterbi search of the
// quantizer and the CPU mat-vec of decode. State s_i = ((s_{i-1} << k) | b_i) mod 2^L from
// s_{-1} = 0, value table[s_i]; a tile's b_i are stored little-endian, k bits each (bitpack.py).
#pragma once

#include <cstdint>

namespace vqpipe {

// The least-squares path of each of the n sequences x [n, T] (float32, finite) from state 0:
// states [n, T]. Exactly the reference's result: the first predecessor (lowest top bits) and
// the lowest final state win ties, float32 costs as (x - table[s])^2 + cost. Needs k <= 8,
// k <= L <= 16; runs sequences [s0, s1).
void trellis_viterbi(const float* x, int64_t s0, int64_t s1, int T, int L, int k, const float* table,
                     int32_t* states);

// The 1MAD code: value(s) = a * (the sum of the four bytes of s * kLcgMul + kLcgAdd mod 2^32) + b,
// one float32 fused multiply-add (vqpipe.codec.trellis.table is defined by the same rounding).
constexpr uint32_t kLcgMul = 34038481u, kLcgAdd = 76625530u;
float trellis_code(uint32_t state, float a, float b);

struct TrellisArgs {
  const uint32_t* packed; // [rows / 32, cols / 8 * 8k]: tile (rb, cb) at row rb, words cb*8k..
  const float* x; // [m, cols] float32
  float a, b; // the code's affine map (trellis_code)
  const float* row_scales; // [rows]
  const float* bias; // [rows] or null
  float* y; // [m, rows] float32
  int k, L, m, rows, cols;
};

constexpr int kTileRows = 32, kTileCols = 8;

// The state after step i of a tile's stream (k-bit steps, little-endian words) from the state before it.
inline uint32_t next_state(const uint32_t* tile, int i, int k, uint32_t state, uint32_t mask) {
  const int bit = k * i, word = bit >> 5, shift = bit & 31;
  uint32_t q = tile[word] >> shift;
  if (shift + k > 32) q |= tile[word + 1] << (32 - shift);
  return ((state << k) | (q & ((1u << k) - 1))) & mask;
}

// Row blocks [b0, b1) (32 rows each) of y for all m.
void trellis_matvec_blocks(const TrellisArgs& a, int b0, int b1);

} // namespace vqpipe
