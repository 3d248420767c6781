// codebook_matvec: the mat-vec of a vqpipe QuantizedLinear from its rotated input, as one MLX
// primitive that reads the packed codes once (no dense weight).
#pragma once

#include <optional>

#include "mlx/ops.h"
#include "mlx/primitives.h"

namespace mlx::core {

// x [..., in] (float32/float16/bfloat16), packed uint32 [out, bits * ceil(in / 32)], scales
// float32 [out] (per row, applied to the output) or float16/float32 [out, in / group_size]
// (per group of rotated inputs), codebook float32 [2^bits], bias [out] -> [..., out] in x's dtype.
array codebook_matvec(
    const array& x,
    const array& packed,
    const array& scales,
    const array& codebook,
    int bits,
    int group_size,
    const std::optional<array>& bias,
    StreamOrDevice s = {});

class CodebookMatvec : public UnaryPrimitive {
 public:
  CodebookMatvec(Stream stream, int bits, int group_size, bool has_bias)
      : UnaryPrimitive(stream), bits_(bits), group_size_(group_size), has_bias_(has_bias) {}

  void eval_cpu(const std::vector<array>& inputs, array& out) override;
  void eval_gpu(const std::vector<array>& inputs, array& out) override;

  std::vector<array> jvp(
      const std::vector<array>& primals,
      const std::vector<array>& tangents,
      const std::vector<int>& argnums) override;
  std::vector<array> vjp(
      const std::vector<array>& primals,
      const std::vector<array>& cotangents,
      const std::vector<int>& argnums,
      const std::vector<array>& outputs) override;

  const char* name() const override {
    return "CodebookMatvec";
  }
  bool is_equivalent(const Primitive& other) const override;
  std::vector<Shape> output_shapes(const std::vector<array>& inputs) override;

  int bits() const { return bits_; }
  int group_size() const { return group_size_; }
  bool has_bias() const { return has_bias_; }

 private:
  int bits_;
  int group_size_; // 0: per-row scales
  bool has_bias_;
};

// Whether eval_gpu has a kernel in this build (CUDA).
bool codebook_matvec_has_gpu();

} // namespace mlx::core
