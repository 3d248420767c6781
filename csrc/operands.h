// Reading an MLX primitive's operands on the CPU, any dtype and strides (codebook_matvec,
// trellis_matvec): small operands as float32 copies, the outputs written back in their dtype.
#pragma once

#include <algorithm>
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

} // namespace mlx::core::operands
