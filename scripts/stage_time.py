"""A timeline of one stage command: wall and CPU seconds (all threads) per phase of the process.

    python scripts/stage_time.py quantize --source DIR --out DIR --bits 4 ... --threads 2

Runs ``python -m vqpipe ARGS`` in this process exactly as the module does (vqpipe/__main__.py:
the BLAS check, hold_freed_heap, the stage's main), with timers wrapped around the quantize
stage's steps, and prints one line per step to stderr: start and end (s since the process started,
read from /proc), wall, CPU-s of the whole process meanwhile (user + sys, every thread, so work the
pool or a helper thread does beside a step is counted in it; its system time and minor page faults
apart), and at the end the interpreter's start-up (process start to this script's first line) and
the imports. Steps that nest (the layer loop inside quantize_model) are printed as they end. The
stage's output is what it would be without the timers. Use the pipeline's environment (``env $(python -m vqpipe.blas --env)``).
"""

import os
import resource
import sys
import time


def _since_start():
    """Seconds since this process started (/proc/self/stat starttime, clock ticks since boot)."""
    with open("/proc/self/stat") as f:
        start = int(f.read().rsplit(")", 1)[1].split()[19]) / os.sysconf("SC_CLK_TCK")
    with open("/proc/uptime") as f:
        return float(f.read().split()[0]) - start


T0 = time.perf_counter() - _since_start()  # perf_counter at process start (10 ms resolution)
C_START = resource.getrusage(resource.RUSAGE_SELF)
LINES = []


def cpu():
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def sys_cpu():
    return resource.getrusage(resource.RUSAGE_SELF).ru_stime


def faults():
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def mark(name, t_start, c_start, s_start=None, f_start=None):
    t = time.perf_counter()
    LINES.append((t_start - T0, t - T0, name, t - t_start, cpu() - c_start,
                  None if s_start is None else sys_cpu() - s_start,
                  None if f_start is None else faults() - f_start))


def timed(owner, attr, name=None):
    fn = getattr(owner, attr)

    def wrapper(*a, **k):
        t, c, s, f = time.perf_counter(), cpu(), sys_cpu(), faults()
        try:
            return fn(*a, **k)
        finally:
            mark(name or attr, t, c, s, f)

    setattr(owner, attr, wrapper)


def report():
    for start, end, name, wall, cpus, syss, flts in sorted(LINES):
        print(f"[timeline] {start:7.2f} {end:7.2f}  {name:<34} wall {wall:7.2f}  cpu {cpus:7.2f}"
              + ("" if syss is None else f" (sys {syss:6.2f}, minor faults {flts:8d})"), file=sys.stderr)
    r = resource.getrusage(resource.RUSAGE_SELF)
    print(f"[timeline] end {time.perf_counter() - T0:.2f} s after start; cpu {r.ru_utime:.2f} user + "
          f"{r.ru_stime:.2f} sys, {r.ru_minflt} minor faults; interpreter start-up cpu {C_START.ru_utime + C_START.ru_stime:.2f}; "
          f"peak RSS {r.ru_maxrss} KiB", file=sys.stderr)


def main():
    argv = sys.argv[1:]
    t, c = time.perf_counter(), cpu()
    mark("interpreter start-up", T0, 0.0)
    import mlx.core  # noqa: F401  (what the stage module imports first)
    mark("import mlx.core", t, c)
    t, c = time.perf_counter(), cpu()
    import vqpipe.__main__ as cli
    import vqpipe.stages.quantize as stage
    mark("import vqpipe.stages.quantize", t, c)
    import mlx_lm.utils

    from vqpipe.quant import calibrate, quantize
    from vqpipe.store import fsutil, manifest, record
    from vqpipe.store import quantized as artifact

    if "--calibration" in argv:
        timed(calibrate, "quantize_calibrated", "layer loop (quantize_calibrated)")
    timed(quantize, "_quantize_all", "layer loop (_quantize_all)")
    timed(quantize, "fuse_model")
    timed(manifest, "verify", "manifest.verify (source)")
    timed(manifest, "write", "manifest.write (output)")
    timed(mlx_lm.utils, "load", "mlx_lm load (lazy)")
    for attr in ("calibration_tokens", "quantize_model", "save_quantized"):
        timed(stage, attr)
    for attr in ("split_state", "copy_model_files", "reference_logits", "environment", "save_safetensors"):
        timed(artifact, attr)
    timed(record, "write", "record.write")
    orig_replace = fsutil.replace_dir

    def replace_dir(*a):  # atomic_dir: manifest, fsync of every file, then this
        mark("atomic_dir finish (manifest+fsync)", FSYNC[0], FSYNC[1])
        return orig_replace(*a)

    FSYNC = [0.0, 0.0]
    orig_write = manifest.write

    def mwrite(d):
        FSYNC[:] = [time.perf_counter(), cpu()]
        return orig_write(d)

    manifest.write = mwrite
    fsutil.replace_dir = replace_dir
    sys.argv = ["python -m vqpipe"] + argv
    t, c = time.perf_counter(), cpu()
    try:
        rc = cli.main()
    finally:
        mark("vqpipe main", t, c)
        report()
    return rc


if __name__ == "__main__":
    sys.exit(main())
