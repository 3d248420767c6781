import time, resource, numpy as np, mlx.core as mx, sys
sys.path.insert(0, sys.argv[1])
from vqpipe.prefault import hold_freed_heap, large_blocks_on_heap
hold_freed_heap()
from vqpipe import gptq
rng = np.random.default_rng(0)
x = rng.standard_normal((1024, 4864), dtype=np.float32)
h = x.T @ x
def cpu(): r = resource.getrusage(resource.RUSAGE_SELF); return r.ru_utime + r.ru_stime
T = {}
def t(name, f):
    c = cpu(); w = time.perf_counter(); r = f(); T.setdefault(name, []).append((time.perf_counter() - w, cpu() - c)); return r
with large_blocks_on_heap():
  for rep in range(4):
    t("gram syrk", lambda: x.T @ x)
    hh = t("np.array copy", lambda: np.array(h, dtype=np.float32))
    a = hh
    t("diag/mean", lambda: mx.mean(mx.array(np.where(a.diagonal() <= 0, np.float32(0), a.diagonal()))).item())
    rev = t("rev copy", lambda: np.ascontiguousarray(a[::-1, ::-1]))
    t("fill_diag", lambda: np.fill_diagonal(rev, rev.diagonal() + 1))
    m = t("mx.array(rev)", lambda: mx.array(rev))
    low = t("cholesky", lambda: (lambda l: (mx.eval(l), l)[1])(mx.linalg.cholesky(m, stream=mx.cpu)))
    low = np.asarray(low)
    piv = low.diagonal()[::-1].copy()
    n = t("divide rev", lambda: np.divide(low[::-1, ::-1], piv[None, :], out=np.empty((4864, 4864), np.float32)))
    t("fill0", lambda: np.fill_diagonal(n, 0))
    t("isfinite all", lambda: np.isfinite(n).all())
    t("min/max", lambda: (np.isfinite(n.min()), np.isfinite(n.max())))
    t("damp diag h", lambda: np.fill_diagonal(hh, hh.diagonal() + np.float32(0.01 * float(np.mean(np.diag(hh))))))
    t("ldl_factor total", lambda: gptq.ldl_factor(h))
    del hh, a, rev, m, low, n
for k, v in T.items():
    v = v[1:]
    print(f"{k:<18} wall {np.median([a for a, b in v]):.4f} cpu {np.median([b for a, b in v]):.4f}")
