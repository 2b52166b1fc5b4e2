"""The trained model in the format users keep: a PEFT model's adapter (`adapter/`: adapter_config.json,
adapter_model.safetensors) or a Hugging Face model's `save_pretrained` folder (`model/`), written into the run dir at
the end of training (and at every checkpoint with train.save_adapter). Each is written whole into a new folder
beside it, then swapped in (a save cut short is undone by the next); only a folder oomtune wrote (its marker file)
is ever replaced."""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

from torch import nn

from ..errors import BAD_INPUT, OomtuneError

ADAPTER, MODEL = "adapter", "model"
MARKER = ".oomtune-saved"  # in each folder oomtune wrote: only such a folder is ever replaced


def check_ours(run_dir: Path) -> None:
    """Before training: an adapter/ or model/ in the run dir that oomtune did not write (no marker; a link, a file)
    is bad input, never replaced at the end of the run."""
    for kind in (ADAPTER, MODEL):
        there = run_dir / kind
        if there.is_symlink() or (there.exists() and not (there.is_dir() and (there / MARKER).is_file())):
            raise OomtuneError(f"run dir {run_dir} holds {kind}/, which oomtune did not write: training saves the "
                               f"trained {kind} there at the end; move it away, or pass another --run-dir", BAD_INPUT)


def _recover(run_dir: Path, kind: str, final: Path) -> None:
    """What a save cut short left: the previous folder put back where it was, the half-written ones removed."""
    for old in run_dir.glob(f".{kind}.old-*"):
        if not final.exists() and (old / kind).is_dir():
            (old / kind).rename(final)
        shutil.rmtree(old, ignore_errors=True)
    for new in run_dir.glob(f".{kind}.new-*"):
        shutil.rmtree(new, ignore_errors=True)


def kind_of(module: nn.Module) -> str | None:
    """ADAPTER for a PEFT model, MODEL for a transformers model, None for any other (a checkpoint is all it has)."""
    if type(module).__module__.startswith("peft.") and callable(getattr(module, "save_pretrained", None)):
        return ADAPTER
    if any(c.__name__ == "PreTrainedModel" for c in type(module).__mro__):
        return MODEL
    return None


def save_pretrained(module: nn.Module, run_dir: Path) -> Path | None:
    """Write `module` as `save_pretrained` does into run_dir/adapter or run_dir/model (None: neither kind)."""
    kind = kind_of(module)
    if kind is None:
        return None
    final = run_dir / kind
    _recover(run_dir, kind, final)
    check_ours(run_dir)
    fresh = Path(tempfile.mkdtemp(prefix=f".{kind}.new-", dir=run_dir))
    old = None
    try:
        module.save_pretrained(str(fresh), safe_serialization=True)
        (fresh / MARKER).write_text("written by oomtune train: replaced by the next save\n")
        if final.exists():
            old = Path(tempfile.mkdtemp(prefix=f".{kind}.old-", dir=run_dir))
            final.rename(old / kind)
        try:
            fresh.rename(final)
        except OSError:
            if old is not None:  # the previous one back where it was
                (old / kind).rename(final)
            raise
    finally:
        if fresh.exists():
            shutil.rmtree(fresh, ignore_errors=True)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    return final


def after_checkpoint(module: nn.Module, run_dir: Path, reason: str, every_checkpoint: bool, plan, dist) -> Path | None:
    """At the end of training (and at every checkpoint where `every_checkpoint`), rank 0 saves the model as users
    keep it; a sharded (FSDP) run keeps its DCP checkpoint only."""
    if not dist.is_main or plan.sharding == "fsdp" or not (reason == "final" or every_checkpoint):
        return None
    return save_pretrained(module, run_dir)
