import sys, time, resource
import mlx.core as mx, numpy as np
from vqpipe.prefault import hold_freed_heap, Prefault
hold_freed_heap()
from vqpipe.stages.quantize import load_quantized, reference_logits
from vqpipe import qlinear
def cpu():
    r = resource.getrusage(resource.RUSAGE_SELF); return r.ru_utime, r.ru_stime, r.ru_minflt
path, mode = sys.argv[1], sys.argv[2]
model, tok = load_quantized(path)
big = max(m.out_features * m.in_features * 4 for _, m in model.named_modules() if isinstance(m, qlinear.QuantizedLinear))
t=time.perf_counter(); c=cpu()
if mode == "pf":
    with Prefault(big + (96 << 20)):
        ref = reference_logits(model, tok)
else:
    ref = reference_logits(model, tok)
print(mode, "ref", round(time.perf_counter()-t, 2), [round(b-a, 2) for a,b in zip(c,cpu())], resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, big>>20)
want = mx.load(path + "/reference.safetensors")
print("same", all(np.array_equal(np.array(ref[k]), np.array(want[k])) for k in want))
