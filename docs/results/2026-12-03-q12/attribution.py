"""Per-function attribution (calls, wall, thread user/sys, thread minor faults) on top of stage_time.
RUSAGE_THREAD: only the calling thread's work (MLX's stream thread and other pool threads not counted)."""
import os, resource, sys, threading, time, collections
sys.path.insert(0, os.path.join(os.getcwd(), "scripts"))
import stage_time
ACC = collections.defaultdict(lambda: [0, 0.0, 0.0, 0.0, 0])
LOCK = threading.Lock()
def wrap(mod, attr, label=None):
    fn = getattr(mod, attr)
    label = label or f"{mod.__name__.split('.')[-1]}.{attr}"
    def w(*a, **k):
        r0 = resource.getrusage(resource.RUSAGE_THREAD); t0 = time.perf_counter()
        try:
            return fn(*a, **k)
        finally:
            r1 = resource.getrusage(resource.RUSAGE_THREAD)
            who = "main" if threading.current_thread() is threading.main_thread() else "pool"
            with LOCK:
                e = ACC[(label, who)]
                e[0] += 1; e[1] += time.perf_counter() - t0; e[2] += r1.ru_utime - r0.ru_utime
                e[3] += r1.ru_stime - r0.ru_stime; e[4] += r1.ru_minflt - r0.ru_minflt
    setattr(mod, attr, w)
import mlx.core
from vqpipe import calibrate, gptq, qlinear, quantize, bitpack
wrap(calibrate, "collect"); wrap(calibrate, "gram")
wrap(qlinear, "_rotated_factors"); wrap(gptq, "ldl_factor"); wrap(gptq, "rotate_hessian")
wrap(qlinear, "_quantize_grouped"); wrap(qlinear, "_quantize_rows"); wrap(gptq, "gptq"); wrap(gptq, "refit_steps")
wrap(qlinear, "pack"); wrap(qlinear, "_squared_error"); wrap(quantize, "_sum_squares"); wrap(quantize, "_dense_weight")
def report():
    print("[attr] label who calls wall user sys minflt", file=sys.stderr)
    for (l, who), e in sorted(ACC.items(), key=lambda kv: -kv[1][4]):
        print(f"[attr] {l:<28} {who:<4} {e[0]:5d} {e[1]:8.2f} {e[2]:8.2f} {e[3]:7.2f} {e[4]:9d}", file=sys.stderr)
    for t in os.listdir("/proc/self/task"):
        with open(f"/proc/self/task/{t}/stat") as f:
            s = f.read(); name = s[s.index("(")+1:s.rindex(")")]; fl = s.rsplit(")", 1)[1].split()
        print(f"[task] {t} {name:<16} minflt {fl[7]:>9} utime {int(fl[11])/100:7.2f} stime {int(fl[12])/100:7.2f}", file=sys.stderr)
SAMPLES = []
def sampler():
    tick = os.sysconf("SC_CLK_TCK")
    while True:
        with open("/proc/self/stat") as f:
            fl = f.read().rsplit(")", 1)[1].split()
        SAMPLES.append((time.perf_counter() - stage_time.T0, (int(fl[11]) + int(fl[12])) / tick, int(fl[7])))
        time.sleep(1.0)
threading.Thread(target=sampler, daemon=True).start()
def busy():
    out = []
    for (t0, c0, f0), (t1, c1, f1) in zip(SAMPLES, SAMPLES[1:]):
        out.append(f"{t1:5.0f}:{(c1 - c0) / (t1 - t0):4.2f}")
    for i in range(0, len(out), 10):
        print("[busy] " + " ".join(out[i:i + 10]), file=sys.stderr)
orig = stage_time.report
stage_time.report = lambda: (orig(), report(), busy())
sys.exit(stage_time.main())
