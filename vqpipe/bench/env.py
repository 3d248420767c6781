"""The environment record stored in every artifact: backend, device, BLAS, versions, CPU/GPU."""

import os
import platform
import subprocess
import sys
from importlib import metadata

import mlx.core as mx

from .. import blas
from ..kernels import qmv


def _version(dist):
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def _cpu_model():
    if sys.platform == "darwin":
        try:
            return subprocess.run(
                ["sysctl", "-n", "machdep.cpu.brand_string"], capture_output=True, text=True, timeout=5
            ).stdout.strip() or None
        except OSError:
            return None
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() in ("model name", "Model", "Hardware", "cpu model"):
                    return value.strip()
    except OSError:
        pass
    return platform.processor() or None


def _memory_bytes():
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def _device_info(dev):
    try:
        return {k: v for k, v in mx.device_info(dev).items() if isinstance(v, (str, int, float, bool))}
    except Exception:  # older MLX, or no such device
        return {}


def _nvidia_smi_name():
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True, text=True, timeout=10
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip().splitlines()[0] if out.returncode == 0 and out.stdout.strip() else None


def environment():
    """What the numbers were measured on; JSON-serializable."""
    # Here, not at module level: vqpipe.kivi imports mlx-lm (and so transformers, ~1 s), which a
    # process importing this module for its harness need not pay (bench-load's fresh children).
    # The rules that run environment() list vqpipe.kivi.kernels as a code input.
    from ..kivi import kernels as kivi_kernels

    dev = mx.default_device()
    metal = bool(mx.metal.is_available())
    cuda = bool(hasattr(mx, "cuda") and mx.cuda.is_available())
    gpu_info = _device_info(mx.gpu) if (metal or cuda) else {}
    gpu_name = gpu_info.get("device_name") or (_nvidia_smi_name() if cuda else None)
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:
        cpus = os.cpu_count()
    return {
        "backend": "gpu" if dev.type == mx.gpu else "cpu",
        "device": str(dev),
        "metal": metal,
        "cuda": cuda,
        "gpu_name": gpu_name,
        "device_info": _device_info(dev),
        "cpu_model": _cpu_model(),
        "cpu_count": cpus,
        "memory_bytes": _memory_bytes(),
        "blas": blas.in_use(),
        # Which fused GPU kernels the run could use (a switch set off is recorded, so runs with
        # different kernel settings are never compared unknowingly).
        "kernels": {"qmv": qmv.kernels_active(), "kivi": kivi_kernels.kernels_active()},
        "versions": {
            "python": platform.python_version(),
            "mlx": mx.__version__,
            "mlx-lm": _version("mlx-lm"),
            "numpy": _version("numpy"),
            "vqpipe": _version("vqpipe"),
        },
        "platform": platform.platform(),
        "machine": platform.machine(),
        # Other processes share the machine; a high load average explains a wide min-max.
        "loadavg": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
    }


def environment_or_error():
    """``environment()``, or ``{"error": ...}`` if collecting it fails: the figures of an op
    benchmark are still worth writing without it."""
    try:
        return environment()
    except Exception as e:
        return {"error": repr(e)}
