// Reading an MLX primitive's operands on the CPU, any dtype and strides (codebook_matvec,
// trellis_matvec): small operands as float32 copies, the outputs written back in their dtype.
#pragma once

#include <algorithm>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

#include "mlx/array.h"
#include "mlx/types/half_types.h"

namespace mlx::core::operands {

// Plain string concatenation: an ostringstream here crashed the CUDA build of the module on the
// H100 (docs/results/2026-12-06-h100-user), the same code being fine on the CPU build.
inline std::string shape_str(const Shape& s) {
  std::string out = "(";
  for (size_t i = 0; i < s.size(); ++i) out += (i ? ", " : "") + std::to_string(s[i]);
  return out + (s.size() == 1 ? ",)" : ")");
}

inline bool is_float(Dtype t) {
  return t == float32 || t == float16 || t == bfloat16;
}

// Element k (row-major order) of `a`, any strides.
inline size_t location(const array& a, size_t k) {
  size_t loc = 0;
  for (int d = a.ndim() - 1; d >= 0; --d) {
    loc += (k % a.shape(d)) * a.strides()[d];
    k /= a.shape(d);
  }
  return loc;
}

template <typename T>
inline float read(const array& a, size_t k) {
  return static_cast<float>(a.data<T>()[a.flags().row_contiguous ? k : location(a, k)]);
}

inline float read_float(const array& a, size_t k) {
  switch (a.dtype()) {
    case float16: return read<float16_t>(a, k);
    case bfloat16: return read<bfloat16_t>(a, k);
    default: return read<float>(a, k);
  }
}

// `a` as contiguous float32 (a copy; for the small operands: bias, codebook, per-row scales).
inline std::vector<float> floats(const array& a) {
  std::vector<float> v(a.size());
  if (a.dtype() == float32 && a.flags().row_contiguous) {
    std::copy_n(a.data<float>(), a.size(), v.data());
  } else {
    for (size_t k = 0; k < a.size(); ++k) v[k] = read_float(a, k);
  }
  return v;
}

template <typename T>
inline void store(const std::vector<float>& y, array& out) {
  T* o = out.data<T>();
  for (size_t k = 0; k < y.size(); ++k) o[k] = static_cast<T>(y[k]);
}

// float32 results y into out where out is float16/bfloat16 (a float32 out was written directly).
inline void store_back(const std::vector<float>& y, array& out) {
  if (out.dtype() == float16) {
    store<float16_t>(y, out);
  } else if (out.dtype() == bfloat16) {
    store<bfloat16_t>(y, out);
  }
}

// The packed codes in row-major order: read in place, or (rarely: a strided view) copied into `copy`.
inline const uint32_t* row_major_codes(const array& packed, std::vector<uint32_t>& copy) {
  if (packed.flags().row_contiguous) return packed.data<uint32_t>();
  copy.resize(packed.size());
  for (size_t k = 0; k < packed.size(); ++k) copy[k] = packed.data<uint32_t>()[location(packed, k)];
  return copy.data();
}

// The invalid_argument every bad operand of the op `name` raises, the op named first.
[[noreturn]] inline void fail(const char* name, const std::string& msg) {
  throw std::invalid_argument(std::string(name) + ": " + msg);
}

} // namespace mlx::core::operands
