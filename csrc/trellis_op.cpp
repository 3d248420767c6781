#include "trellis_op.h"

#include <algorithm>
#include <stdexcept>
#include <string>
#include <vector>

#include "mlx/allocator.h"
#include "mlx/backend/cpu/encoder.h"

#include "operands.h"
#include "pool.h"
#include "trellis.h"

namespace mlx::core {

using namespace operands;

namespace {

// Below this many weights a call runs on one thread (waking the pool costs more).
constexpr size_t kSerialWeights = 1 << 17;

[[noreturn]] void fail(const std::string& msg) {
  operands::fail("trellis_matvec", msg);
}

// Row blocks [b0, b1) of the code values into out [rows, cols] (row-major): each tile's states in
// sequence from 0, values from a table of the code in T (the same rounding as a float32 table cast).
template <typename T>
void decode_blocks(const uint32_t* packed, int k, int L, float a, float b, int cols, T* out, int b0, int b1) {
  const int words = 8 * k, tiles = cols / vqpipe::kTileCols, n = vqpipe::kTileRows * vqpipe::kTileCols;
  const uint32_t mask = (1u << L) - 1;
  std::vector<T> table(size_t{1} << L);
  for (uint32_t t = 0; t <= mask; ++t) table[t] = static_cast<T>(vqpipe::trellis_code(t, a, b));
  for (int rb = b0; rb < b1; ++rb) {
    T* block = out + static_cast<size_t>(rb) * vqpipe::kTileRows * cols;
    for (int cb = 0; cb < tiles; ++cb) {
      const uint32_t* tile = packed + (static_cast<size_t>(rb) * tiles + cb) * words;
      uint32_t s = 0;
      for (int i = 0; i < n; ++i) {
        s = vqpipe::next_state(tile, i, k, s, mask);
        block[static_cast<size_t>(i % vqpipe::kTileRows) * cols + cb * vqpipe::kTileCols + i / vqpipe::kTileRows] =
            table[s];
      }
    }
  }
}

[[noreturn]] void fail_decode(const std::string& msg) {
  operands::fail("trellis_decode", msg);
}

} // namespace

array trellis_decode(const array& packed, int k, int L, float a, float b, int cols, Dtype dtype, StreamOrDevice s) {
  if (k < 1 || k > 6) fail_decode("k must be 1..6 bits per weight, got " + std::to_string(k));
  if (L < k || L > 16) fail_decode("the state needs k <= L <= 16 bits, got L = " + std::to_string(L));
  if (!is_float(dtype)) fail_decode("dtype must be float32, float16 or bfloat16");
  if (cols < 1 || cols % vqpipe::kTileCols) {
    fail_decode("cols must be a positive multiple of " + std::to_string(vqpipe::kTileCols) + ", got " +
                std::to_string(cols));
  }
  const int words = cols / vqpipe::kTileCols * 8 * k;
  if (packed.dtype() != uint32 || packed.ndim() != 2 || packed.shape(0) < 1 || packed.shape(1) != words) {
    fail_decode("packed must be uint32 [rows / 32, " + std::to_string(words) + "] for " + std::to_string(cols) +
                " columns at k = " + std::to_string(k) + ", got " + shape_str(packed.shape()));
  }
  auto stream = to_stream(s);
  if (stream.device != Device::cpu && !trellis_matvec_has_gpu()) {
    fail_decode("this build of vqpipe._ext has no GPU kernel (built against a CPU-only MLX)");
  }
  return array({packed.shape(0) * vqpipe::kTileRows, cols}, dtype,
               std::make_shared<TrellisDecode>(stream, k, L, a, b, cols), {packed});
}

std::vector<Shape> TrellisDecode::output_shapes(const std::vector<array>& inputs) {
  return {{inputs[0].shape(0) * vqpipe::kTileRows, cols_}};
}

bool TrellisDecode::is_equivalent(const Primitive& other) const {
  auto& o = static_cast<const TrellisDecode&>(other);
  return k_ == o.k_ && L_ == o.L_ && a_ == o.a_ && b_ == o.b_ && cols_ == o.cols_;
}

void TrellisDecode::eval_cpu(const std::vector<array>& inputs, array& out) {
  out.set_data(allocator::malloc(out.nbytes()));
  auto& encoder = cpu::get_command_encoder(stream());
  encoder.set_input_array(inputs[0]);
  encoder.set_output_array(out);
  encoder.dispatch([packed = array::unsafe_weak_copy(inputs[0]), out = array::unsafe_weak_copy(out), k = k_, L = L_,
                    code_a = a_, code_b = b_, cols = cols_]() mutable {
    std::vector<uint32_t> packed_copy;
    const uint32_t* codes = row_major_codes(packed, packed_copy);
    const int blocks = packed.shape(0);
    auto& pool = vqpipe::Pool::get();
    const int tasks = static_cast<size_t>(blocks) * vqpipe::kTileRows * cols < kSerialWeights
                          ? 1
                          : std::min(4 * pool.size(), blocks);
    pool.run(tasks, [&](int t) {
      const int b0 = static_cast<int>(static_cast<long long>(blocks) * t / tasks);
      const int b1 = static_cast<int>(static_cast<long long>(blocks) * (t + 1) / tasks);
      switch (out.dtype()) {
        case float16: return decode_blocks(codes, k, L, code_a, code_b, cols, out.data<float16_t>(), b0, b1);
        case bfloat16: return decode_blocks(codes, k, L, code_a, code_b, cols, out.data<bfloat16_t>(), b0, b1);
        default: return decode_blocks(codes, k, L, code_a, code_b, cols, out.data<float>(), b0, b1);
      }
    });
  });
}

array trellis_matvec(
    const array& x,
    const array& packed,
    const array& scales,
    int k,
    int L,
    float a,
    float b,
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
  if (L < k || L > 16) fail("the state needs k <= L <= 16 bits, got L = " + std::to_string(L));
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
  std::vector<array> inputs = {x, packed, scales};
  if (bias) inputs.push_back(*bias);
  if (stream.device != Device::cpu) {
    if (!trellis_matvec_has_gpu()) fail("this build of vqpipe._ext has no GPU kernel (built against a CPU-only MLX)");
    // the GPU kernel reads float32 per-row operands (no cast where they are float32 already)
    for (size_t i = 2; i < inputs.size(); ++i) {
      if (inputs[i].dtype() != float32) inputs[i] = astype(inputs[i], float32, stream);
    }
  }
  Shape shape = x.shape();
  shape.back() = rows;
  return array(std::move(shape), x.dtype(), std::make_shared<TrellisMatvec>(stream, k, L, a, b, bias.has_value()),
               std::move(inputs));
}

std::vector<Shape> TrellisMatvec::output_shapes(const std::vector<array>& inputs) {
  Shape shape = inputs[0].shape();
  shape.back() = inputs[1].shape(0) * vqpipe::kTileRows;
  return {shape};
}

bool TrellisMatvec::is_equivalent(const Primitive& other) const {
  auto& o = static_cast<const TrellisMatvec&>(other);
  return k_ == o.k_ && L_ == o.L_ && a_ == o.a_ && b_ == o.b_ && has_bias_ == o.has_bias_;
}

void TrellisMatvec::eval_cpu(const std::vector<array>& inputs, array& out) {
  out.set_data(allocator::malloc(out.nbytes()));
  auto& encoder = cpu::get_command_encoder(stream());
  for (auto& a : inputs) encoder.set_input_array(a);
  encoder.set_output_array(out);
  encoder.dispatch([x = array::unsafe_weak_copy(inputs[0]),
                    packed = array::unsafe_weak_copy(inputs[1]),
                    scales = array::unsafe_weak_copy(inputs[2]),
                    bias = has_bias_ ? std::optional<array>(array::unsafe_weak_copy(inputs[3])) : std::nullopt,
                    out = array::unsafe_weak_copy(out),
                    k = k_,
                    L = L_,
                    code_a = a_,
                    code_b = b_]() mutable {
    const int cols = x.shape(-1), m = static_cast<int>(x.size() / cols);
    // x and the per-row operands as float32 copies (small); the codes in place unless strided
    std::vector<float> xf(x.size()), row_scales = floats(scales), bias_f;
    for (size_t i = 0; i < x.size(); ++i) xf[i] = read_float(x, i);
    if (bias) bias_f = floats(*bias);
    std::vector<uint32_t> packed_copy;
    const uint32_t* packed_ptr = row_major_codes(packed, packed_copy);
    const bool direct = out.dtype() == float32;
    std::vector<float> y;
    if (!direct) y.resize(out.size());
    vqpipe::TrellisArgs a{};
    a.packed = packed_ptr;
    a.x = xf.data();
    a.a = code_a;
    a.b = code_b;
    a.row_scales = row_scales.data();
    a.bias = bias ? bias_f.data() : nullptr;
    a.y = direct ? out.data<float>() : y.data();
    a.k = k;
    a.L = L;
    a.cols = cols;
    a.m = m;
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
    store_back(y, out);
  });
}

#ifndef VQPIPE_CUDA
void TrellisMatvec::eval_gpu(const std::vector<array>&, array&) {
  throw std::runtime_error("trellis_matvec: this build of vqpipe._ext has no GPU kernel (built against a CPU-only MLX)");
}

void TrellisDecode::eval_gpu(const std::vector<array>&, array&) {
  throw std::runtime_error("trellis_decode: this build of vqpipe._ext has no GPU kernel (built against a CPU-only MLX)");
}

bool trellis_matvec_has_gpu() {
  return false;
}
#endif

} // namespace mlx::core
