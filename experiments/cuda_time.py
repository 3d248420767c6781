"""GPU time of a CUDA kernel source, outside MLX: NVRTC + the driver API through ctypes, CUDA events.

bench-qmv times a layer call through MLX, where each custom-kernel call also costs host time
(MLX rebuilds and hashes the source per call) that can hide the kernel's own time. This module
compiles the same source MLX would compile (the wrapper of mlx/backend/cuda/custom_kernel.cpp,
with a small prelude instead of MLX's device headers: the kernel body uses only the Shape type and
the float types), launches it on device buffers and times a run of launches between two CUDA
events. Nothing here needs MLX.

Used by experiments/qmv_gpu_time.py; NVRTC and the CUDA headers are found by vqpipe/kernels/nvrtc.py
(NVIDIA's Python packages, site-packages/nvidia/cu13, or the toolkit), libcuda comes from the driver.
"""

import ctypes

from vqpipe.kernels import nvrtc

MAX_NDIM = 10  # mlx/backend/cuda/device/config.h: Shape is an array of MAX_NDIM int32
CTYPES = {"float32": "float", "float16": "__half", "bfloat16": "__nv_bfloat16", "uint32": "uint32_t",
          "int32": "int32_t"}
PRELUDE = """
#include <cuda_fp16.h>
#include <cuda_bf16.h>
typedef unsigned int uint32_t;
typedef int int32_t;
struct Shape { int32_t v[%d]; __device__ int32_t operator[](int i) const { return v[i]; } };
""" % MAX_NDIM


def kernel_source(name, header, body, inputs, outputs, template):
    """MLX's generated source for one instantiation. ``inputs``: [(name, dtype, ndim)], the body's
    use of NAME_shape / NAME_ndim decides the extra parameters as in MLX; ``outputs``: [(name,
    dtype)]; ``template``: [(name, int | dtype string)]."""
    params = []
    for n, dt, ndim in inputs:
        params.append(f"const {CTYPES[dt]}* {n}")
        if ndim > 0 and f"{n}_shape" in body:
            params.append(f"const __grid_constant__ Shape {n}_shape")
        if ndim > 0 and f"{n}_ndim" in body:
            params.append(f"const __grid_constant__ int {n}_ndim")
    params += [f"{CTYPES[dt]}* {n}" for n, dt in outputs]
    consts = "".join(f"  constexpr int {k} = {v};\n" if isinstance(v, int) else f"  using {k} = {CTYPES[v]};\n"
                     for k, v in template)
    return (PRELUDE + header + f'extern "C" __global__ void {name}(\n    ' + ",\n    ".join(params) + ") {\n"
            + consts + body + "\n}\n")


def compile_cubin(source, arch="sm_90a", extra=()):
    """(cubin bytes, log) of ``source`` for ``arch`` (vqpipe/kernels/nvrtc.py) with the option MLX's JIT
    adds (``--device-as-default-execution-space``, mlx/backend/cuda/jit_module.cpp)."""
    return nvrtc.cubin(source, arch, ("--device-as-default-execution-space", *extra))


def _ok(res, what):
    if res != 0:
        raise RuntimeError(f"{what} failed with code {res}")


