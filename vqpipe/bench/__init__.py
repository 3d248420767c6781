"""The benchmarks' library: ``harness`` (timing, noise floor, peak memory), ``env`` (environment
record) and ``roofline``, shared by the bench-* stages (vqpipe/stages/) and experiments/."""

from .env import environment
from .harness import (
    AA_SUFFIX,
    NO_DIFFERENCE,
    aa_floor,
    compare,
    compare_all,
    measure_peak,
    noise_floor,
    peak_per_arm,
    run_interleaved,
    summarize,
    with_aa,
)
