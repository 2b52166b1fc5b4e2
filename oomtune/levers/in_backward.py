"""The optimizer stepped in backward (plan key `optimizer_in_backward`, lever `step-in-backward`; torchtune's
`optimizer_in_bwd`): each trained parameter is updated from its post-accumulate-grad hook the moment backward has
made its gradient, which is then freed. A step after backward holds every gradient at once (as large as the trained
weights); in backward, no more than the few backward is making.

One optimizer over every trained parameter, as without the lever: its state, checkpoints, learning-rate schedule
and weight decay are unchanged. At each hook only the parameter whose gradient has just been made has one (those
stepped before were freed, the rest are not made yet), and torch's optimizers (and the 8-bit ones) step only
parameters with a gradient; the step after backward then finds none and does nothing.

It cannot go with accumulation (every micro-batch's backward would update the weights), several ranks (their
gradients are averaged after backward), fp16 (its GradScaler checks every gradient for overflow before the step),
the offload lever (its own hooks take the gradients to the host), gradient clipping (it needs every gradient's
norm), AdaLoRA (its rank allocation reads the gradients after backward) or a model file's own stepping hooks:
config.schema refuses the first four in a plan, `check_applies` the rest. Only optimizers known to step each
parameter alone are stepped so (torch's AdamW, Adam and SGD, the 8-bit AdamWs): one with a count per group or per
call (schedule-free), a closure (LBFGS) or step hooks would step differently once a parameter. A parameter whose
gradient backward accumulates twice (reentrant checkpointing of segments that share it) would be stepped twice
with partial gradients: the second is an error naming it (`StepTwice`), never a silent second step."""

from __future__ import annotations

import weakref
from collections.abc import Iterable, Sequence

import torch
from torch import nn

from ..errors import BAD_INPUT, OomtuneError

HANDLE = "_oomtune_in_backward"  # the attribute of a parameter holding the handle of the hook this lever gave it
STEPPED = "_oomtune_stepped"  # the attribute of the optimizer: ids of the parameters stepped in this backward


def check_applies(label: str, clip_grad_norm: float | None, own_hooks: int, adalora: bool) -> None:
    """One line, exit 2, where the step in backward cannot run with the rest of the training."""
    why = ("train.clip_grad_norm is set: clipping needs every gradient's norm before any is applied (set it to "
           "null)" if clip_grad_norm is not None else
           f"{label} steps {own_hooks} trained parameters in backward with its own post-accumulate-grad hooks "
           "already" if own_hooks else
           f"{label}'s AdaLoRA adapters reallocate their ranks from the gradients after backward" if adalora else
           None)
    if why is not None:
        raise OomtuneError(f"plan.optimizer_in_backward: {why}", BAD_INPUT)


class StepTwice(RuntimeError):
    """Backward accumulated a parameter's gradient twice: it was stepped on the first, partial one."""


def check_optimizer(optimizer: torch.optim.Optimizer, label: str) -> None:
    from .adamw8bit import BlockwiseAdamW8bit, library_adamw8bit
    from .own_optimizer import KNOWN

    known = (*KNOWN, BlockwiseAdamW8bit, *[c for c in (library_adamw8bit(),) if c is not None])
    if type(optimizer) not in known:
        raise OomtuneError(f"plan.optimizer_in_backward: {label}'s optimizer() returns {type(optimizer).__name__}, "
                           "which may not step one parameter at a time as its step after backward would (it "
                           "steps torch's AdamW, Adam and SGD, and the 8-bit AdamW): remove the key", BAD_INPUT)


def new_backward(optimizer: torch.optim.Optimizer) -> None:
    """A backward starts: no parameter has been stepped in it yet."""
    getattr(optimizer, STEPPED, set()).clear()


def take_off(params: Iterable[nn.Parameter]) -> None:
    """Take this lever's hooks off `params`: a model a trial kept (search/trial.py's ModelCache) may have them from
    a trial of this lever, and another plan's training must neither run them nor count them as the model file's."""
    for p in params:
        handle = p.__dict__.pop(HANDLE, None)  # (a WeakKeyDictionary compares tensors with ==: not as keys)
        if handle is not None:
            handle.remove()


def put_on(optimizer: torch.optim.Optimizer, params: Sequence[nn.Parameter]) -> int:
    """Hook `optimizer`'s step onto each of `params`; returns how many parameters are stepped in backward."""
    setattr(optimizer, STEPPED, set())
    step = _stepper(weakref.ref(optimizer))
    for p in params:
        setattr(p, HANDLE, p.register_post_accumulate_grad_hook(step))
    return len(params)


def _stepper(optimizer: weakref.ref):
    """The hook: step the optimizer (only `p` has a gradient now) and free the gradient. The optimizer is held
    weakly: a hook that reached it would keep the optimizer, its state and its parameters alive from autograd's
    C++ side, where the garbage collector does not look."""
    def step(p: torch.Tensor) -> None:
        opt = optimizer()
        if opt is None:
            return
        stepped = getattr(opt, STEPPED)
        if id(p) in stepped:
            raise StepTwice(f"plan.optimizer_in_backward: backward made the gradient of a {tuple(p.shape)} parameter "
                            "twice (reentrant checkpointing of segments that share it?), and the first, partial one "
                            "was applied already: remove the key, or checkpoint with use_reentrant=False")
        stepped.add(id(p))
        opt.step()
        p.grad = None

    return step
