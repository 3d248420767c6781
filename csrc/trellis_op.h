// trellis_matvec: the mat-vec of a bitshift-trellis weight from its rotated input, as one MLX
// primitive that decodes the codes on the fly (no dense weight). CPU (trellis.cpp) and, in a CUDA
// build, GPU (trellis.cu).
#pragma once

#include <optional>

#include "mlx/ops.h"
#include "mlx/primitives.h"

namespace mlx::core {

// x [..., cols] (float32/float16/bfloat16), packed uint32 [rows / 32, cols / 8 * 8k] (tile (rb, cb)
// of 32 rows x 8 columns, column-major inside, at row rb, words cb*8k..), scales [rows] (per row,
// applied to the output), the code's state bits L and affine map (a, b) (trellis.h), bias [rows]
// -> [..., rows] in x's dtype.
array trellis_matvec(
    const array& x,
    const array& packed,
    const array& scales,
    int k,
    int L,
    float a,
    float b,
    const std::optional<array>& bias,
    StreamOrDevice s = {});

// The code values [rows, cols] of a trellis weight (no scales) in `dtype`, decoded from `packed` as
// trellis_matvec reads it: the dense weight of a prefill, written once, without the uint32
// temporaries of a decode in MLX ops (16 bytes a weight). CPU and, in a CUDA build, GPU.
array trellis_decode(
    const array& packed,
    int k,
    int L,
    float a,
    float b,
    int cols,
    Dtype dtype,
    StreamOrDevice s = {});

// Whether this build has the CUDA kernel (the same build flag as codebook_matvec's).
bool trellis_matvec_has_gpu();

class TrellisMatvec : public UnaryPrimitive {
 public:
  TrellisMatvec(Stream stream, int k, int L, float a, float b, bool has_bias)
      : UnaryPrimitive(stream), k_(k), L_(L), a_(a), b_(b), has_bias_(has_bias) {}

  void eval_cpu(const std::vector<array>& inputs, array& out) override;
  void eval_gpu(const std::vector<array>& inputs, array& out) override;

  const char* name() const override {
    return "TrellisMatvec";
  }
  bool is_equivalent(const Primitive& other) const override;
  std::vector<Shape> output_shapes(const std::vector<array>& inputs) override;

 private:
  int k_, L_;
  float a_, b_;
  bool has_bias_;
};

class TrellisDecode : public UnaryPrimitive {
 public:
  TrellisDecode(Stream stream, int k, int L, float a, float b, int cols)
      : UnaryPrimitive(stream), k_(k), L_(L), a_(a), b_(b), cols_(cols) {}

  void eval_cpu(const std::vector<array>& inputs, array& out) override;
  void eval_gpu(const std::vector<array>& inputs, array& out) override;

  const char* name() const override {
    return "TrellisDecode";
  }
  bool is_equivalent(const Primitive& other) const override;
  std::vector<Shape> output_shapes(const std::vector<array>& inputs) override;

 private:
  int k_, L_;
  float a_, b_;
  int cols_;
};

} // namespace mlx::core
