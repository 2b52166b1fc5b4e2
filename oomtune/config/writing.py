"""Writing a config file: YAML with a comment on every key, atomically, the model path relative where the project's
folder allows, the sections a person wrote kept as written; and the plan rewrite after an out-of-memory fallback,
which edits only the plan's numbers."""

from __future__ import annotations

import dataclasses
import os
import re
from dataclasses import fields
from pathlib import Path
from typing import Any

import yaml

from ..errors import ConfigError, OomtuneError
from ..files import atomic_write, refuse_unless_file
from .loading import config_from, load_config
from .schema import Config, Plan
from .text import COMMENTS, keep_unchanged_text, parse


def _scalar(v: Any) -> str:
    import yaml

    return yaml.safe_dump(v, default_flow_style=True, width=10_000, sort_keys=False).strip().removesuffix("...").strip()


def _emit(obj: Any, path: str, indent: int, lines: list[str]) -> None:
    pad = "  " * indent
    for f in fields(obj):
        v = getattr(obj, f.name)
        key = f"{path}{f.name}"
        comment = f"  # {COMMENTS[key]}" if key in COMMENTS else ""
        if key.startswith("model.") and (v is None or v == {} or (v is False and f.name == "padding")):
            continue  # (the model's arguments a config records only where they were given)
        if dataclasses.is_dataclass(v):
            lines.append(f"{pad}{f.name}:{comment}")
            _emit(v, f"{key}.", indent + 1, lines)
        elif isinstance(v, tuple):
            if not v:
                lines.append(f"{pad}{f.name}: []{comment}")
                continue
            lines.append(f"{pad}{f.name}:{comment}")
            for item in v:
                lines.append(f"{pad}- {_scalar(to_dict(item))}")
        else:
            lines.append(f"{pad}{f.name}: {_scalar(v)}{comment}")


def to_dict(obj: Any) -> Any:
    """A dataclass as plain dicts/lists (tuples become lists), for JSON and YAML."""
    if dataclasses.is_dataclass(obj):
        return {f.name: to_dict(getattr(obj, f.name)) for f in fields(obj)}
    if isinstance(obj, (tuple, list)):
        return [to_dict(v) for v in obj]
    return obj


def dump_config(config: Config, header: str = "") -> str:
    lines = [f"# {h}" for h in header.splitlines()] if header else []
    _emit(config, "", 0, lines)
    return "\n".join(lines) + "\n"


def save_config(config: Config, path: str | Path, header: str = "") -> None:
    """Write atomically; an absolute model path is stored relative to the config's folder (`../models/m.py`)
    where the two share a folder at least two levels below the root (a project's folder, not just /tmp or /home),
    so a config committed with its model works in any clone. Only a regular file is replaced, never a link, a
    device node or a folder (the CLI checks --out before the search too)."""
    p = Path(path)
    refuse_unless_file(p)  # a link, a pipe, a device, a folder: never written through
    model, folder = Path(config.model.source), p.resolve().parent
    if not config.model.on_hub and model.is_absolute() and \
            len(Path(os.path.commonpath([model, folder])).parts) >= 3:  # /work/proj, not /tmp
        config = dataclasses.replace(config, model=dataclasses.replace(config.model,
                                                                       source=os.path.relpath(model, folder)))
    text = dump_config(config, header)
    try:  # each section a person wrote stays as they wrote it, comments included, where its values are kept
        text = keep_unchanged_text(p.read_text(), text) if p.is_file() else text
    except (OSError, UnicodeDecodeError):
        pass
    atomic_write(p, text)



_PLAN_KEY = re.compile(r"^(\s+)(micro_batch_size|grad_accum_steps|global_batch_size)(\s*:\s*)(\d+)(.*)$")


class NotRewritten(OomtuneError):
    """The config file was left as it is (an OOM fallback's plan not written back), and why."""


def rewrite_plan(path: Path, started: Plan, plan: Plan, note: str) -> Config:
    """Write `plan` into the config file as it is on disk now, atomically, changing only the plan: every other key
    (an `lr:` edited while the run went on) stays as the file has it. The numbers are edited in place where the file
    has the block layout `oomtune probe` writes, so a person's comments survive; the result is read back and must
    equal the intended config, else the file is written out fresh (its unchanged sections kept as written). Where
    the file's plan is no longer `started` (the plan this run started from: a newer probe's, a hand edit), or the file
    no longer reads as a config, or a link stands there, nothing is written: NotRewritten says why. -> the config
    the file now holds."""
    try:
        refuse_unless_file(path)
        current = load_config(path)
        text = path.read_text(encoding="utf-8")
    except (OomtuneError, OSError, UnicodeDecodeError) as e:
        raise NotRewritten(f"{path} was not updated: {str(e).removeprefix(f'{path}: ')}") from None
    if current.plan != started:
        raise NotRewritten(f"{path} was not updated: its plan is no longer the one this run started from (a newer "
                           "probe's, or edited during the run), so it is left as it is")
    want = dataclasses.replace(current, plan=plan)
    lines, in_plan = text.splitlines(keepends=True), False
    for i, line in enumerate(lines):
        if re.match(r"^plan\s*:\s*(#.*)?$", line):
            in_plan = True
        elif in_plan and re.match(r"^[^\s#]", line):
            in_plan = False  # the next top-level key
        elif in_plan and (m := _PLAN_KEY.match(line.rstrip("\r\n"))):
            lines[i] = f"{m[1]}{m[2]}{m[3]}{getattr(plan, m[2])}{m[5]}\n"
    edited = f"# {note}\n" + "".join(lines)
    try:
        same = config_from(parse(edited)) == want
    except (ConfigError, yaml.YAMLError):
        same = False
    atomic_write(path, edited if same else keep_unchanged_text(text, dump_config(want, header=note)))
    return want
