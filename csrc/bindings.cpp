#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/variant.h>

#include <cmath>
#include <stdexcept>
#include <string>

#include "kernel.h"
#include "matvec.h"
#include "pool.h"
#include "trellis.h"
#include "trellis_op.h"

namespace nb = nanobind;
using namespace nb::literals;
using namespace mlx::core;

namespace {

using Floats2 = nb::ndarray<const float, nb::ndim<2>, nb::c_contig, nb::device::cpu>;
using Floats1 = nb::ndarray<const float, nb::ndim<1>, nb::c_contig, nb::device::cpu>;
using States = nb::ndarray<nb::numpy, int32_t, nb::ndim<2>>;

// numpy in, numpy out (the quantizer's side is numpy); sequences split over the pool, GIL released.
States viterbi(Floats2 x, Floats1 table, int k, int threads) {
  const size_t n = x.shape(0), T = x.shape(1);
  int L = 0;
  while ((size_t{1} << L) < table.shape(0)) ++L;
  if ((size_t{1} << L) != table.shape(0) || k < 1 || k > 8 || L < k || L > 16) {
    throw std::invalid_argument("trellis_viterbi: table must have 2^L entries, 1 <= k <= 8, k <= L <= 16; got " +
                                std::to_string(table.shape(0)) + " entries, k = " + std::to_string(k));
  }
  const float* xs = x.data();
  for (size_t i = 0; i < n * T; ++i) {
    if (!std::isfinite(xs[i])) throw std::invalid_argument("trellis_viterbi: x has a non-finite value");
  }
  auto* out = new int32_t[n * T];
  nb::capsule owner(out, [](void* p) noexcept { delete[] static_cast<int32_t*>(p); });
  {
    nb::gil_scoped_release release;
    auto& pool = vqpipe::Pool::get();
    const int th = threads > 0 ? std::min(threads, pool.size()) : pool.size();
    const int tasks = static_cast<int>(std::min<size_t>(n, 8 * th));
    auto run = [&](int t) {
      vqpipe::trellis_viterbi(xs, n * t / tasks, n * (t + 1) / tasks, static_cast<int>(T), L, k, table.data(), out);
    };
    if (th == 1) {
      for (int t = 0; t < tasks; ++t) run(t);
    } else {
      pool.run(tasks, run);
    }
  }
  return States(out, {n, T}, owner);
}

} // namespace

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
  m.def("trellis_viterbi", &viterbi, "x"_a, "table"_a, "k"_a, "threads"_a = 0,
        "States int32 [n, T] of the least-squares bitshift-trellis path of each row of x (float32 "
        "[n, T], finite) from state 0, k bits a step, L = log2(len(table)): exactly "
        "vqpipe.codec.trellis's reference. threads: 0 = the pool's all.");
  m.def(
      "trellis_matvec",
      &trellis_matvec,
      "x"_a,
      "packed"_a,
      "scales"_a,
      "k"_a,
      "L"_a,
      "a"_a,
      "b"_a,
      "bias"_a = nb::none(),
      nb::kw_only(),
      "stream"_a = nb::none(),
      "y[..., r] = s_r * sum_c code(state_rc) x[..., c] + bias_r from the rotated input x and the "
      "trellis codes (tiles of 32 rows x 8 columns, vqpipe.codec.trellis), code(s) = fma(a, 1MAD "
      "byte sum of s, b) over L-bit states; in x's dtype; CPU, and GPU in a CUDA build.");
  m.def(
      "trellis_decode",
      &trellis_decode,
      "packed"_a,
      "k"_a,
      "L"_a,
      "a"_a,
      "b"_a,
      "cols"_a,
      "dtype"_a,
      nb::kw_only(),
      "stream"_a = nb::none(),
      "The code values [rows, cols] (no scales) of a trellis weight in dtype, code(s) = fma(a, 1MAD byte "
      "sum of s, b): trellis_matvec's weight, decoded once (prefill's dense path); CPU, and GPU in a "
      "CUDA build.");
  m.def("has_avx2", &vqpipe::has_avx2, "Whether the CPU kernel uses AVX2/FMA here.");
  m.def("set_portable", &vqpipe::set_portable, "flag"_a,
        "Take the portable kernel even where AVX2 or NEON is there (tests); returns the previous setting.");
  m.def("has_neon", &vqpipe::has_neon, "Whether the CPU kernel uses NEON here (arm64).");
  m.def("threads", [] { return vqpipe::Pool::get().size(); }, "Threads of the CPU kernel's pool.");
  m.def("has_gpu", &codebook_matvec_has_gpu, "Whether this build has a GPU (CUDA) kernel.");
}
