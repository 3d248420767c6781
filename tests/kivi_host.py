"""Run the CUDA rendering of the KIVI decode-attention kernel on the CPU (g++), block by block.

Every thread of a block is a fiber (ucontext); the fibers run round-robin, one step to the next
synchronization point at a time: a shuffle is "every lane writes, yield, every lane reads, yield",
``__syncwarp``/``__syncthreads`` are counting barriers that yield at least once, so the lanes of a
warp stay in step. ``__shared__`` becomes ``static`` (blocks run one after another). Blocks run in
a shuffled order, so the last-block merge cannot rely on the launch order. A fiber that exits while
others still wait at a barrier (past the round that released them) fails the run. The scratch buffer starts as NaN, so a partial that was
never written shows. Types and conversions come from the quantizer kernels' shim
(tests/test_kivi_kernels.py).
"""

import shutil
import subprocess
from pathlib import Path

import mlx.core as mx
import numpy as np

from vqpipe.kivi import decode_kernel

_SHIM = r"""
#define __global__
#define __shared__ static
struct float4 { float x, y, z, w; };
static inline float4 make_float4(float a, float b, float c, float d) { return {a, b, c, d}; }
static inline float __int_as_float(int i) { float f; std::memcpy(&f, &i, 4); return f; }
template <typename U> static inline U __ldcg(const U* p) { return *p; }
static inline unsigned int atomicAdd(unsigned int* p, unsigned int v) { unsigned int o = *p; *p = o + v; return o; }
static inline unsigned int atomicExch(unsigned int* p, unsigned int v) { unsigned int o = *p; *p = v; return o; }
static inline void __threadfence() {}
static inline __half __ushort_as_half(unsigned short b) { __half h; h.b = b; return h; }
struct Dim3 { unsigned int x, y; };
static Dim3 blockIdx, gridDim, threadIdx;
static ucontext_t g_main, g_ctx[256];
static int g_cur, g_nt, g_done[256];
static float g_xchg[256];
static unsigned int g_wcount[8], g_wgen[8], g_bcount, g_bgen;
static long g_syncs;
static inline void ka_yield() { swapcontext(&g_ctx[g_cur], &g_main); }
static inline float __shfl_sync(unsigned int, float v, unsigned int src) {
  const int me = g_cur;
  g_xchg[me] = v;
  ka_yield();
  const float r = g_xchg[(me & ~31) | (int)(src & 31u)];
  ka_yield();
  ++g_syncs;
  return r;
}
static int g_vote[256];
static inline int __any_sync(unsigned int, int p) {
  const int me = g_cur;
  g_vote[me] = p;
  ka_yield();
  int r = 0;
  for (int l = me & ~31; l < (me & ~31) + 32; ++l) r |= g_vote[l];
  ka_yield();
  ++g_syncs;
  return r;
}
static inline float __shfl_xor_sync(unsigned int, float v, unsigned int m) {
  return __shfl_sync(0xffffffffu, v, (unsigned int)((g_cur & 31) ^ (int)m));
}
static inline void ka_wait(unsigned int* count, unsigned int* gen, unsigned int n) {
  const unsigned int my = *gen;
  if (++*count == n) { *count = 0; ++*gen; }
  do { ka_yield(); } while (*gen == my);
  ++g_syncs;
}
static inline void __syncwarp() { ka_wait(&g_wcount[g_cur / 32], &g_wgen[g_cur / 32], 32); }
static inline void __syncthreads() { ka_wait(&g_bcount, &g_bgen, (unsigned int)g_nt); }
"""

