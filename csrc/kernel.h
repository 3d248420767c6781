// The CPU codebook mat-vec: y[m, o] = s_o * sum_i C[q_oi] x[m, i] + b_o (per-row scales), or
// sum_i s_o,i/g C[q_oi] x[m, i] + b_o (group scales), read straight from the packed codes.
#pragma once

#include <cstdint>

namespace vqpipe {

struct MatvecArgs {
  const uint32_t* packed; // [rows, words]: bits words per 32 values (vqpipe/bitpack.py)
  const float* x; // [m, padded] float32, zero past in_features
  const float* codebook; // [2^bits]
  const float* row_scales; // [rows] or null
  const void* group_scales; // [rows, in / group_size] (float32 or float16) or null
  bool group_scales_half;
  const float* bias; // [rows] or null
  float* y; // [m, rows] float32
  int bits, m, rows, in_features, padded, group_size;
};

// Rows [r0, r1) of y for all m.
void matvec_rows(const MatvecArgs& a, int r0, int r1);

// Whether the AVX2/FMA kernel runs on this machine (else the portable one).
bool has_avx2();

// Whether the NEON kernel runs on this machine (arm64; else the portable one).
bool has_neon();

// Take the portable kernel even where AVX2 or NEON is there (tests); returns the previous setting.
bool set_portable(bool flag);

} // namespace vqpipe
