#include <nanobind/nanobind.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/variant.h>

#include "kernel.h"
#include "matvec.h"
#include "pool.h"

namespace nb = nanobind;
using namespace nb::literals;
using namespace mlx::core;

NB_MODULE(_ext, m) {
  m.doc() = "vqpipe's compiled MLX primitives";
  m.def(
      "codebook_matvec",
      &codebook_matvec,
      "x"_a,
      "packed"_a,
      "scales"_a,
      "codebook"_a,
      "bits"_a,
      "group_size"_a = 0,
      "bias"_a = nb::none(),
      nb::kw_only(),
      "stream"_a = nb::none(),
      "y[..., o] = s_o * (C[q_o] @ x) + b_o from the rotated input x and the packed codes "
      "(group_size > 0: scales [out, in / group_size] over the rotated index), in x's dtype.");
  m.def("has_avx2", &vqpipe::has_avx2, "Whether the CPU kernel uses AVX2/FMA here.");
  m.def("set_portable", &vqpipe::set_portable, "flag"_a,
        "Take the portable kernel even where AVX2 or NEON is there (tests); returns the previous setting.");
  m.def("has_neon", &vqpipe::has_neon, "Whether the CPU kernel uses NEON here (arm64).");
  m.def("threads", [] { return vqpipe::Pool::get().size(); }, "Threads of the CPU kernel's pool.");
  m.def("has_gpu", &codebook_matvec_has_gpu, "Whether this build has a GPU (CUDA) kernel.");
}