_MAIN = r"""
template <typename T>
static std::vector<T> readv(FILE* f, size_t n) {
  std::vector<T> v(n ? n : 1);
  if (n && fread(v.data(), sizeof(T), n, f) != n) { fprintf(stderr, "short input\n"); exit(2); }
  return v;
}
static void (*g_entry)();
static void fiber_main() { g_entry(); g_done[g_cur] = 1; }
static char g_stacks[256][1 << 16];

// argv: B H NGC W G SC NGV RC D R NW nsplit NSP seed in out SCALE_BITS
template <typename T, int BITS, int G, int D, int R, int NW, int PF>
static int run(char** argv) {
  int a[13];
  for (int i = 0; i < 13; ++i) a[i] = atoi(argv[7 + i]);
  const int B = a[0], H = a[1], NGC = a[2], W = a[3], SC = a[5], NGV = a[6], RC = a[7], NS = a[11], NSM = a[12];
  unsigned int seed = (unsigned int)atoi(argv[20]);
  const int HQ = H * R;
  static int kc_shape[5], vc_shape[4], rk_shape[4], scratch_shape[3];
  SCALE_BITS = atoi(argv[23]);
  scratch_shape[0] = B * H; scratch_shape[1] = NSM; scratch_shape[2] = R * (D + 2);
  kc_shape[0] = B; kc_shape[1] = H; kc_shape[2] = NGC; kc_shape[3] = W; kc_shape[4] = G;
  vc_shape[0] = B; vc_shape[1] = H; vc_shape[2] = SC; vc_shape[3] = W;
  rk_shape[0] = B; rk_shape[1] = H; rk_shape[2] = RC; rk_shape[3] = D;
  FILE* f = fopen(argv[21], "rb");
  static std::vector<T> q, rk, rv, out;
  static std::vector<unsigned int> kc, vc, counters;
  static std::vector<__half> kp, vp;
  static std::vector<float> meta, scratch;
  q = readv<T>(f, (size_t)B * HQ * D);
  kc = readv<unsigned int>(f, (size_t)B * H * NGC * W * G);
  kp = readv<__half>(f, (size_t)B * H * NGC * D * 2);
  vc = readv<unsigned int>(f, (size_t)B * H * SC * W);
  vp = readv<__half>(f, (size_t)B * H * SC * NGV * 2);
  rk = readv<T>(f, (size_t)B * H * RC * D);
  rv = readv<T>(f, (size_t)B * H * RC * D);
  meta = readv<float>(f, 2);
  fclose(f);
  scratch.assign((size_t)B * H * NSM * R * (D + 2), NAN);
  counters.assign((size_t)B * H, 0u);
  out.assign((size_t)B * HQ * D, T(NAN));
  g_entry = [] {
    const T* qp = q.data(); const unsigned int* kcp = kc.data(); const __half* kpp = kp.data();
    const unsigned int* vcp = vc.data(); const __half* vpp = vp.data(); const T* rkp = rk.data();
    const T* rvp = rv.data(); const float* metap = meta.data(); const float* scp = scratch.data();
    const unsigned int* cnp = counters.data(); T* outp = out.data();
    body<T, BITS, G, D, R, NW, PF>(qp, kcp, kpp, vcp, vpp, rkp, rvp, metap, scp, cnp, outp, kc_shape, vc_shape, rk_shape, scratch_shape);
  };
  // every block, in an order shuffled by the seed
  std::vector<unsigned int> order;
  for (int y = 0; y < B * H; ++y) for (int x = 0; x < NS; ++x) order.push_back((unsigned int)(y * NS + x));
  for (size_t i = order.size(); i > 1; --i) { seed = seed * 1103515245u + 12345u; std::swap(order[i - 1], order[seed % i]); }
  gridDim.x = (unsigned int)NS; gridDim.y = (unsigned int)(B * H);
  const int nt = NW * 32;
  g_nt = nt;
  for (unsigned int blk : order) {
    blockIdx.x = blk % NS; blockIdx.y = blk / NS;
    for (int l = 0; l < nt; ++l) {
      getcontext(&g_ctx[l]);
      g_ctx[l].uc_stack.ss_sp = g_stacks[l];
      g_ctx[l].uc_stack.ss_size = sizeof(g_stacks[l]);
      g_ctx[l].uc_link = &g_main;
      makecontext(&g_ctx[l], fiber_main, 0);
      g_done[l] = 0;
    }
    for (long round = 0, stale = 0;; ++round) {
      for (int l = 0; l < nt; ++l) {
        if (g_done[l]) continue;
        g_cur = l;
        threadIdx.x = (unsigned int)l;
        swapcontext(&g_main, &g_ctx[l]);
      }
      int done = 0;
      for (int l = 0; l < nt; ++l) done += g_done[l];
      if (done == nt) break;
      // a released barrier lets the rest finish within two rounds; past that, some threads left
      // while others still synchronize
      stale = done ? stale + 1 : 0;
      if (stale > 2 || round > 50000000) { fprintf(stderr, "threads exited while others wait (block %u)\n", blk); return 3; }
    }
  }
  f = fopen(argv[22], "wb");
  fwrite(out.data(), sizeof(T), out.size(), f);
  fwrite(counters.data(), sizeof(unsigned int), counters.size(), f);
  fclose(f);
  printf("syncs %ld\n", g_syncs);
  return 0;
}

int main(int argc, char** argv) {
  if (argc != 25) return 1;
  const int dt = atoi(argv[1]), bits = atoi(argv[2]), g = atoi(argv[3]), d = atoi(argv[4]), r = atoi(argv[5]), nw = atoi(argv[6]);
  const int pf = atoi(argv[24]);
#define C(DT, TY, B_, G_, D_, R_, NW_, PF_) \
  if (dt == DT && bits == B_ && g == G_ && d == D_ && r == R_ && nw == NW_ && pf == PF_) return run<TY, B_, G_, D_, R_, NW_, PF_>(argv);
  HOST_COMBOS
  fprintf(stderr, "combination not compiled\n");
  return 1;
}
"""

