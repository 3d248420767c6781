#include "matvec.h"

#include <algorithm>
#include <stdexcept>
#include <vector>

#include "mlx/allocator.h"
#include "mlx/backend/cpu/encoder.h"

#include "kernel.h"
#include "operands.h"
#include "pool.h"

namespace mlx::core {

using namespace operands;

namespace {

constexpr int kWidths[] = {2, 3, 4, 5, 6, 8};
// Below this many packed words a call runs on one thread (waking the pool costs more).
constexpr size_t kSerialWords = 16384;

[[noreturn]] void fail(const std::string& msg) {
  operands::fail("codebook_matvec", msg);
}

} // namespace

array codebook_matvec(
    const array& x,
    const array& packed,
    const array& scales,
    const array& codebook,
    int bits,
    int group_size,
    const std::optional<array>& bias,
    StreamOrDevice s) {
  if (std::find(std::begin(kWidths), std::end(kWidths), bits) == std::end(kWidths)) {
    fail("bits must be one of 2, 3, 4, 5, 6, 8, got " + std::to_string(bits));
  }
  if (!is_float(x.dtype())) fail("x must be float32, float16 or bfloat16");
  if (x.ndim() < 1 || x.shape(-1) < 1) fail("x must have a non-empty last dimension");
  const int in = x.shape(-1);
  if (packed.dtype() != uint32 || packed.ndim() != 2) {
    fail("packed must be a 2-D uint32 array [out, words], got " + shape_str(packed.shape()));
  }
  const int out = packed.shape(0);
  const int words = (in + 31) / 32 * bits;
  if (out < 1) fail("packed has no rows");
  if (packed.shape(1) != words) {
    fail("packed has " + std::to_string(packed.shape(1)) + " words per row; " + std::to_string(in) +
         " input features at " + std::to_string(bits) + " bits need " + std::to_string(words));
  }
  if (codebook.dtype() != float32 || codebook.size() != (size_t{1} << bits)) {
    fail("codebook must be float32 with " + std::to_string(1 << bits) + " levels");
  }
  if (group_size < 0) fail("group_size must be >= 0 (0: per-row scales)");
  if (group_size == 0) {
    if (scales.shape() != Shape{out} || scales.dtype() != float32) {
      fail("per-row scales must be float32 of shape (" + std::to_string(out) + ",), got " +
           shape_str(scales.shape()));
    }
  } else {
    if (in % group_size) fail("group_size " + std::to_string(group_size) + " does not divide " + std::to_string(in));
    if (scales.shape() != Shape{out, in / group_size} || (scales.dtype() != float16 && scales.dtype() != float32)) {
      fail("group scales must be float16 or float32 of shape " + shape_str(Shape{out, in / group_size}) +
           ", got " + shape_str(scales.shape()));
    }
  }
  std::vector<array> inputs = {x, packed, scales, codebook};
  if (bias) {
    if (bias->shape() != Shape{out} || !is_float(bias->dtype())) {
      fail("bias must be float of shape (" + std::to_string(out) + ",), got " + shape_str(bias->shape()));
    }
    inputs.push_back(*bias);
  }
  auto stream = to_stream(s);
  if (stream.device == Device::gpu) {  // the CUDA kernel reads row-major operands, a float32 bias
    for (auto& a : inputs) a = contiguous(a, false, stream);
    if (bias) inputs[4] = astype(inputs[4], float32, stream);
  }
  Shape shape = x.shape();
  shape.back() = out;
  return array(
      std::move(shape),
      x.dtype(),
      std::make_shared<CodebookMatvec>(stream, bits, group_size, bias.has_value()),
      std::move(inputs));
}

std::vector<Shape> CodebookMatvec::output_shapes(const std::vector<array>& inputs) {
  Shape shape = inputs[0].shape();
  shape.back() = inputs[1].shape(0);
  return {shape};
}

bool CodebookMatvec::is_equivalent(const Primitive& other) const {
  auto& o = static_cast<const CodebookMatvec&>(other);
  return bits_ == o.bits_ && group_size_ == o.group_size_ && has_bias_ == o.has_bias_;
}

void CodebookMatvec::eval_cpu(const std::vector<array>& inputs, array& out) {
  out.set_data(allocator::malloc(out.nbytes()));
  auto& encoder = cpu::get_command_encoder(stream());
  for (auto& a : inputs) encoder.set_input_array(a);
  encoder.set_output_array(out);
  encoder.dispatch([x = array::unsafe_weak_copy(inputs[0]),
                    packed = array::unsafe_weak_copy(inputs[1]),
                    scales = array::unsafe_weak_copy(inputs[2]),
                    codebook = array::unsafe_weak_copy(inputs[3]),
                    bias = has_bias_ ? std::optional<array>(array::unsafe_weak_copy(inputs[4])) : std::nullopt,
                    out = array::unsafe_weak_copy(out),
                    bits = bits_,
                    group_size = group_size_]() mutable {
    const int in = x.shape(-1), rows = packed.shape(0);
    const int m = static_cast<int>(x.size() / in), padded = (in + 31) / 32 * 32;
    // x as float32 [m, padded], zero-padded: the kernel reads whole 32-value blocks
    std::vector<float> xf(static_cast<size_t>(m) * padded, 0.0f);
    for (int r = 0; r < m; ++r) {
      for (int i = 0; i < in; ++i) {
        xf[static_cast<size_t>(r) * padded + i] = read_float(x, static_cast<size_t>(r) * in + i);
      }
    }
    std::vector<uint32_t> packed_copy;
    const uint32_t* packed_ptr = row_major_codes(packed, packed_copy);
    std::vector<float> cb = floats(codebook), row_scales, bias_f, group_f;
    vqpipe::MatvecArgs a{};
    a.packed = packed_ptr;
    a.x = xf.data();
    a.codebook = cb.data();
    if (group_size == 0) {
      row_scales = floats(scales);
      a.row_scales = row_scales.data();
    } else if (scales.flags().row_contiguous) {
      a.group_scales = scales.data<void>();
      a.group_scales_half = scales.dtype() == float16;
    } else {
      group_f = floats(scales);
      a.group_scales = group_f.data();
    }
    if (bias) {
      bias_f = floats(*bias);
      a.bias = bias_f.data();
    }
    const bool direct = out.dtype() == float32;
    std::vector<float> y;
    if (!direct) y.resize(static_cast<size_t>(m) * rows);
    a.y = direct ? out.data<float>() : y.data();
    a.bits = bits;
    a.m = m;
    a.rows = rows;
    a.in_features = in;
    a.padded = padded;
    a.group_size = group_size;

    auto& pool = vqpipe::Pool::get();
    const size_t work = static_cast<size_t>(rows) * packed.shape(1) * (m > 8 ? 2 : 1);
    // a few tasks per thread: a thread that starts late (a busy machine) leaves its share to the others
    const int tasks = work < kSerialWords ? 1 : std::min(4 * pool.size(), std::max(1, rows / 16));
    pool.run(tasks, [&](int t) {
      const int r0 = static_cast<int>(static_cast<long long>(rows) * t / tasks);
      const int r1 = static_cast<int>(static_cast<long long>(rows) * (t + 1) / tasks);
      vqpipe::matvec_rows(a, r0, r1);
    });
    store_back(y, out);
  });
}

std::vector<array> CodebookMatvec::jvp(
    const std::vector<array>& primals,
    const std::vector<array>& tangents,
    const std::vector<int>& argnums) {
  // Linear in x: the tangent through the same weights, without the bias.
  if (argnums.size() != 1 || argnums[0] != 0) {
    throw std::invalid_argument("codebook_matvec: jvp is defined for x only (the codes are not differentiable)");
  }
  return {codebook_matvec(tangents[0], primals[1], primals[2], primals[3], bits_, group_size_, std::nullopt, stream())};
}

std::vector<array> CodebookMatvec::vjp(
    const std::vector<array>&,
    const std::vector<array>&,
    const std::vector<int>&,
    const std::vector<array>&) {
  throw std::invalid_argument(
      "codebook_matvec: no vjp (it needs the transposed mat-vec); differentiate through "
      "vqpipe.layers.qlinear.dense_forward instead");
}

#ifndef VQPIPE_CUDA
void CodebookMatvec::eval_gpu(const std::vector<array>&, array&) {
  throw std::runtime_error(
      "codebook_matvec: this build of vqpipe._ext has no GPU kernel (built against a CPU-only MLX)");
}

bool codebook_matvec_has_gpu() {
  return false;
}
#endif

} // namespace mlx::core
