"""Where probe and estimate write their config (--out): checked before a single trial runs, and the train: section
of an oomtune config already there kept."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

from ..errors import OomtuneError
from ..files import nearest_existing, try_write_in, what_stands
from .loading import load_config
from .schema import Config, TrainConfig
from .writing import save_config


def check_out(out_path: Path, model: Path, command: str = "probe") -> Config | None:
    """--out, checked before a single trial runs (and again just before writing): not the model file; absent or an
    oomtune config of the same model file (never a folder, a device, a pipe, another model's config, a plan a probe
    measured that `command` estimate would replace, nor a file of yours that is anything else); in a folder that
    exists or can be made, and can be written. Returns the config already there, whose train: section the new
    config keeps (None when there is none)."""
    p = Path(out_path)
    if str(out_path) == "-":  # (not standard output: the command's own report is printed there)
        raise OomtuneError("--out -: the config is written to a file, not to standard output: name one (e.g. --out "
                           "best.yaml; --json prints the plan)")
    stands = what_stands(p)
    if stands not in (None, "a folder"):  # (never written through, nor read: a pipe would hang the check)
        instead = f"pass --out {p.resolve()} (where it points)" if "link" in stands else "name another file"
        raise OomtuneError(f"--out {p} is {stands}: oomtune writes no file through a link, nor into a pipe or a "
                           f"device; {instead}, or remove it")
    try:
        if p.resolve() == model.resolve() or (p.exists() and model.exists() and os.path.samefile(p, model)):
            raise OomtuneError(f"--out {p} is the model file: the config needs another name (e.g. --out best.yaml)")
        if p.is_dir():
            raise OomtuneError(f"--out {p} is a folder: name a file in it (e.g. --out {p / 'best.yaml'})")
        if p.exists() and not p.is_file():
            raise OomtuneError(f"--out {p} is not a regular file (a device, pipe or socket): name a file")
        existing = None
        if p.exists():
            try:
                existing = load_config(p)
            except (OomtuneError, ValueError) as e:  # not YAML, not a config, not text
                why = str(e).removeprefix(f"{p}: ")
                raise OomtuneError(f"--out {p} exists and is not an oomtune config ({why}): not overwriting it; "
                                   "choose another --out or move it away") from None
            except OSError as e:
                raise OomtuneError(f"--out {p} exists and cannot be read ({e.strerror or e})") from None
            theirs = Path(existing.model.source).name
            if theirs != model.name:
                raise OomtuneError(f"--out {p} is the config of {theirs}, not {model.name}: not replacing another "
                                   "model's plan; choose another --out or move it away")
            found = existing.found_by
            if command == "estimate" and found is not None and not found.estimated:
                raise OomtuneError(f"--out {p} holds a plan measured by probe on {found.gpu_name or found.device}, "
                                   f"{found.date[:10]}: not replacing it with an estimate; choose another --out (e.g. "
                                   "--out estimate.yaml) or move it away")
        folder = nearest_existing(p.absolute().parent)  # written with its missing folders made
        if not folder.is_dir():
            raise OomtuneError(f"--out {p}: {folder} is not a folder")
        try_write_in(folder)  # what the write will do
    except OSError as e:
        raise OomtuneError(f"--out {p}: cannot write there ({e.strerror or e})") from None
    return existing


def write_config(config: Config, out_path: Path, model: Path, header: str) -> tuple[bool, str | None]:
    """Write the config to --out, keeping the train: section of the oomtune config already there (read again now:
    it may have been edited while the search ran), its new plan and found_by replacing the old. Returns whether it
    kept one, and a note where it changed it: a plan that steps the optimizer in backward cannot clip (its
    clip_grad_norm is written null), and a later plan without that step gets clipping back, at the default."""
    existing = check_out(out_path, model, config.found_by.command if config.found_by is not None else "probe")
    train = existing.train if existing is not None else None
    note = None
    if config.plan.optimizer_in_backward:  # no clipping: each gradient is applied as backward makes it
        config = dataclasses.replace(config, train=dataclasses.replace(train or config.train, clip_grad_norm=None))
        train = None if train is None else config.train
    elif train is not None and train.clip_grad_norm is None and existing.plan.optimizer_in_backward:
        clip = TrainConfig().clip_grad_norm  # (its null was written for the plan it replaces, not by you)
        train = dataclasses.replace(train, clip_grad_norm=clip)
        note = (f"train.clip_grad_norm set back to {clip}: the plan in {out_path} stepped the optimizer in "
                "backward, which cannot clip, and this one can (set it to null for no clipping)")
    try:
        save_config(config if train is None else dataclasses.replace(config, train=train), out_path, header=header)
    except OSError as e:  # a full disk, a folder that went away or turned read-only during the search
        raise OomtuneError(f"cannot write the config to {out_path}: {e.strerror or e}") from None
    return train is not None, note
