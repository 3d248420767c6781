import sys, time, resource, hashlib
import mlx.core as mx, numpy as np
from vqpipe.prefault import hold_freed_heap
hold_freed_heap()
from vqpipe.stages.quantize import load_quantized, reference_logits
from vqpipe.dequant import decoded_once
def cpu():
    r = resource.getrusage(resource.RUSAGE_SELF); return r.ru_utime, r.ru_stime
path = sys.argv[1]
t=time.perf_counter(); c=cpu()
model, tok = load_quantized(path)
print("load", time.perf_counter()-t, [b-a for a,b in zip(c,cpu())])
t=time.perf_counter(); c=cpu()
if True:
    ref = reference_logits(model, tok)
print("ref", time.perf_counter()-t, [b-a for a,b in zip(c,cpu())], resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)
want = mx.load(path + "/reference.safetensors")
print("same", all(np.array_equal(np.array(ref[k]), np.array(want[k])) for k in want), sorted(want)==sorted(ref))
print({k: v.shape for k, v in ref.items()})
