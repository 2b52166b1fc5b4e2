"""Names in a model file that look like a hook but are not one (`make_batches`, `optimiser`, `DEFAULT`).

A missing required hook is an error already; the near name goes into it. A misspelt optional hook is worse: the
default runs in its place with no word (an `optimiser()` returning SGD trained with AdamW), so the commands note
it (hook_name_notes)."""

from __future__ import annotations

import difflib

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
