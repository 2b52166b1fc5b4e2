"""aten kernels of our own on one dispatch key for the length of a `with` (a card's kernels, CUDA autocast's policy on
the simulated devices), and torch's Python-side dispatch caches forgotten on the way in and out.

torch keeps, per op overload, which kernel its Python dispatcher (make_fx, AOTAutograd's tracing) takes for each
dispatch key (`OpOverload._dispatch_cache`). Registering or removing a kernel in the C++ dispatcher does not clear
it: an entry made while ours was registered outlives it, and a later trace in the process then reaches a kernel
that is gone (a compiled loss traced on the cpu device after an estimate with a card's rules lost its autograd: its
log_softmax took the card's AutogradCPU entry), and an entry made before ours would bypass ours."""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable, Iterator

import torch


def overload(name: str) -> torch._ops.OpOverload:
    """'softmax.int' -> torch.ops.aten.softmax.int; 'mm' -> torch.ops.aten.mm.default."""
    op, _, variant = name.partition(".")
    return getattr(getattr(torch.ops.aten, op), variant or "default")


@contextlib.contextmanager
def overriding(key: str, kernels: dict[str, Callable]) -> Iterator[None]:
    """Inside, each aten op named in `kernels` ("softmax.int", "mm") runs its kernel there on dispatch key `key`."""
    lib = torch.library.Library("aten", "IMPL")
    try:
        with warnings.catch_warnings():  # "Overriding a previously registered kernel": that is the point
            warnings.simplefilter("ignore")
            for name, kernel in kernels.items():
                lib.impl(name, kernel, key)
        forget_dispatch(kernels)
        yield
    finally:
        lib._destroy()
        forget_dispatch(kernels)


def forget_dispatch(names) -> None:
    """Clear the Python dispatcher's cached kernels of these ops (see the module doc)."""
    for name in names:
        cache = getattr(overload(name), "_dispatch_cache", None)
        if isinstance(cache, dict):
            cache.clear()
