# Benchmarks: not deterministic (timings), so never cached. Filled in as the bench stages land.


def bench_outputs():
    """Every benchmark JSON the config asks for."""
    return []
