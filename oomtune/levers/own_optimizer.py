"""The 8-bit and offload levers over a model file's own optimizer() (nanoGPT's and minGPT's configure_optimizers: a
plain AdamW with a decaying and a non-decaying param group): where its class is one these levers can rebuild
(torch's AdamW, Adam and SGD), the levers keep its param groups and their hyper-parameters (lr, betas, eps,
weight_decay, and the grouping) and apply to them: 8-bit, the 8-bit AdamW over the same groups; offload, the same
class (or the 8-bit AdamW) over the host copies of the same groups. Any other class (or a subclass, whose step may
be its own) keeps these levers out, with a note naming it."""

from __future__ import annotations

from collections.abc import Callable

import torch

# torch's optimizers the levers can rebuild, by their exact class (a subclass may step otherwise)
KNOWN = (torch.optim.AdamW, torch.optim.Adam, torch.optim.SGD)
EIGHT_BIT_KEYS = ("lr", "betas", "eps", "weight_decay")  # what 8-bit AdamW takes of a group
ON_DEVICE_KEYS = ("foreach", "fused", "capturable")  # how a group runs on the device: the host chooses its own
LEVER_KEYS = ("optimizer_8bit", "offload_optimizer")
MODEL_FILE_MODULE = "oomtune_model_"  # the name a model file is imported under (model_file.load_model_file): its
# classes are named bare


def blocked(optimizer: torch.optim.Optimizer, lever: str) -> str | None:
    """Why `lever` (a plan key of LEVER_KEYS) cannot apply to the model file's `optimizer`, as the end of a sentence
    after "its optimizer() ", or None where it can."""
    cls = type(optimizer)
    name = (f"torch.optim.{cls.__name__}" if getattr(torch.optim, cls.__name__, None) is cls
            else cls.__qualname__ if cls.__module__.startswith(MODEL_FILE_MODULE)
            else f"{cls.__module__}.{cls.__qualname__}")
    if cls not in KNOWN:
        return (f"returns {name}, which this lever cannot rebuild (it keeps the param groups of torch's AdamW, Adam "
                "and SGD)")
    if lever != "optimizer_8bit":
        return None
    groups = optimizer.param_groups
    if cls is torch.optim.SGD:
        return f"returns {name}, which keeps no moments for 8-bit AdamW to store"
    if any(g.get("amsgrad") or g.get("maximize") for g in groups):
        return f"returns {name} with amsgrad or maximize, which 8-bit AdamW does not do"
    decoupled = cls is torch.optim.AdamW or any(g.get("decoupled_weight_decay") for g in groups)
    if not decoupled and any(g.get("weight_decay") for g in groups):
        return (f"returns {name} with weight_decay, which Adam adds to the gradient (L2) and 8-bit AdamW decouples "
                "from it: use torch.optim.AdamW")
    return None


def blocked_levers(optimizer: torch.optim.Optimizer) -> tuple[tuple[str, str], ...]:
    """(plan key, why) for each of LEVER_KEYS that cannot apply to the model file's `optimizer`."""
    return tuple((key, why) for key in LEVER_KEYS if (why := blocked(optimizer, key)) is not None)


def group_settings(optimizer: torch.optim.Optimizer, eight_bit: bool) -> list[dict]:
    """Each param group's hyper-parameters (what the 8-bit AdamW takes of them, else all but how it runs on the
    device) and its parameters (the trained ones), in order."""
    out = []
    for g in optimizer.param_groups:
        keep = {k: v for k, v in g.items() if k != "params" and (k in EIGHT_BIT_KEYS if eight_bit
                                                                 else k not in ON_DEVICE_KEYS)}
        out.append({**keep, "params": [p for p in g["params"] if p.requires_grad]})
    return out


def rebuilt(groups: list[dict], cls: type) -> Callable[[list[torch.Tensor]], torch.optim.Optimizer]:
    """`make(tensors)`: a `cls` over `tensors` (the groups' parameters, or copies of them, in the groups' order) in
    the same groups with the same hyper-parameters."""
    def make(tensors: list[torch.Tensor]) -> torch.optim.Optimizer:
        it = iter(tensors)
        return cls([{**g, "params": [next(it) for _ in g["params"]]} for g in groups])

    return make
