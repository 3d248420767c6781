// What the extension's CUDA kernels share (matvec.cu, trellis.cu): float conversions of the input
// dtypes, the dtype dispatch of a launch, and each kernel's driver handle for MLX's encoder.
#pragma once

#include <cuda.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <stdexcept>
#include <string>

#include "mlx/dtype.h"

namespace mlx::core::cuda_util {

__device__ inline float to_float(float v) { return v; }
__device__ inline float to_float(__half v) { return __half2float(v); }
__device__ inline float to_float(__nv_bfloat16 v) { return __bfloat162float(v); }

template <typename T>
__device__ inline T from_float(float v);
template <>
__device__ inline float from_float<float>(float v) { return v; }
template <>
__device__ inline __half from_float<__half>(float v) { return __float2half(v); }
template <>
__device__ inline __nv_bfloat16 from_float<__nv_bfloat16>(float v) { return __float2bfloat16(v); }

// f(T{}) for x's dtype: float16, bfloat16, else float32.
template <typename F>
void dispatch_dtype(Dtype t, F&& f) {
  switch (t) {
    case float16: return f(__half{});
    case bfloat16: return f(__nv_bfloat16{});
    default: return f(float{});
  }
}

// MLX links its own copy of the CUDA runtime, which does not know the kernels registered with this
// module's (cudaGraphAddKernelNode: invalid resource handle): the encoder gets the driver's handle
// of each kernel instead, looked up once (experiments/cuda_ext, docs/results/2026-12-06-h100-cuda-ext).
template <auto Kernel>
CUfunction driver_function() {
  static CUfunction fn = [] {
    cudaFunction_t f;
    if (cudaGetFuncBySymbol(&f, reinterpret_cast<const void*>(Kernel)) != cudaSuccess) {
      throw std::runtime_error("vqpipe._ext: cudaGetFuncBySymbol failed");
    }
    return reinterpret_cast<CUfunction>(f);
  }();
  return fn;
}

} // namespace mlx::core::cuda_util
