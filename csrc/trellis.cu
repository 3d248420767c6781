// eval_gpu of TrellisMatvec for a CUDA build of MLX: the bitshift-trellis mat-vec (trellis.h) with
// each weight's 1MAD value computed in registers from its L-bit state, never a dense weight.
//
// A block owns one row block (32 rows); its warps take chunks of kChunk consecutive tiles of it in
// turn. A warp copies a chunk's words to shared memory (coalesced), then lane l decodes weights
// 8l..8l+7 of each tile (column l / 4, rows 8(l % 4)..+7): one 64-bit window of the stream holds
// the n = ceil(L / k) steps before its first weight and its eight own, so the states run in
// sequence from there. Sums: over the lanes of one row group by shuffles, over the warps through
// shared memory, in a fixed order (repeated launches give the same bits).
#include <cuda.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include "mlx/allocator.h"
#include "mlx/backend/cuda/device.h"
#include "mlx/backend/cuda/utils.h"

#include "cuda_util.cuh"
#include "trellis.h"
#include "trellis_op.h"

namespace mlx::core {

namespace {

using namespace cuda_util;

constexpr int kMaxM = 8; // rows of x per block (grid.y covers the rest)
constexpr int kWarps = 8; // warps per block (one row block)
constexpr int kChunk = 4; // tiles a warp decodes per pass

// 1MAD: the four bytes of the LCG's output summed (dp4a with ones), one fused multiply-add;
// the same rounding as trellis_code on the CPU.
__device__ inline float code(uint32_t s, float a, float b) {
  const uint32_t h = s * vqpipe::kLcgMul + vqpipe::kLcgAdd;
  return fmaf(a, static_cast<float>(__dp4a(h, 0x01010101u, 0u)), b);
}

// Lane l's window of a tile's stream ``tw`` (its 8K words and two zero words after them): the
// n - 1 steps before the lane's first weight 8l (zeros before the tile) and its eight own, lowest
// first. Returns the window after those n - 1 steps, with ``s`` the state they leave.
template <int K>
__device__ inline uint64_t lane_window(const uint32_t* tw, int lane, int n, uint32_t mask, uint32_t& s) {
  constexpr uint32_t kmask = (1u << K) - 1u;
  const int first = 8 * lane - (n - 1);
  const int p0 = first < 0 ? 0 : K * first, pad = first < 0 ? -K * first : 0;
  const int wi = p0 >> 5, sh = p0 & 31;
  const uint64_t lo = static_cast<uint64_t>(tw[wi]) | (static_cast<uint64_t>(tw[wi + 1]) << 32);
  uint64_t win = sh ? (lo >> sh) | (static_cast<uint64_t>(tw[wi + 2]) << (64 - sh)) : lo;
  win <<= pad;
  s = 0;
  for (int j = 0; j < n - 1; ++j) s = ((s << K) | static_cast<uint32_t>((win >> (K * j)) & kmask)) & mask;
  return win >> (K * (n - 1));
}

// x [m, cols] (T), packed [rows / 32, tiles * 8K] uint32, scales and bias float32 [rows],
// y [m, rows] (T). Block (rb, z) takes rows 8z .. 8z + 7 of x (all m rows in one launch: one graph
// node, so MLX's encoder orders it after the inputs' producers and before y's readers). n = ceil(L / K).
template <typename T, int K>
__global__ void __launch_bounds__(32 * kWarps) trellis_matvec_kernel(
    const T* x, const uint32_t* packed, const float* scales, const float* bias, T* y, int rows, int cols,
    int L, int n, float ca, float cb, int m_total) {
  constexpr int W = 8 * K; // words per tile
  __shared__ uint32_t words[kWarps][kChunk * W + 2];
  __shared__ float part[kWarps][kMaxM][32];
  const int warp = threadIdx.y, lane = threadIdx.x, rb = blockIdx.x;
  const int m0 = blockIdx.y * kMaxM, mc = ::min(kMaxM, m_total - m0);
  const int tiles = cols / vqpipe::kTileCols;
  const uint32_t mask = (1u << L) - 1u, kmask = (1u << K) - 1u;
  const uint32_t* base = packed + static_cast<size_t>(rb) * tiles * W;
  const int col_in_tile = lane >> 2;
  float acc[kMaxM][8];
#pragma unroll
  for (int m = 0; m < kMaxM; ++m)
#pragma unroll
    for (int r = 0; r < 8; ++r) acc[m][r] = 0.0f;
  if (lane < 2) words[warp][kChunk * W + lane] = 0u;
  for (int c0 = warp * kChunk; c0 < tiles; c0 += kWarps * kChunk) {
    const int nt = ::min(kChunk, tiles - c0);
    __syncwarp();
    for (int i = lane; i < nt * W; i += 32) words[warp][i] = base[static_cast<size_t>(c0) * W + i];
    __syncwarp();
    for (int t = 0; t < nt; ++t) {
      uint32_t s;
      const uint64_t win = lane_window<K>(words[warp] + t * W, lane, n, mask, s);
      const int col = (c0 + t) * vqpipe::kTileCols + col_in_tile;
      float xv[kMaxM];
#pragma unroll
      for (int m = 0; m < kMaxM; ++m) xv[m] = m < mc ? to_float(x[static_cast<size_t>(m0 + m) * cols + col]) : 0.0f;
#pragma unroll
      for (int r = 0; r < 8; ++r) {
        s = ((s << K) | static_cast<uint32_t>((win >> (K * r)) & kmask)) & mask;
        const float v = code(s, ca, cb);
#pragma unroll
        for (int m = 0; m < kMaxM; ++m) acc[m][r] = fmaf(v, xv[m], acc[m][r]);
      }
    }
  }
  // lanes l, l ^ 4, l ^ 8, l ^ 16 hold the same rows: their sums end in lanes 0..3
#pragma unroll
  for (int m = 0; m < kMaxM; ++m) {
#pragma unroll
    for (int r = 0; r < 8; ++r) {
      float v = acc[m][r];
      v += __shfl_xor_sync(0xffffffffu, v, 4);
      v += __shfl_xor_sync(0xffffffffu, v, 8);
      v += __shfl_xor_sync(0xffffffffu, v, 16);
      if (lane < 4) part[warp][m][8 * lane + r] = v;
    }
  }
  __syncthreads();
  const int tid = warp * 32 + lane;
  if (tid < 32 * mc) {
    const int m = tid >> 5, r = tid & 31, row = rb * vqpipe::kTileRows + r;
    float v = 0.0f;
    for (int w = 0; w < kWarps; ++w) v += part[w][m][r];
    v *= scales[row];
    if (bias) v += bias[row];
    y[static_cast<size_t>(m0 + m) * rows + row] = from_float<T>(v);
  }
}

// The code values of tiles into out [rows, cols] (T): one warp a tile, lane l its weights 8l..8l+7
// (column l / 4, rows 8(l % 4)..+7) from the same 64-bit window as the mat-vec's lanes.
template <typename T, int K>
__global__ void __launch_bounds__(32 * kWarps) trellis_decode_kernel(
    const uint32_t* packed, T* out, int cols, int L, int n, float ca, float cb, int tiles_total) {
  constexpr int W = 8 * K; // words per tile
  __shared__ uint32_t words[kWarps][W + 2];
  const int warp = threadIdx.y, lane = threadIdx.x;
  const int tile = blockIdx.x * kWarps + warp;
  if (tile >= tiles_total) return; // a whole warp: nothing below synchronises more than the warp
  const int tiles = cols / vqpipe::kTileCols, rb = tile / tiles, ct = tile - rb * tiles;
  const uint32_t mask = (1u << L) - 1u, kmask = (1u << K) - 1u;
  const uint32_t* base = packed + static_cast<size_t>(tile) * W;
  for (int i = lane; i < W; i += 32) words[warp][i] = base[i];
  if (lane < 2) words[warp][W + lane] = 0u;
  __syncwarp();
  uint32_t s;
  const uint64_t win = lane_window<K>(words[warp], lane, n, mask, s);
  const int col = ct * vqpipe::kTileCols + (lane >> 2), row0 = rb * vqpipe::kTileRows + 8 * (lane & 3);
#pragma unroll
  for (int r = 0; r < 8; ++r) {
    s = ((s << K) | static_cast<uint32_t>((win >> (K * r)) & kmask)) & mask;
    out[static_cast<size_t>(row0 + r) * cols + col] = from_float<T>(code(s, ca, cb));
  }
}

template <typename F>
void dispatch_k(int k, F&& f) {
  switch (k) {
    case 1: return f(std::integral_constant<int, 1>{});
    case 2: return f(std::integral_constant<int, 2>{});
    case 3: return f(std::integral_constant<int, 3>{});
    case 4: return f(std::integral_constant<int, 4>{});
    case 5: return f(std::integral_constant<int, 5>{});
    default: return f(std::integral_constant<int, 6>{});
  }
}

} // namespace

bool trellis_matvec_has_gpu() {
  return true;
}

void TrellisMatvec::eval_gpu(const std::vector<array>& inputs, array& out) {
  const array &x = inputs[0], &packed = inputs[1], &scales = inputs[2];
  for (const array& a : inputs) {
    if (!a.flags().row_contiguous) {
      throw std::runtime_error("trellis_matvec: the GPU kernel takes row-contiguous inputs");
    }
  }
  if (scales.dtype() != float32 || (has_bias_ && inputs[3].dtype() != float32)) {
    throw std::runtime_error("trellis_matvec: the GPU kernel takes float32 scales and bias");
  }
  auto& encoder = cu::get_command_encoder(stream());
  out.set_data(allocator::malloc(out.nbytes()));
  for (const array& a : inputs) encoder.set_input_array(a);
  encoder.set_output_array(out);
  const int cols = x.shape(-1), rows = packed.shape(0) * vqpipe::kTileRows, m = static_cast<int>(x.size() / cols);
  const int steps = (L_ + k_ - 1) / k_;
  const dim3 grid(packed.shape(0), (m + kMaxM - 1) / kMaxM), block(32, kWarps);
  dispatch_dtype(x.dtype(), [&](auto t) {
    using T = decltype(t);
    dispatch_k(k_, [&](auto kk) {
      constexpr int K = decltype(kk)::value;
      // add_kernel_node takes the addresses of its arguments: plain mutable locals
      int n_rows = rows, n_cols = cols, L = L_, n = steps, n_m = m;
      float ca = a_, cb = b_;
      encoder.add_kernel_node(
          driver_function<trellis_matvec_kernel<T, K>>(), grid, block, gpu_ptr<T>(x),
          gpu_ptr<uint32_t>(packed), gpu_ptr<float>(scales),
          has_bias_ ? gpu_ptr<float>(inputs[3]) : static_cast<const float*>(nullptr), gpu_ptr<T>(out), n_rows,
          n_cols, L, n, ca, cb, n_m);
    });
  });
}

void TrellisDecode::eval_gpu(const std::vector<array>& inputs, array& out) {
  const array& packed = inputs[0];
  if (!packed.flags().row_contiguous) {
    throw std::runtime_error("trellis_decode: the GPU kernel takes row-contiguous codes");
  }
  auto& encoder = cu::get_command_encoder(stream());
  out.set_data(allocator::malloc(out.nbytes()));
  encoder.set_input_array(packed);
  encoder.set_output_array(out);
  const int tiles_total = packed.shape(0) * (cols_ / vqpipe::kTileCols);
  const dim3 grid((tiles_total + kWarps - 1) / kWarps), block(32, kWarps);
  dispatch_dtype(out.dtype(), [&](auto t) {
    using T = decltype(t);
    dispatch_k(k_, [&](auto kk) {
      constexpr int K = decltype(kk)::value;
      int n_cols = cols_, L = L_, n = (L_ + k_ - 1) / k_, n_tiles = tiles_total;
      float ca = a_, cb = b_;
      encoder.add_kernel_node(driver_function<trellis_decode_kernel<T, K>>(), grid, block,
                              gpu_ptr<uint32_t>(packed), gpu_ptr<T>(out), n_cols, L, n, ca, cb, n_tiles);
    });
  });
}

} // namespace mlx::core
