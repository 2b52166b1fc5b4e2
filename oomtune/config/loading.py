"""Reading a config file strictly: YAML (a key given twice refused) into the schema's frozen dataclasses, where an
unknown key (named, with the allowed ones), a missing key or a wrong type is one ConfigError line."""

from __future__ import annotations

import dataclasses
import math
import re
import types
import typing
from dataclasses import fields
from pathlib import Path
from typing import Any, Literal

from ..errors import ConfigError, shown
from .schema import Config
from .text import parse

MAX_INT = 10**30  # the largest whole number a config may hold (its own checks say more below it)
_NUMBER = re.compile(r"[+-]?(\d+\.?\d*|\.\d+)([eE][+-]?\d+)?")  # what a float field takes written as a string


def _type_name(tp: Any) -> str:
    if typing.get_origin(tp) is Literal:
        return " | ".join(repr(a) for a in typing.get_args(tp))
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        return " or ".join(_type_name(a) for a in typing.get_args(tp))
    if dataclasses.is_dataclass(tp):  # a section (plan:, train:): what the file holds there, not the class's name
        return "a mapping of its keys"
    return "null" if tp is type(None) else getattr(tp, "__name__", str(tp))


def _convert(value: Any, tp: Any, where: str) -> Any:
    origin = typing.get_origin(tp)
    if origin is Literal:
        if value in typing.get_args(tp):
            return value
    elif origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        options = [a for a in args if a is not type(None)]
        if len(options) == 1:  # X | None: X's own error names the deepest key
            return _convert(value, options[0], where)
        for arg in options:
            try:
                return _convert(value, arg, where)
            except ConfigError:
                continue
    elif origin is tuple:
        (item_tp, _) = typing.get_args(tp)
        if isinstance(value, list):
            return tuple(_convert(v, item_tp, f"{where}[{i}]") for i, v in enumerate(value))
    elif origin is dict:
        (key_tp, value_tp) = typing.get_args(tp)
        if isinstance(value, dict):
            return {_convert(k, key_tp, where): _convert(v, value_tp, f"{where}.{k}") for k, v in value.items()}
    elif dataclasses.is_dataclass(tp):
        if isinstance(value, dict):
            return from_dict(tp, value, where)
    elif tp is type(None):
        if value is None:
            return None
    elif tp is bool:
        if isinstance(value, bool):
            return value
    elif tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            if abs(value) > MAX_INT:  # (no count or byte size oomtune writes is near it)
                raise ConfigError(f"{where}: {shown(value)} is too large")
            return value
    elif tp is float:
        number = value if isinstance(value, (int, float)) and not isinstance(value, bool) else None
        if isinstance(value, str) and _NUMBER.fullmatch(value.strip()):  # `lr: 3e-4`: YAML 1.1 reads a string
            number = value
        if number is not None:
            try:
                number = float(number)
            except OverflowError:  # (an int of hundreds of digits)
                number = math.inf
            return number  # (a NaN or an infinity: the section's own checks name what it must be)
    elif tp is str:
        if isinstance(value, str):
            return value
    raise ConfigError(f"{where}: expected {_type_name(tp)}, got {shown(value)}")


def from_dict(cls: type, data: dict, where: str = "") -> Any:
    """Build dataclass `cls` from a mapping; unknown keys, missing keys and wrong types are errors."""
    hints = typing.get_type_hints(cls)
    names = {f.name for f in fields(cls)}
    prefix = f"{where}." if where else ""
    for key in data:
        if key not in names:
            raise ConfigError(f"unknown key {prefix}{key} (allowed: {', '.join(sorted(names))})")
    kwargs = {}
    for f in fields(cls):
        if f.name in data:
            kwargs[f.name] = _convert(data[f.name], hints[f.name], f"{prefix}{f.name}")
        elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            raise ConfigError(f"missing key {prefix}{f.name}")
    return cls(**kwargs)


def config_from(data: dict) -> Config:
    """A Config from a parsed config file's mapping; `model: model.py`, as configs were first written, is read as
    {source: model.py}."""
    if isinstance(data.get("model"), str):
        data = {**data, "model": {"source": data["model"]}}
    return from_dict(Config, data)


def load_config(path: str | Path) -> Config:
    import yaml  # here, not at the top: trials and probes run where PyYAML is not installed (gpu-check)

    p = Path(path)
    if p.is_dir():
        raise ConfigError(f"{p} is a folder, not a config file")
    if not p.is_file():
        raise ConfigError(f"config file not found: {p}")
    if p.suffix == ".py":  # (its YAML error would say nothing of that)
        raise ConfigError(f"{p} is a Python file (a model file?), not a config: give the YAML config that `oomtune "
                          "probe` or `oomtune estimate` wrote (e.g. best.yaml)")
    try:
        data = parse(p.read_text(encoding="utf-8"))
    except UnicodeDecodeError as e:
        raise ConfigError(f"{p}: not a text file in UTF-8 (byte {e.start} is {e.object[e.start]:#04x})") from None
    except OSError as e:
        raise ConfigError(f"cannot read the config {p}: {e.strerror or e}") from None
    except RecursionError:  # (nesting the loader's own limit did not stop: a key's deep value)
        raise ConfigError(f"{p}: not a config: nested too deeply") from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        line = f" at line {mark.line + 1}" if mark else ""
        problem = f": {e.problem}" if getattr(e, "problem", None) else ""
        raise ConfigError(f"{p}: not valid YAML{line}{problem}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{p}: expected a mapping with keys model, plan, train")
    try:
        return config_from(data)
    except ConfigError as e:
        raise ConfigError(f"{p}: {e.message}") from None