DTYPES = {"float16": (0, "__half", np.uint16), "bfloat16": (1, "__nv_bfloat16", np.uint16), "float32": (2, "float", np.uint32)}


def _types_shim():
    from test_kivi_kernels import _HOST_SHIM

    return _HOST_SHIM.split("struct Dim3")[0]  # includes, half/bf16 types, conversions, _rn ops


def build(directory, combos, version=None):
    """Compile the kernel (``version``, decode_kernel.VERSIONS, default the current one) for
    ``combos`` [(dtype, bits, G, D, R, NW, PF)] (PF: v3's loads ahead, 0 or 1, unused by the others);
    the executable's path, or None without a C++ compiler."""
    cxx = shutil.which("g++") or shutil.which("clang++")
    if cxx is None:
        return None
    d = Path(directory)
    _, header, body = decode_kernel.render("cuda", version, "small")
    fn = (
        "static int SCALE_BITS;  // a template argument on the GPU, set from argv here\n"
        "template <typename T, int BITS, int G, int D, int R, int NW, int PF>\n"
        "static void body(const T* q, const unsigned int* kc, const __half* kp, const unsigned int* vc,\n"
        "    const __half* vp, const T* rk, const T* rv, const float* meta, const float* scratch,\n"
        "    const unsigned int* counters, T* out, const int* kc_shape, const int* vc_shape, const int* rk_shape,\n"
        "    const int* scratch_shape) {\n"
        + body
        + "\n}\n"
    )
    combos_src = " ".join(f"C({DTYPES[dt][0]}, {DTYPES[dt][1]}, {b}, {g}, {dd}, {r}, {nw}, {pf})" for dt, b, g, dd, r, nw, pf in combos)
    src = _types_shim() + _SHIM + header + fn + _MAIN.replace("HOST_COMBOS", combos_src)
    (d / "attn.cpp").write_text(src)
    # -O0: a third of -O1's compile time here (23 s -> 8 s at load 8), the same run time (fiber
    # switches dominate it) and byte-identical outputs on every HOST_CASE (2026-12-01)
    r = subprocess.run(
        [cxx, "-std=c++17", "-O0", "-w", "attn.cpp", "-o", "attn"], cwd=d, capture_output=True, text=True
    )
    if r.returncode:
        raise RuntimeError(r.stderr[-4000:])
    return d / "attn"


def _raw(a):
    a = mx.contiguous(a)
    view = {1: mx.uint8, 2: mx.uint16, 4: mx.uint32}[a.dtype.size]
    return np.array(a.view(view)).tobytes()


def run(exe, queries, cache, scale, splits, warps, seed=1, ahead=0):
    """(output [B, Hq, 1, D] as an MLX array of the cache dtype, counters after the run)."""
    inputs, spec, _ = decode_kernel.launch_args(queries, cache, scale, splits, warps, "small", ahead=ahead)
    q, kc, kp, vc, vp, rk, rv, meta = inputs[:8]
    b, h, ngc, w, g = kc.shape
    d, r = rk.shape[3], queries.shape[1] // h
    dt = str(rk.dtype).split(".")[-1]
    ns = spec["grid"][0] // (warps * 32)
    work = Path(exe).parent
    with open(work / "in.bin", "wb") as f:
        for a in (q, kc, kp, vc, vp, rk, rv, meta):
            f.write(_raw(a))
    args = [DTYPES[dt][0], cache.kv_bits, g, d, r, warps, b, h, ngc, w, g, vc.shape[2], vp.shape[3], rk.shape[2], d, r, warps, ns,
            inputs[8].shape[1], seed, "in.bin", "out.bin", dict(spec["template"])["SCALE_BITS"], ahead]
    res = subprocess.run([str(exe), *map(str, args)], cwd=work, capture_output=True, text=True, timeout=600)
    if res.returncode:
        raise RuntimeError(res.stderr)
    raw = np.fromfile(work / "out.bin", np.uint8)
    n = b * h * r * d * rk.dtype.size
    out = mx.array(raw[:n].view(DTYPES[dt][2])).view(rk.dtype).reshape(b, h * r, 1, d)
    return out, raw[n:].view(np.uint32)
