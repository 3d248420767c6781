// eval_gpu of CodebookMatvec for a CUDA build of MLX: one warp per output row, each lane a 32-value
// block of the row at a time (16-byte loads of the codes at 4 and 8 bits, 32-bit loads at the
// straddling widths), float32 accumulation, a warp-shuffle sum. Correct first; vqpipe's decode on
// a GPU goes through vqpipe/qmv.py, not here.
#include <cuda.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include "mlx/allocator.h"
#include "mlx/backend/cuda/device.h"
#include "mlx/backend/cuda/utils.h"

#include "cuda_util.cuh"
#include "primitive.h"

namespace mlx::core {

namespace {

using namespace cuda_util;

constexpr int kMaxM = 8; // rows of x per block (grid.y covers the rest)
constexpr int kWarps = 4; // warps (rows) per block

// The block's `B` words into w[0..B) (16-byte loads where the block is whole 16-byte units).
template <int B>
__device__ inline void load_block(const uint32_t* p, uint32_t* w) {
  if constexpr (B == 4 || B == 8) {
#pragma unroll
    for (int i = 0; i < B; i += 4) {
      const uint4 v = *reinterpret_cast<const uint4*>(p + i);
      w[i] = v.x, w[i + 1] = v.y, w[i + 2] = v.z, w[i + 3] = v.w;
    }
  } else {
#pragma unroll
    for (int i = 0; i < B; ++i) w[i] = p[i];
  }
}

// x, y: T; scales: ST (float per row, or half/float per group); bias float32 (the op casts it);
// block (b, z) takes rows kMaxM z .. kMaxM z + kMaxM - 1 of x: every row in one launch (one graph
// node, ordered by MLX's encoder after the inputs' producers and before y's readers).
template <typename T, typename ST, int B>
__global__ void codebook_matvec_kernel(
    const T* x, const uint32_t* packed, const ST* scales, const float* codebook, const float* bias, T* y,
    int rows, int in, int ldx, int group_size, int m_total) {
  const int m0 = blockIdx.y * kMaxM, mc = min(kMaxM, m_total - m0);
  __shared__ float cb[1 << B];
  for (int i = threadIdx.x + threadIdx.y * 32; i < (1 << B); i += 32 * kWarps) cb[i] = codebook[i];
  __syncthreads();
  const int row = blockIdx.x * kWarps + threadIdx.y, lane = threadIdx.x;
  if (row >= rows) return;
  const int blocks = (in + 31) / 32;
  const int groups = group_size ? in / group_size : 0;
  const uint32_t* p = packed + static_cast<size_t>(row) * B * blocks;
  float acc[kMaxM];
#pragma unroll
  for (int m = 0; m < kMaxM; ++m) acc[m] = 0.0f;
  for (int k = lane; k < blocks; k += 32) {
    uint32_t w[B];
    load_block<B>(p + static_cast<size_t>(k) * B, w);
#pragma unroll
    for (int j = 0; j < 32; ++j) {
      const int i = k * 32 + j;
      if (i >= in) break;
      const int bit = j * B, word = bit >> 5, shift = bit & 31;
      uint32_t q = w[word] >> shift;
      if (shift + B > 32) q |= w[word + 1] << (32 - shift);
      float v = cb[q & ((1u << B) - 1)];
      if (group_size) v *= to_float(scales[static_cast<size_t>(row) * groups + i / group_size]);
#pragma unroll
      for (int m = 0; m < kMaxM; ++m) {
        if (m < mc) acc[m] += v * to_float(x[static_cast<size_t>(m0 + m) * ldx + i]);
      }
    }
  }
#pragma unroll
  for (int m = 0; m < kMaxM; ++m) {
    if (m >= mc) break;
    float s = acc[m];
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffff, s, o);
    if (lane == 0) {
      if (!group_size) s *= to_float(scales[row]);
      if (bias) s += bias[row];
      y[static_cast<size_t>(m0 + m) * rows + row] = from_float<T>(s);
    }
  }
}

template <typename F>
void dispatch_bits(int bits, F&& f) {
  switch (bits) {
    case 2: return f(std::integral_constant<int, 2>{});
    case 3: return f(std::integral_constant<int, 3>{});
    case 4: return f(std::integral_constant<int, 4>{});
    case 5: return f(std::integral_constant<int, 5>{});
    case 6: return f(std::integral_constant<int, 6>{});
    default: return f(std::integral_constant<int, 8>{});
  }
}

} // namespace

bool codebook_matvec_has_gpu() {
  return true;
}

void CodebookMatvec::eval_gpu(const std::vector<array>& inputs, array& out) {
  const array &x = inputs[0], &packed = inputs[1], &scales = inputs[2], &codebook = inputs[3];
  for (const array& a : inputs) {
    if (!a.flags().row_contiguous) {
      throw std::runtime_error("codebook_matvec: the GPU kernel takes row-contiguous inputs");
    }
  }
  auto& encoder = cu::get_command_encoder(stream());
  out.set_data(allocator::malloc(out.nbytes()));
  for (const array& a : inputs) encoder.set_input_array(a);
  encoder.set_output_array(out);
  const int in = x.shape(-1), rows = packed.shape(0), m = static_cast<int>(x.size() / in);
  const int group_size = group_size_;
  const dim3 grid((rows + kWarps - 1) / kWarps, (m + kMaxM - 1) / kMaxM), block(32, kWarps);
  dispatch_dtype(x.dtype(), [&](auto t) {
    using T = decltype(t);
    dispatch_bits(bits_, [&](auto b) {
      constexpr int B = decltype(b)::value;
      auto launch = [&](auto st) {
        using ST = decltype(st);
        // add_kernel_node takes the addresses of its arguments: plain mutable locals
        int n_rows = rows, n_in = in, ldx = in, gs = group_size, n_m = m;
        encoder.add_kernel_node(
            driver_function<codebook_matvec_kernel<T, ST, B>>(), grid, block,
            gpu_ptr<T>(x), gpu_ptr<uint32_t>(packed), gpu_ptr<ST>(scales), gpu_ptr<float>(codebook),
            has_bias_ ? gpu_ptr<float>(inputs[4]) : static_cast<const float*>(nullptr), gpu_ptr<T>(out),
            n_rows, n_in, ldx, gs, n_m);
      };
      if (scales.dtype() == float16) {
        launch(__half{});
      } else {
        launch(float{});
      }
    });
  });
}

} // namespace mlx::core
