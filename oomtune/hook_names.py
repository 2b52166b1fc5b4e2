"""Names in a model file that look like a hook but are not one (`make_batches`, `optimiser`, `DEFAULT`).

A missing required hook is an error already; the near name goes into it. A misspelt optional hook is worse: the
default runs in its place with no word (an `optimiser()` returning SGD trained with AdamW), so the commands note
it (hook_name_notes).

The default loss's first mistakes name the hook that fixes them. The default loss calls `model(*batch)`
(`model(**batch)` for a dict) and expects a loss back. A classifier whose forward takes only its inputs refuses the
labels (TypeError: forward() takes 2 positional arguments but 3 were given); a model that returns logits gives a
tensor, not a loss. Both need the `loss(model, batch)` hook, and the line says so with a one-line example.
`check_first_loss` runs the default loss once at micro-batch 1 (on the fake tensors `static_memory` builds the model
on) so that these come before the ladder's first trial, not after it."""

from __future__ import annotations

import contextlib
import difflib
import inspect
from collections.abc import Iterator

import torch
from torch import nn

from .errors import ModelFileError, OomtuneError

REQUIRED = ("build_model", "make_batch")
OPTIONAL = ("loss", "blocks", "optimizer", "train_batches", "eval_batches")
HOOKS = REQUIRED + OPTIONAL + ("DEFAULTS",)
WORDS = ("loss", "blocks", "optimizer")  # optional hooks of one word, which a file's name may hold beside another
_CUTOFF = 0.8  # difflib's ratio: make_batches/make_batch 0.91, optimiser/optimizer 0.89, losses/loss 0.8


def _lookalikes(module, hook: str) -> list[str]:
    """The public names `module` defines that are close to `hook` without being a hook (case ignored)."""
    names = [n for n in vars(module) if not n.startswith("_") and n not in HOOKS]
    if hook == "DEFAULTS":
        names = [n for n in names if isinstance(getattr(module, n), dict)]
    else:
        names = [n for n in names if callable(getattr(module, n)) and not isinstance(getattr(module, n), type)]
    lower = {n.lower(): n for n in names}
    near = [lower[m] for m in difflib.get_close_matches(hook.lower(), list(lower), n=3, cutoff=_CUTOFF)]
    if hook in WORDS:  # loss_fn, compute_loss, get_blocks: the hook's one word, with a word of the file's own
        near += [n for low, n in lower.items() if hook in low.split("_") and n not in near]
    return near[:3]


def _shown(name: str, hook: str) -> str:
    return name if hook == "DEFAULTS" else f"{name}()"


def did_you_mean(module, hook: str, form: str = " (the file defines {}: is that it, misspelt?)") -> str:
    """`form` with the near name of a missing `hook` (' (the file defines make_batches(): is that it, misspelt?)'),
    or '' where the file defines none."""
    near = _lookalikes(module, hook) if hasattr(module, "__dict__") else []
    return form.format(_shown(near[0], hook)) if near else ""


def hook_name_notes(label: str, module) -> tuple[str, ...]:
    """A note for each optional hook (and DEFAULTS) the file does not define but defines a near name of."""
    if not hasattr(module, "__dict__"):
        return ()
    notes = []
    for hook in (*OPTIONAL, "DEFAULTS"):
        if hasattr(module, hook):
            continue
        for name in _lookalikes(module, hook):
            notes.append(f"{label} defines {_shown(name, hook)}, which is no hook oomtune calls: if it is meant as "
                         f"{_shown(hook, hook)}, rename it (the default is used in its place)")
    return tuple(notes)


__all__ = ["HOOKS", "did_you_mean", "hook_name_notes"]


# -- the default loss's first mistakes ------------------------------------------------------------------------

Batch = object  # (model_file.Batch: a Tensor, a tuple/list of Tensors, a dict of str -> Tensor)


