"""scripts/calib_time.py's digest (sha256 over the quantized layers' stored arrays, in name order) of a quantize artifact."""
import hashlib, sys
import mlx.core as mx, numpy as np
t = mx.load(sys.argv[1] + "/quantized.safetensors")
arrays = {k[len("layers."):]: v for k, v in t.items() if k.startswith("layers.")}
h = hashlib.sha256()
for k in sorted(arrays):
    a = arrays[k]
    a = a.view(mx.uint16) if a.dtype == mx.bfloat16 else a
    h.update(k.encode() + np.array(a).tobytes())
print(h.hexdigest()[:16])
