#pragma once
#include "mlx/primitives.h"
#include "mlx/utils.h"

namespace vq {
// y = x + 1 for float32 x, as one primitive: a stand-in for any kernel, to time a launch.
mlx::core::array add_one(const mlx::core::array& x, mlx::core::StreamOrDevice s = {});

class AddOne : public mlx::core::UnaryPrimitive {
 public:
  explicit AddOne(mlx::core::Stream s) : mlx::core::UnaryPrimitive(s) {}
  void eval_cpu(const std::vector<mlx::core::array>& in, mlx::core::array& out) override;
  // add_one_gpu.cu (nvcc cannot parse mlx/ops.h, so the GPU side lives in its own file)
  void eval_gpu(const std::vector<mlx::core::array>& in, mlx::core::array& out) override;
  const char* name() const override { return "AddOne"; }
  bool is_equivalent(const mlx::core::Primitive&) const override { return true; }
};
}  // namespace vq