def example(batch: Batch, logits_dims: int = 2, call: str = "model(x)") -> str:
    """A one-line loss hook for this batch's shape: (inputs, labels) pairs get one that calls the model as `call`
    does, other batches a template."""
    if isinstance(batch, (tuple, list)) and len(batch) == 2:
        if logits_dims > 2:  # (B, T, V): a language model's
            return f"def loss(model, batch): x, y = batch; return F.cross_entropy({call}.flatten(0, 1), y.flatten())"
        return f"def loss(model, batch): x, y = batch; return F.cross_entropy({call}, y)"
    return "def loss(model, batch): return F.cross_entropy(model(<the inputs>), <the labels>)"


@contextlib.contextmanager
def batch_taken(label: str, model: nn.Module, batch: Batch) -> Iterator[None]:
    """Around the default loss's call of the model: a TypeError where the model's forward cannot take the batch
    as the default passes it (a classifier's forward(x) given (x, y)) becomes the line that names the loss hook."""
    try:
        yield
    except TypeError as e:
        refusal = _refusal(model, batch)
        if refusal is None:
            raise
        raise ModelFileError(f"{label}: the default loss calls {refusal}: define loss(model, batch) to run the model "
                             f"and return the loss, e.g. `{example(batch)}`") from e


def _refusal(model: nn.Module, batch: Batch) -> str | None:
    """How the default loss's call does not fit the forward's signature, or None where it fits (the TypeError
    came from inside) or the signature cannot be read."""
    try:
        signature = inspect.signature(model.forward)
    except (TypeError, ValueError):
        return None
    if isinstance(batch, dict):
        args, kwargs, call = (), batch, f"model(**batch) with the keys {', '.join(map(repr, batch))}"
    elif isinstance(batch, (tuple, list)):
        args, kwargs, call = tuple(batch), {}, f"model(*batch) with the batch's {len(batch)} items"
    else:
        args, kwargs, call = (batch,), {}, "model(batch)"
    try:
        signature.bind(*args, **kwargs)
    except TypeError as e:
        return f"{call}, and {type(model).__name__}.forward{signature} refuses them ({e})"
    return None


def not_a_loss(label: str, value: torch.Tensor, batch: Batch, near: str = "") -> str:
    """The line for a default loss that gave a tensor of more than one value: the model's output, not a loss.
    `near`: a name the file defines that looks like the hook (`losses()`)."""
    shape = tuple(value.shape)
    if value.dim() == 1:
        looks = f"a tensor of shape {shape} (per-example losses? return their mean)"
    else:
        looks = f"what looks like logits, of shape {shape}"
    define = f"rename {near} to loss(), or define loss(model, batch)" if near else "define loss(model, batch)"
    return (f"{label}: the model returned {looks}, not a loss: training needs a loss, a scalar; {define} to compute "
            f"it, e.g. `{example(batch, value.dim(), 'model(x, y)')}`")


def check_first_loss(model_file, model: nn.Module, batch_of, fewer=None) -> None:
    """The default loss once on `batch_of()` (micro-batch 1, on the caller's fake tensors): a forward that refuses
    the batch, an output that is no loss, are said now, before any trial. An error inside the model's own code or
    make_batch's says nothing here (it may be the fake tensors'): the trials meet it, as they did. First inside
    `fewer()` (where given), where the model has fewer of its repeated blocks (checkpointing.runs_cut: the batch the
    forward takes and the loss it returns do not depend on how many; a failure only deeper in the stack is left to
    the trials, as one in the model's own code is); only where that forward fails does the whole model's run."""
    if model_file.has("loss"):
        return
    try:
        batch = batch_of()
    except OomtuneError:  # (make_batch's own errors: the trials say them)
        return
    model.train()
    if fewer is not None:
        with fewer():
            try:
                model_file.loss(model, batch)
                return
            except Exception:  # noqa: BLE001  (the whole model's forward says what is wrong, if anything is)
                pass
    try:
        model_file.loss(model, batch)
    except OomtuneError as e:  # (a value fake tensors do not have, NeedsValues: the trials compute it)
        if isinstance(e, ModelFileError) and not e.raised:
            raise
