"""The optimizer phase on fake tensors made from the first of its kind (made_calls.py) instead of computed.

A fake step's optimizer phase computes nothing: gradient clipping (a norm per gradient, then each scaled in place)
and torch's own optimizer step (a first one making its state: two moments and a step count per parameter) are
storages made and freed in an order that depends only on the parameters', gradients' and state's shapes. They were
about two fifths of a GPT-2 small trial's step. So the first call of each kind runs as on every device, watched,
and each later one is made from it, across trials (a trial's kinds repeat from one micro-batch or context to the
next):

- clipping, on every step: what it writes (the gradients) is marked as of unknown values; the norm it returns is
  not used by the step;
- the optimizer step: a first one (no state yet) anywhere, its state made empty with the values the first of its
  kind left known (a step count a later step reads); a later one only where it is the trial's last (`last`), as
  what it writes in place (a step count) is of unknown values after. Only torch's own optimizer classes, with no
  step hooks and their `step` not replaced on the instance (an LR scheduler's counter): a model file's own
  optimizer may keep more than its tensors.

Real tensors (the cpu device, a GPU) and a memory snapshot's trial compute every call (made_calls.fake_call).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch
from torch import nn
from torch.optim import optimizer as torch_optimizer

from .fakes import current_values
from .made_calls import MadeCalls, fake_call

_CALLS = MadeCalls(direct=True)  # every trial's in this process (kinds by shapes: they hold from trial to trial)
_STATES: dict[tuple, tuple] = {}  # a first step's kind -> the state it made (per parameter, (key, output index or
# the value) for each entry), and the values known of each tensor it made (a step count; None: unknown)


def _sig(t: torch.Tensor | None) -> tuple | None:
    return None if t is None else (tuple(t.shape), t.stride(), t.storage_offset(), t.dtype, t.device)


def _value_sig(v) -> object:
    return ("tensor", _sig(v)) if isinstance(v, torch.Tensor) else repr(v)


def clip(holders: list[torch.Tensor], max_norm: float) -> None:
    """nn.utils.clip_grad_norm_(holders, max_norm), made where its kind was seen (its norm is not returned)."""
    grads = [p.grad for p in holders if p.grad is not None]
    where = fake_call(*grads) if grads else None
    kind = ("clip", float(max_norm), tuple(_sig(g) for g in grads), *where) if where is not None else None
    _CALLS(kind, lambda: (nn.utils.clip_grad_norm_(holders, max_norm), None)[1], written=tuple(grads))


def _makeable(opt: torch.optim.Optimizer) -> bool:
    return (type(opt).__module__.startswith("torch.optim.") and "step" not in vars(opt)
            and not (opt._optimizer_step_pre_hooks or opt._optimizer_step_post_hooks
                     or torch_optimizer._global_optimizer_pre_hooks or torch_optimizer._global_optimizer_post_hooks))


def _step_kind(opt: torch.optim.Optimizer, params: list, args: tuple, kwargs: dict) -> tuple | None:
    tensors = [*params, *(p.grad for p in params if p.grad is not None),
               *(v for p in params for v in opt.state.get(p, {}).values() if isinstance(v, torch.Tensor))]
    where = fake_call(*tensors)
    if where is None or any(isinstance(a, torch.Tensor) or callable(a) for a in args):
        return None
    groups = tuple(tuple(sorted((k, _value_sig(v)) for k, v in g.items() if k != "params")) + (len(g["params"]),)
                   for g in opt.param_groups)
    each = tuple((_sig(p), p.requires_grad, _sig(p.grad),
                  tuple(sorted((k, _value_sig(v)) for k, v in opt.state[p].items())) if p in opt.state else None)
                 for p in params)
    passed = tuple(sorted((k, _value_sig(v)) for k, v in kwargs.items()))
    return ("step", type(opt), groups, each, passed, args, *where)


@contextlib.contextmanager
def stepping(opt: torch.optim.Optimizer, last: bool) -> Iterator[None]:
    """Inside, `opt.step(...)` (called by a GradScaler too) is made where its kind was seen: a first step (no state
    yet), or, where it is `last` (the trial's last step), one whose every parameter has its state."""
    first = next((p for g in opt.param_groups for p in g["params"]), None)
    if first is None or fake_call(first) is None or not _makeable(opt):  # (real tensors: training left as it is)
        yield
        return
    opt.step = lambda *args, **kwargs: _step(opt, last, args, kwargs)
    try:
        yield
    finally:
        del opt.step


def _step(opt: torch.optim.Optimizer, last: bool, args: tuple, kwargs: dict):
    call: Callable[[], object] = lambda: type(opt).step(opt, *args, **kwargs)  # noqa: E731
    params = [p for g in opt.param_groups for p in g["params"]]
    fresh = not any(p in opt.state for p in params)
    if not (fresh or last and all(p in opt.state for p in params)):
        return call()
    kind = _step_kind(opt, params, args, kwargs)
    if kind is None:
        return call()
    before = [v for p in params for v in opt.state.get(p, {}).values() if isinstance(v, torch.Tensor)]

    def returned(_out) -> list[torch.Tensor]:
        if not fresh:
            return []
        made, layout = [], []
        for p in params:
            entries = []
            for k, v in sorted(opt.state.get(p, {}).items()):  # (no state: a parameter with no gradient)
                entries.append((k, ("out", len(made)) if isinstance(v, torch.Tensor) else ("value", v)))
                made += [v] if isinstance(v, torch.Tensor) else []
            layout.append(tuple(entries))
        values = current_values()
        _STATES[kind] = tuple(layout), tuple(None if values is None or (v := values._known(t)) is None
                                             else v.clone() for t in made)
        return made

    def rebuilt(tensors: list[torch.Tensor]) -> None:
        if fresh:
            layout, known = _STATES[kind]
            for p, entries in zip(params, layout, strict=True):
                if entries:
                    opt.state[p] = {k: tensors[v] if how == "out" else v for k, (how, v) in entries}
            values = current_values()
            for t, v in zip(tensors, known, strict=True):
                if v is not None and values is not None:
                    values._attach(t, v.clone())  # (the step count a later step reads, as the call left it)

    return _CALLS(kind, call, returned, rebuilt, written=(*params, *before))