class Driver:
    """The few driver calls the timing needs, on device 0's primary context."""

    def __init__(self):
        self.cu = cu = ctypes.CDLL("libcuda.so.1")
        _ok(cu.cuInit(0), "cuInit")
        dev = ctypes.c_int()
        _ok(cu.cuDeviceGet(ctypes.byref(dev), 0), "cuDeviceGet")
        self.ctx = ctypes.c_void_p()
        _ok(cu.cuDevicePrimaryCtxRetain(ctypes.byref(self.ctx), dev), "cuDevicePrimaryCtxRetain")
        _ok(cu.cuCtxSetCurrent(self.ctx), "cuCtxSetCurrent")
        name = ctypes.create_string_buffer(256)
        cu.cuDeviceGetName(name, 256, dev)
        self.name = name.value.decode()
        sms = ctypes.c_int()
        cu.cuDeviceGetAttribute(ctypes.byref(sms), 16, dev)  # CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT
        self.sms = sms.value
        cu.cuMemAlloc_v2.argtypes = [ctypes.POINTER(ctypes.c_uint64), ctypes.c_size_t]
        cu.cuMemcpyHtoD_v2.argtypes = [ctypes.c_uint64, ctypes.c_void_p, ctypes.c_size_t]
        cu.cuMemcpyDtoH_v2.argtypes = [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_size_t]
        cu.cuMemcpyDtoDAsync_v2.argtypes = [ctypes.c_uint64, ctypes.c_uint64, ctypes.c_size_t, ctypes.c_void_p]
        cu.cuMemFree_v2.argtypes = [ctypes.c_uint64]
        cu.cuLaunchKernel.argtypes = [ctypes.c_void_p] + [ctypes.c_uint] * 6 + [ctypes.c_uint, ctypes.c_void_p,
                                                                                ctypes.c_void_p, ctypes.c_void_p]

    def alloc(self, nbytes):
        ptr = ctypes.c_uint64()
        _ok(self.cu.cuMemAlloc_v2(ctypes.byref(ptr), max(int(nbytes), 16)), "cuMemAlloc")
        return ptr.value

    def free(self, ptr):
        self.cu.cuMemFree_v2(ptr)

    def upload(self, array):
        ptr = self.alloc(array.nbytes)
        _ok(self.cu.cuMemcpyHtoD_v2(ptr, array.ctypes.data, array.nbytes), "cuMemcpyHtoD")
        return ptr

    def download(self, ptr, array):
        _ok(self.cu.cuMemcpyDtoH_v2(array.ctypes.data, ptr, array.nbytes), "cuMemcpyDtoH")
        return array

    def load(self, cubin, name):
        mod, fn = ctypes.c_void_p(), ctypes.c_void_p()
        _ok(self.cu.cuModuleLoadData(ctypes.byref(mod), cubin), "cuModuleLoadData")
        _ok(self.cu.cuModuleGetFunction(ctypes.byref(fn), mod, name.encode()), "cuModuleGetFunction")
        regs = ctypes.c_int()
        self.cu.cuFuncGetAttribute(ctypes.byref(regs), 4, fn)  # CU_FUNC_ATTRIBUTE_NUM_REGS
        return fn, regs.value

    @staticmethod
    def params(args):
        """The kernelParams array for a list of ctypes values (returned with them: keep both alive)."""
        return (ctypes.c_void_p * len(args))(*[ctypes.cast(ctypes.pointer(a), ctypes.c_void_p) for a in args]), args

    def launch(self, fn, grid, block, args):
        """``args``: a list of ctypes values, or what :meth:`params` returned (cheaper per launch)."""
        ptrs = args[0] if isinstance(args, tuple) else self.params(args)[0]
        _ok(self.cu.cuLaunchKernel(fn, *grid, *block, 0, None, ptrs, None), "cuLaunchKernel")

    def sync(self):
        _ok(self.cu.cuCtxSynchronize(), "cuCtxSynchronize")

    def event(self):
        ev = ctypes.c_void_p()
        _ok(self.cu.cuEventCreate(ctypes.byref(ev), 0), "cuEventCreate")
        return ev

    def elapsed(self, run, busy=None):
        """Seconds of GPU time between two events around ``run()`` (which only enqueues work). With
        ``busy`` (a function enqueueing a long kernel), the GPU works on that while the host enqueues
        ``run``'s launches, so host launch overhead cannot leave gaps between them."""
        a, b = self.event(), self.event()
        if busy is not None:
            busy()
        self.cu.cuEventRecord(a, None)
        run()
        self.cu.cuEventRecord(b, None)
        _ok(self.cu.cuEventSynchronize(b), "cuEventSynchronize")
        ms = ctypes.c_float()
        self.cu.cuEventElapsedTime(ctypes.byref(ms), a, b)
        self.cu.cuEventDestroy_v2(a)
        self.cu.cuEventDestroy_v2(b)
        return ms.value / 1e3

    def copy(self, dst, src, nbytes):
        _ok(self.cu.cuMemcpyDtoDAsync_v2(dst, src, nbytes, None), "cuMemcpyDtoDAsync")


def shape_arg(shape):
    """A Shape kernel parameter (by value)."""
    vals = list(shape) + [0] * (MAX_NDIM - len(shape))
    return (ctypes.c_int32 * MAX_NDIM)(*vals)
