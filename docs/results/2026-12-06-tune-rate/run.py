import sys
import vqpipe.quant.tune as T
orig = T.tune
T.tune = lambda *a, **k: orig(*a, **{**k, "check": 4, "stop": False})
from vqpipe.stages import quantize
bits, out = sys.argv[1], sys.argv[2]
quantize.main(["--source", "results/models/smollm2/source", "--out", out, "--bits", bits, "--rotation", "auto",
               "--seed", "0", "--dtype", "source", "--embeddings", "--moments", "results/calibration/smollm2",
               "--damp", "0.01", "--budget", "auto", "--threads", "1", *sys.argv[3:]])
