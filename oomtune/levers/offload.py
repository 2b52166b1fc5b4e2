"""CPU offload: the optimizer (its state, its step and the gradients) and the tensors saved for backward, held
in host memory.

The same code runs on every device; only where "host" is differs (`Device.host()`): pinned CPU memory on cuda, and
on the simulated devices CPU tensors their tracker counts as host memory, apart from the device's budget.

`HostOffloadOptimizer` keeps a host copy of every trainable parameter with a host gradient, and runs the wrapped
optimizer (AdamW, or 8-bit AdamW) over those copies. As backward finishes each parameter's gradient, a hook adds
it into the host gradient and frees the device's, so at most the gradients of a few parameters are on the device
at once. Unlike torchao's CPUOffloadOptimizer with offload_gradients (which overwrites the host gradient), it adds:
gradient accumulation works. After the host step the new weights are copied back to the device."""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Iterator, Sequence

import torch
from torch import nn


def _remove_all(handles: list) -> None:
    for h in handles:
        h.remove()


class HostOffloadOptimizer(torch.optim.Optimizer):
    """An optimizer whose parameters, gradients, state and step live in host memory (`device.host()`); it stands
    in for `make(host_params)` where the training step expects the optimizer. Its param_groups and state are the
    host optimizer's (the trainer's learning-rate schedule sets them there)."""

    host_resident = True  # the tracker counts its state as host memory (MemoryTracker.track)

    def __init__(self, params: Sequence[nn.Parameter], make: Callable[[list[torch.Tensor]], torch.optim.Optimizer],
                 device):
        # no Optimizer.__init__: param_groups and state are the host optimizer's (properties below)
        self._device = device
        self._params = [p for p in params if p.requires_grad]
        if not self._params:
            raise ValueError("optimizer got an empty parameter list")
        self._host: dict[nn.Parameter, torch.Tensor] = {}  # device parameter -> its host copy
        self._grad: dict[nn.Parameter, torch.Tensor] = {}  # device parameter -> its host gradient
        with device.host():
            for p in self._params:
                self._host[p] = torch.empty(p.shape, dtype=p.dtype, device="cpu", pin_memory=device.pin_memory)
                self._host[p].copy_(p.detach())
                self._grad[p] = torch.zeros_like(self._host[p])
        self._reached: set[nn.Parameter] = set()  # parameters backward gave a gradient since the last zero_grad
        self.inner = make(list(self._host.values()))
        self.defaults = self.inner.defaults
        # the hook must not hold the optimizer: a tensor's hooks live on its C++ side, where Python's collector
        # cannot see the cycle (parameter -> hook -> optimizer -> parameter), so it would never be freed
        me = weakref.ref(self)

        def hook(p: nn.Parameter) -> None:
            optimizer = me()
            if optimizer is not None:
                optimizer.take_gradient(p)

        self._hooks = [p.register_post_accumulate_grad_hook(hook) for p in self._params]
        # and the hooks go with the optimizer (a probe's trials reuse the model, each with an optimizer of its own)
        weakref.finalize(self, _remove_all, self._hooks)

    @property
    def param_groups(self) -> list[dict]:
        return self.inner.param_groups

    @property
    def state(self):
        return self.inner.state

    def take_gradient(self, p: nn.Parameter) -> None:
        """Add p's gradient into its host gradient and free the device's (what backward's hook does for each)."""
        with self._device.host():
            if p in self._reached:  # the next micro-step of an accumulated step
                self._grad[p].add_(p.grad.to(self._grad[p].device))
            else:
                self._grad[p].copy_(p.grad)
                self._reached.add(p)
        p.grad = None  # the device's copy is freed now, as backward goes on

    @property
    def make_state(self) -> Callable[[], None] | None:
        """The host optimizer's make_state (its state without a step, on the host), where it has one."""
        make = getattr(self.inner, "make_state", None)
        if make is None:
            return None

        def on_host() -> None:
            with self._device.host():
                make()

        return on_host

    def take_gradients(self) -> None:
        """Move every gradient the device holds now to the host (what the backward hook does as each is made)."""
        for p in self._params:
            if p.grad is not None:
                self.take_gradient(p)

    def gradient_of(self, p: nn.Parameter) -> torch.Tensor | None:
        """p's gradient of the step in flight, on the host (None where backward gave none): until zero_grad."""
        return self._grad[p] if p in self._reached else None

    def gradient_holders(self) -> list[torch.Tensor]:
        """The tensors whose .grad is this step's gradient (clipping reads these): the host copies, their .grad
        set to this step's host gradient (None where backward gave none: the step leaves those alone)."""
        for p, h in self._host.items():
            h.grad = self._grad[p] if p in self._reached else None  # no update where no gradient came
        return [self._host[p] for p in self._params if p in self._reached]

    @torch.no_grad()
    def step(self, closure=None):
        loss = closure() if closure is not None else None
        self.gradient_holders()
        with self._device.host():
            self.inner.step()
        for p in self._reached:
            p.copy_(self._host[p], non_blocking=self._device.pin_memory)
        self._device.synchronize()
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self._params:
            p.grad = None
        self._reached = set()

    def state_dict(self) -> dict:
        return self.inner.state_dict()

    def load_state_dict(self, state_dict: dict) -> None:
        """The host optimizer's state; the host weights are taken from the device's (load the model first)."""
        with self._device.host():
            self.inner.load_state_dict(state_dict)
            for p, h in self._host.items():
                h.copy_(p.detach())

    def __repr__(self) -> str:
        return f"HostOffloadOptimizer({self.inner!r})"


@contextlib.contextmanager
def activations_on_host(device) -> Iterator[None]:
    """Inside, every tensor autograd saves for backward (parameters excepted: they stay where they are) is copied
    to host memory when saved and back to the device when backward uses it, as
    torch.autograd.graph.save_on_cpu(pin_memory=True) does; the copy back is always a new tensor, so the
    simulated devices count it on the device as cuda does."""

    def pack(t: torch.Tensor):
        if isinstance(t, nn.Parameter) or t.numel() == 0:
            return t
        with device.host():
            h = torch.empty(t.size(), dtype=t.dtype, layout=t.layout, device="cpu", pin_memory=device.pin_memory)
            h.copy_(t)
        return t.device, h

    def unpack(packed):
        if isinstance(packed, torch.Tensor):
            return packed
        where, h = packed
        return h.to(where, copy=True, non_blocking=device.pin_memory)

    with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        yield
