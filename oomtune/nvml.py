"""The one seam to NVML (the library behind nvidia-smi). Tests replace `_load()`'s result."""

from __future__ import annotations


def _load():
    """The pynvml module, initialised; None where there is no NVIDIA driver."""
    try:
        import pynvml

        pynvml.nvmlInit()
        return pynvml
    except Exception:  # no library, no driver, no GPU: all mean "NVML has nothing to say"
        return None


def free_bytes(index: int) -> int | None:
    """Free memory on GPU `index` as NVML sees it (other processes included), or None."""
    nv = _load()
    if nv is None:
        return None
    try:
        handle = nv.nvmlDeviceGetHandleByIndex(index)
        return int(nv.nvmlDeviceGetMemoryInfo(handle).free)
    except Exception:
        return None
