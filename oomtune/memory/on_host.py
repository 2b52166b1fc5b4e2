"""A model file that places its model on the GPU itself (`.to("cuda")`, `.cuda()`, `device="cuda"`) on a simulated
device: the cpu and fake devices stand for the card with host tensors, so a tensor sent to or made on cuda lands on
the cpu instead. Without it, such a file could not be estimated where PyTorch has no CUDA (its build raised "not
linked with support for cuda devices"), and on a machine with a GPU its weights would leave the simulated device."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch.overrides import TorchFunctionMode

_HOST = torch.device("cpu")


def _hosted(x):
    if isinstance(x, torch.device) and x.type == "cuda":
        return _HOST
    if isinstance(x, str) and x.split(":")[0] == "cuda":
        return _HOST
    return x


class CudaOnHost(TorchFunctionMode):
    """Inside, cuda means the cpu: Tensor.to/.cuda and every factory's `device=` (Module.to and .cuda go through
    Tensor's)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func is torch.Tensor.cuda:
            kwargs.pop("device", None)
            return args[0].to(_HOST, non_blocking=kwargs.get("non_blocking", False))
        if func is torch.Tensor.to:
            args = (args[0], *(_hosted(a) for a in args[1:]))
        if "device" in kwargs:
            kwargs["device"] = _hosted(kwargs["device"])
        return func(*args, **kwargs)


@contextlib.contextmanager
def cuda_autocast_on_host() -> Iterator[None]:
    """Inside, a model file's own `torch.autocast("cuda", ...)` (`torch.cuda.amp.autocast` too) is the cpu's autocast,
    as its tensors are the cpu's: torch disables a cuda region where it has no CUDA ("CUDA is not available"), and
    on a machine with one it would not reach the host tensors, so a region the file keeps in fp32 (enabled=False)
    ran in the plan's 16 bits, and its own bf16 region in fp32. CUDA's default dtype, fp16, is kept."""
    cls = torch.amp.autocast_mode.autocast
    original = cls.__init__

    def __init__(self, device_type, dtype=None, enabled=True, cache_enabled=None):
        if device_type == "cuda":
            device_type, dtype = "cpu", dtype if dtype is not None else torch.float16
        original(self, device_type, dtype=dtype, enabled=enabled, cache_enabled=cache_enabled)

    cls.__init__ = __init__
    try:
        yield
    finally:
        cls.__init__ = original
