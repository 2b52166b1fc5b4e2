"""`torch.tensor(data)` / `torch.as_tensor(data)` where `data` holds FakeTensors, on the fake device (fakes.py's module
doc, 5): a list of 0-d tensors (torchtune's Llama 3 RoPE scaling builds its frequencies so) is read in C++, past the
dispatcher, and failed ("data is not allocated yet"). `known_data` puts their known values (their shadows, fakes.Values)
in their place; one without values raises NeedsValues, and the search computes instead."""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator

import torch
from torch._subclasses.fake_tensor import FakeTensor
from torch.utils._python_dispatch import _disable_current_modes

from .fakes import NeedsValues, shadow_of


def _as_real(data):
    """`data` (nested lists and tuples) with each FakeTensor in it replaced by its known values (its shadow)."""
    if isinstance(data, (list, tuple)):
        return [_as_real(x) for x in data]
    if isinstance(data, FakeTensor):
        known = shadow_of(data)
        if known is None:
            raise NeedsValues(torch.tensor, "torch.tensor() was given fake tensors' values (data-dependent), "
                                            "which fake tensors do not have")
        return known
    return data


def _holds_fakes(data) -> bool:
    if isinstance(data, (list, tuple)):
        return any(_holds_fakes(x) for x in data)
    return isinstance(data, FakeTensor)


def _from_known(original: Callable) -> Callable:
    """`original` (torch.tensor or torch.as_tensor) that makes data holding FakeTensors from their known values,
    with the dtype (and the errors) real torch gives those values. Anything else, a single FakeTensor too (the real
    call copies it through the dispatcher), goes to `original` as given."""

    @functools.wraps(original)
    def from_data(data, *args, **kwargs):
        if args or not isinstance(data, (list, tuple)) or not _holds_fakes(data):  # (args: torch's own error)
            return original(data, *args, **kwargs)
        with _disable_current_modes():  # real torch's own dtype inference and errors, on the known values
            value = _OWN["tensor"](_as_real(data), dtype=kwargs.get("dtype"))
        return original(value.tolist(), **{**kwargs, "dtype": value.dtype})

    return from_data


_OWN = {"tensor": torch.tensor, "as_tensor": torch.as_tensor}  # torch's own
_MADE = {name: _from_known(f) for name, f in _OWN.items()}
for _name, _made in _MADE.items():  # TorchScript compiles them as torch's own (a function scripted in a trial)
    with contextlib.suppress(AttributeError):
        torch.jit._builtins._register_builtin(_made, f"aten::{_name}")


@contextlib.contextmanager
def known_data() -> Iterator[None]:
    """While inside, `torch.tensor` / `torch.as_tensor` of data holding FakeTensors are made from their known
    values (fakes.py's module doc, 5). The two functions are replaced on the torch module, which is where model
    code looks them up, rather than seen by a TorchFunctionMode: a function mode takes every torch call of a step
    through Python (a GPT-2 small trace, fake, 14% slower with one). Code that bound them before (`from torch
    import tensor`) gets torch's own; code that binds them inside keeps the replacement, which outside does what
    torch's own does (nothing holds fakes there). Nested, each restores what it found."""
    found = {name: getattr(torch, name) for name in _OWN}
    for name, made in _MADE.items():
        setattr(torch, name, made)
    try:
        yield
    finally:
        for name, original in found.items():
            setattr(torch, name, original)
