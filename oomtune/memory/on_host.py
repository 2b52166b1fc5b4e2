"""A model file that places its model on the GPU itself (`.to("cuda")`, `.cuda()`, `device="cuda"`) on a simulated
device: the cpu and fake devices stand for the card with host tensors, so a tensor sent to or made on cuda lands on
the cpu instead. Without it, such a file could not be estimated where PyTorch has no CUDA (its build raised "not
linked with support for cuda devices"), and on a machine with a GPU its weights would leave the simulated device."""

from __future__ import annotations

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
