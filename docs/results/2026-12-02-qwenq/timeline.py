import sys, os, time, threading, json, resource
from vqpipe.prefault import hold_freed_heap; hold_freed_heap()  # was vqpipe/malloc.py, merged into prefault.py
from mlx_lm.utils import load
from vqpipe.quantize import quantize_model
from vqpipe.stages.quantize import calibration_tokens
model, tok = load("results/models/qwen2.5-0.5b/source", lazy=True)
tokens, _ = calibration_tokens(tok, "text", 2, 512, 0)
samples, marks = [], []
stop = False
def sampler():
    last_t, last_c = time.perf_counter(), time.process_time()
    while not stop:
        time.sleep(1.0)
        t, c = time.perf_counter(), time.process_time()
        samples.append((round(t - t0, 1), round((c - last_c) / (t - last_t), 2))); last_t, last_c = t, c
t0 = time.perf_counter()
th = threading.Thread(target=sampler, daemon=True); th.start()
quantize_model(model, 4, "auto", 0, embeddings=True, dtype=None, group_size=64, calibration=tokens, sequential=False,
               threads=int(sys.argv[1]), progress=lambda m: marks.append((round(time.perf_counter() - t0, 1), m.split("]")[0] + "]")))
stop = True
print("wall", round(time.perf_counter() - t0, 1), "load", open("/proc/loadavg").read().split()[0])
print("marks", marks)
print("cores/s", samples)
