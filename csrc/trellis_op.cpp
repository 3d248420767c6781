#include "trellis_op.h"

#include <algorithm>
#include <stdexcept>
#include <string>
#include <vector>

#include "mlx/allocator.h"
#include "mlx/backend/cpu/encoder.h"

#include "pool.h"
#include "trellis.h"

namespace mlx::core {

namespace {

// Below this many weights a call runs on one thread (waking the pool costs more).
constexpr size_t kSerialWeights = 1 << 17;

[[noreturn]] void fail(const std::string& msg) {
  throw std::invalid_argument("trellis_matvec: " + msg);
}

std::string shape_str(const Shape& s) {
  std::string out = "(";
  for (size_t i = 0; i < s.size(); ++i) out += (i ? ", " : "") + std::to_string(s[i]);
  return out + (s.size() == 1 ? ",)" : ")");
}

bool is_float(Dtype t) {
  return t == float32 || t == float16 || t == bfloat16;
}

int log2_exact(size_t n) {
  int L = 0;
  while ((size_t{1} << L) < n) ++L;
  return (size_t{1} << L) == n ? L : -1;
}

} // namespace

array trellis_matvec(
    const array& x,
    const array& packed,
    const array& scales,
    const array& table,
    int k,
    const std::optional<array>& bias,
    StreamOrDevice s) {
  if (k < 1 || k > 6) fail("k must be 1..6 bits per weight, got " + std::to_string(k));
  if (!is_float(x.dtype())) fail("x must be float32, float16 or bfloat16");
  if (x.ndim() < 1 || x.shape(-1) < 1) fail("x must have a non-empty last dimension");
  const int cols = x.shape(-1);
  if (cols % vqpipe::kTileCols) {
    fail("x has " + std::to_string(cols) + " columns: a trellis weight's columns are a multiple of " +
         std::to_string(vqpipe::kTileCols) + " (x shape " + shape_str(x.shape()) + ")");
  }
  const int L = log2_exact(table.size());
  if (table.dtype() != float32 || table.ndim() != 1 || L < k || L > 16) {
    fail("table must be float32 [2^L] with k <= L <= 16, got " + shape_str(table.shape()));
  }
  const int words = cols / vqpipe::kTileCols * 8 * k;
  if (packed.dtype() != uint32 || packed.ndim() != 2 || packed.shape(0) < 1 || packed.shape(1) != words) {
    fail("packed must be uint32 [rows / 32, " + std::to_string(words) + "] for " + std::to_string(cols) +
         " columns at k = " + std::to_string(k) + ", got " + shape_str(packed.shape()));
  }
  const int rows = packed.shape(0) * vqpipe::kTileRows;
  if (scales.shape() != Shape{rows} || !is_float(scales.dtype())) {
    fail("scales must be float of shape (" + std::to_string(rows) + ",) (32 rows per tile row of packed), got " +
         shape_str(scales.shape()));
  }
  if (bias && (bias->shape() != Shape{rows} || !is_float(bias->dtype()))) {
    fail("bias must be float of shape (" + std::to_string(rows) + ",), got " + shape_str(bias->shape()));
  }
  auto stream = to_stream(s);
  if (stream.device != Device::cpu) fail("CPU only (no GPU kernel yet)");
  // the kernel reads row-major float32 operands; these are no-ops where they already are
  auto f32 = [&](const array& a) { return contiguous(astype(a, float32, stream), false, stream); };
  std::vector<array> inputs = {f32(x), contiguous(packed, false, stream), f32(scales), f32(table)};
  if (bias) inputs.push_back(f32(*bias));
  Shape shape = x.shape();
  shape.back() = rows;
  auto y = array(std::move(shape), float32, std::make_shared<TrellisMatvec>(stream, k, L, bias.has_value()),
                 std::move(inputs));
  return x.dtype() == float32 ? y : astype(y, x.dtype(), stream);
}

std::vector<Shape> TrellisMatvec::output_shapes(const std::vector<array>& inputs) {
  Shape shape = inputs[0].shape();
  shape.back() = inputs[1].shape(0) * vqpipe::kTileRows;
  return {shape};
}

bool TrellisMatvec::is_equivalent(const Primitive& other) const {
  auto& o = static_cast<const TrellisMatvec&>(other);
  return k_ == o.k_ && L_ == o.L_ && has_bias_ == o.has_bias_;
}

void TrellisMatvec::eval_cpu(const std::vector<array>& inputs, array& out) {
  out.set_data(allocator::malloc(out.nbytes()));
  auto& encoder = cpu::get_command_encoder(stream());
  for (auto& a : inputs) encoder.set_input_array(a);
  encoder.set_output_array(out);
  encoder.dispatch([x = array::unsafe_weak_copy(inputs[0]),
                    packed = array::unsafe_weak_copy(inputs[1]),
                    scales = array::unsafe_weak_copy(inputs[2]),
                    table = array::unsafe_weak_copy(inputs[3]),
                    bias = has_bias_ ? std::optional<array>(array::unsafe_weak_copy(inputs[4])) : std::nullopt,
                    out = array::unsafe_weak_copy(out),
                    k = k_,
                    L = L_]() mutable {
    const int window = vqpipe::trellis_window(L, k);
    std::vector<float> by_window(size_t{1} << window);
    vqpipe::trellis_window_table(table.data<float>(), L, k, by_window.data());
    vqpipe::TrellisArgs a{};
    a.packed = packed.data<uint32_t>();
    a.x = x.data<float>();
    a.table = by_window.data();
    a.row_scales = scales.data<float>();
    a.bias = bias ? bias->data<float>() : nullptr;
    a.y = out.data<float>();
    a.k = k;
    a.window = window;
    a.cols = x.shape(-1);
    a.m = static_cast<int>(x.size() / a.cols);
    a.rows = packed.shape(0) * vqpipe::kTileRows;
    const int blocks = packed.shape(0);
    auto& pool = vqpipe::Pool::get();
    const size_t work = static_cast<size_t>(a.rows) * a.cols * std::max(1, a.m / 4);
    // a few tasks per thread: a thread that starts late (a busy machine) leaves its share to the others
    const int tasks = work < kSerialWeights ? 1 : std::min(4 * pool.size(), blocks);
    pool.run(tasks, [&](int t) {
      const int b0 = static_cast<int>(static_cast<long long>(blocks) * t / tasks);
      const int b1 = static_cast<int>(static_cast<long long>(blocks) * (t + 1) / tasks);
      vqpipe::trellis_matvec_blocks(a, b0, b1);
    });
  });
}

void TrellisMatvec::eval_gpu(const std::vector<array>&, array&) {
  throw std::runtime_error("trellis_matvec: no GPU kernel yet (CPU only)");
}

} // namespace mlx::core
