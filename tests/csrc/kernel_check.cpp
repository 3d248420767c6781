// The CPU mat-vec's SIMD kernel (AVX2 on x86-64, NEON on arm64) against its portable kernel on
// random codes: every width, 1..12 rows of x, per-row and group scales (float32 and float16,
// groups of 32 and of 16), bias. Built and run by tests/test_ext.py (under qemu-aarch64 for NEON).
// Prints one line per failing case and exits 1 if any; else "ok SIMD CASES".
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <vector>

#include "kernel.h"
#include "mlx/types/half_types.h"

using vqpipe::MatvecArgs;

static uint64_t state = 12345;
static uint32_t next_u32() {
  state = state * 6364136223846793005ull + 1442695040888963407ull;
  return static_cast<uint32_t>(state >> 32);
}
static float next_f() { return (next_u32() >> 8) * (1.0f / 16777216.0f) * 2.0f - 1.0f; }

static int check(int bits, int m, int rows, int in, int group, bool half, bool row_scales, bool bias) {
  const int padded = (in + 31) / 32 * 32, words = bits * padded / 32;
  std::vector<uint32_t> packed(static_cast<size_t>(rows) * words);
  for (auto& w : packed) w = next_u32();
  std::vector<float> x(static_cast<size_t>(m) * padded, 0.0f), cb(1 << bits), rs(rows), b(rows);
  for (int i = 0; i < m; ++i)
    for (int j = 0; j < in; ++j) x[static_cast<size_t>(i) * padded + j] = next_f();
  for (auto& v : cb) v = next_f();
  for (auto& v : rs) v = next_f();
  for (auto& v : b) v = next_f();
  const int groups = group ? in / group : 0;
  std::vector<float> gs(static_cast<size_t>(rows) * (groups ? groups : 1));
  std::vector<mlx::core::float16_t> gh(gs.size());
  for (size_t i = 0; i < gs.size(); ++i) {
    gh[i] = static_cast<mlx::core::float16_t>(next_f());
    gs[i] = static_cast<float>(gh[i]);
  }
  std::vector<float> y0(static_cast<size_t>(m) * rows), y1(y0.size());
  MatvecArgs a{packed.data(), x.data(), cb.data(), row_scales ? rs.data() : nullptr,
               group ? (half ? static_cast<const void*>(gh.data()) : gs.data()) : nullptr, half,
               bias ? b.data() : nullptr, y0.data(), bits, m, rows, in, padded, group ? group : 0};
  const bool was = vqpipe::set_portable(true);
  vqpipe::matvec_rows(a, 0, rows);
  vqpipe::set_portable(false);
  a.y = y1.data();
  vqpipe::matvec_rows(a, 0, rows);
  vqpipe::set_portable(was);
  for (size_t i = 0; i < y0.size(); ++i) {
    if (std::fabs(y0[i] - y1[i]) > 1e-4f * (1.0f + std::fabs(y0[i]))) {
      std::printf("bits %d m %d rows %d in %d group %d half %d: y[%zu] %g (portable) vs %g\n", bits, m, rows, in,
                  group, half, i, y0[i], y1[i]);
      return 1;
    }
  }
  return 0;
}

int main() {
  const char* simd = vqpipe::has_avx2() ? "avx2" : vqpipe::has_neon() ? "neon" : "none";
  int failed = 0, cases = 0;
  for (int bits : {2, 3, 4, 5, 6, 8}) {
    for (int m = 1; m <= 12; ++m) {
      failed += check(bits, m, 37, 96, 0, false, true, m % 2), ++cases;
      failed += check(bits, m, 19, 200, 0, false, true, true), ++cases; // in not a multiple of 32
    }
    for (int group : {32, 16, 64}) {
      for (bool half : {false, true}) {
        failed += check(bits, 3, 21, 128, group, half, false, true), ++cases;
        failed += check(bits, 1, 21, 192, group, half, false, false), ++cases;
      }
    }
  }
  if (failed) return 1;
  std::printf("ok %s %d\n", simd, cases);
  return 0;
}
