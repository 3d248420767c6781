// The CodebookMatvec primitive (matvec.h has the op); apart so the CUDA source needs no mlx/ops.h.
#pragma once

#include "mlx/primitives.h"

namespace mlx::core {

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
