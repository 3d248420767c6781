"""The timing harness every benchmark uses.

Arms run interleaved in one process (A B A B ...), each call gets a rotating input index, and a
sample is the wall time of the whole call including ``mx.eval`` and ``mx.synchronize()`` (MLX is
lazy: timing only the Python call would time graph construction). Warm-up rounds are untimed.
See docs/benchmarking.md for the noise floor and verdict rules.
"""

import gc
import math
import statistics
import time

import mlx.core as mx

NO_DIFFERENCE = "no measurable difference"
AA_SUFFIX = " (A/A)"


def _settle(out):
    mx.eval(out)
    mx.synchronize()


def run_interleaved(arms, n_inputs, repeats, warmup=1):
    """Time each arm ``repeats`` times, interleaved; returns ``{arm: [seconds, ...]}``.

    Round r calls every arm, in dict order, with input index ``r % n_inputs`` (warm-up rounds
    included), so all arms see the same inputs. The first ``warmup`` rounds are not recorded.
    The garbage collector is paused so a collection does not land inside one arm's sample.
    """
    if not arms:
        raise ValueError("no arms to run")
    if n_inputs < 1 or repeats < 1 or warmup < 0:
        raise ValueError(f"need n_inputs >= 1, repeats >= 1, warmup >= 0 (got {n_inputs}, {repeats}, {warmup})")
    times = {name: [] for name in arms}
    gc.collect()
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        for r in range(warmup + repeats):
            i = r % n_inputs
            for name, fn in arms.items():
                mx.synchronize()
                t0 = time.perf_counter()
                _settle(fn(i))
                dt = time.perf_counter() - t0
                if r >= warmup:
                    times[name].append(dt)
    finally:
        if was_enabled:
            gc.enable()
    return times


def summarize(samples):
    """``{"n", "median", "min", "max"}`` of a non-empty list of numbers."""
    samples = list(samples)
    if not samples:
        raise ValueError("no samples")
    return {"n": len(samples), "median": statistics.median(samples), "min": min(samples), "max": max(samples)}


def _rel_se_median(samples):
    # Standard error of the median from a robust sigma (1.4826 * MAD) and the normal-theory factor
    # sqrt(pi/2) = 1.2533, relative to the median. Zero for n = 1 or identical samples.
    m = statistics.median(samples)
    mad = statistics.median(abs(x - m) for x in samples)
    return 1.2533 * 1.4826 * mad / (math.sqrt(len(samples)) * m)


def noise_floor(a, a2):
    """Relative noise floor from an A/A pair: two sample lists of the same arm.

    ``max(larger median / smaller median - 1, 2 * sqrt(se(a)^2 + se(a2)^2))`` where ``se`` is the
    relative standard error of a median. The first term is the disagreement actually observed between
    two runs of the same code (drift, position in the interleave), taken larger over smaller so the
    pair always lies inside its own floor whichever is slower (``compare`` is symmetric in log
    ratio); the second is the ~95% sampling spread of a ratio of two medians at this n, so a lucky
    A/A agreement does not make the floor 0.
    """
    m, m2 = statistics.median(a), statistics.median(a2)
    drift = max(m, m2) / min(m, m2) - 1
    sampling = 2 * math.hypot(_rel_se_median(a), _rel_se_median(a2))
    return max(drift, sampling)


def compare(baseline, other, floor):
    """Compare two lists of durations; ``speedup`` > 1 means ``other`` is faster.

    Inside the floor (medians within a factor ``1 + floor`` of each other, either direction) the
    verdict is "no measurable difference".
    """
    mb, mo = statistics.median(baseline), statistics.median(other)
    ratio = mo / mb
    speedup = mb / mo
    if abs(math.log(ratio)) <= math.log1p(floor) + 1e-12:  # an A/A pair sits on its floor's edge: no rounding flip
        verdict = NO_DIFFERENCE
    elif speedup > 1:
        verdict = f"{speedup:.2f}x faster"
    else:
        verdict = f"{ratio:.2f}x slower"
    return {
        "baseline": summarize(baseline),
        "other": summarize(other),
        "ratio": ratio,
        "speedup": speedup,
        "floor": floor,
        "verdict": verdict,
        "text": f"{verdict} (speedup {speedup:.3f}, noise floor ±{floor:.1%})",
    }


def with_aa(arms, baseline_name):
    """``arms`` plus a second copy of the baseline (last in the interleave) for the A/A floor."""
    if baseline_name not in arms:
        raise KeyError(baseline_name)
    out = dict(arms)
    out[baseline_name + AA_SUFFIX] = arms[baseline_name]
    return out


def aa_floor(times, baseline_name):
    """The noise floor from a ``run_interleaved`` result of ``with_aa(arms, baseline_name)``."""
    return noise_floor(times[baseline_name], times[baseline_name + AA_SUFFIX])


def compare_all(times, baseline_name, floor=None):
    """``{arm: compare(baseline, arm, floor)}`` for every non-baseline arm; floor defaults to the A/A one."""
    floor = aa_floor(times, baseline_name) if floor is None else floor
    skip = {baseline_name, baseline_name + AA_SUFFIX}
    return {name: compare(times[baseline_name], t, floor) for name, t in times.items() if name not in skip}


def measure_peak(fn):
    """Peak MLX memory in bytes while ``fn()`` runs and its result is evaluated.

    The counter is reset just before the call, so the figure is what was already allocated
    (e.g. the model's weights) plus the call's own high-water mark.
    """
    mx.synchronize()
    mx.reset_peak_memory()
    out = fn()
    _settle(out)
    peak = mx.get_peak_memory()
    del out
    return int(peak)


def peak_per_arm(arms, i=0):
    """``{arm: measure_peak(lambda: fn(i))}``, the counter reset for each arm."""
    return {name: measure_peak(lambda: fn(i)) for name, fn in arms.items()}


def empty_call_overhead(repeats, warmup=1):
    """Median cost of a timed call that does nothing on the device (eval + synchronize of a ready
    array): the floor under every per-call figure of an op benchmark."""
    ready = mx.zeros((1,))
    mx.eval(ready)
    return summarize(run_interleaved({"empty": lambda i: ready}, 1, repeats, warmup)["empty"])
