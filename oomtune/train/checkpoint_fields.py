"""What each field of a checkpoint must hold, checked when it is read, before anything uses it: a checkpoint edited
or made by hand (a data batch of 0, an empty RNG state, a step that is no number) is one line naming the file and
the field, never a ZeroDivisionError or a KeyError from deep in a resume. The file itself is never touched."""

from __future__ import annotations

import numbers
from typing import Any

import torch

from ..errors import shown


def _count(value: Any, least: int) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool) and value >= least


def _byte_state(value: Any) -> bool:
    """A torch generator's state: a 1-D uint8 tensor."""
    return isinstance(value, torch.Tensor) and value.dtype == torch.uint8 and value.dim() == 1


def _python_state(value: Any) -> bool:
    """random.getstate() as rng.capture_rng keeps it: [version, 625 ints, gauss]."""
    return (isinstance(value, (list, tuple)) and len(value) == 3 and isinstance(value[1], (list, tuple))
            and len(value[1]) == 625 and all(isinstance(x, int) for x in value[1]))


def _numpy_state(value: Any) -> bool:
    """numpy's legacy global state as rng.capture_rng keeps it: [name, 624 int64 keys, pos, has_gauss, cached]."""
    return (isinstance(value, (list, tuple)) and len(value) == 5 and isinstance(value[0], str)
            and isinstance(value[1], torch.Tensor) and value[1].numel() == 624 and _count(value[2], 0)
            and isinstance(value[4], (int, float)))


def rng_problem(rng: Any) -> str | None:
    """What is wrong with a checkpoint's RNG states (one rank's), else None."""
    if not isinstance(rng, dict):
        return f"its RNG state is {type(rng).__name__}, not a mapping"
    for key, ok, what in (("torch", _byte_state, "a uint8 tensor (torch.get_rng_state())"),
                          ("python", _python_state, "[version, 625 numbers, gauss] (random.getstate())")):
        if key not in rng:
            return f"its RNG state has no {key!r} entry"
        if not ok(rng[key]):
            return f"its RNG state's {key!r} entry is not {what}: {shown(rng[key])}"
    if rng.get("numpy") is not None and not _numpy_state(rng["numpy"]):
        return f"its RNG state's 'numpy' entry is not numpy's legacy state: {shown(rng['numpy'])}"
    cuda = rng.get("cuda")
    if cuda is not None and not (isinstance(cuda, (list, tuple)) and all(_byte_state(c) for c in cuda)):
        return f"its RNG state's 'cuda' entry is not a list of uint8 tensors: {shown(cuda)}"
    return None


def field_problem(state: dict[str, Any]) -> str | None:
    """What is wrong with the fields a checkpoint holds (those it has: a folder's metadata holds fewer), else None."""
    if "step" in state and not _count(state["step"], 0):
        return f"its step is not a whole number of 0 or more: {shown(state['step'])}"
    if "plan" in state and not isinstance(state["plan"], dict):
        return f"its plan is {type(state['plan']).__name__}, not a mapping"
    if "data" in state:
        data = state["data"]
        if not isinstance(data, dict):
            return f"its data position is {type(data).__name__}, not a mapping"
        if not _count(data.get("batch_size"), 1):
            return f"its data position's batch_size is not a whole number of 1 or more: {shown(data.get('batch_size'))}"
        if "batches" in data and not _count(data["batches"], 0):
            return f"its data position's batches is not a whole number of 0 or more: {shown(data['batches'])}"
    for key in ("scaler", "model", "train"):
        if key in state and not isinstance(state[key], dict):
            return f"its {key} state is {type(state[key]).__name__}, not a mapping"
    optimizer = state.get("optimizer")
    if "optimizer" in state and not (isinstance(optimizer, dict) and isinstance(optimizer.get("state"), dict)
                                     and isinstance(optimizer.get("param_groups"), list)):
        return "its optimizer state is not an optimizer's state_dict (a mapping with 'state' and 'param_groups')"
    return rng_problem(state["rng"]) if "rng" in state else None
