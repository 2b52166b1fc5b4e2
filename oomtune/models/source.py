"""What a MODEL argument names, and the model built from it: a model file (.py), a Hugging Face folder (config.json,
weights optional), a config.json, or hf:ORG/NAME[@REVISION]; with the arguments that shape it (task, dtype,
padding, LoRA, the model file's ARGS). The ModelSection a config records says all of it, with the sha256 of the file
it came from, so `check`, `train` and `export` rebuild the same model, or refuse one whose source changed."""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Mapping
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from ..config.schema import ModelSection
from ..errors import ConfigError, ModelFileError
from ..model_file import ModelFile, checked, load_model_file
from .hf import HFModel, hub_folder, read_config, task_of
from .lora import check_targets

HF_ONLY = ("task", "dtype", "padding")  # arguments only a Hugging Face model takes


def sha256_of(path: Path) -> str | None:
    try:
        return hashlib.sha256(path.read_bytes()).hexdigest()
    except OSError:
        return None


def hashed_file(path: Path) -> Path:
    """The file whose hash a config records: the model file, or the Hugging Face model's config.json."""
    return path / "config.json" if path.is_dir() else path


def locate(section: ModelSection, config_path: Path | None = None, weights: bool = False) -> tuple[str, Path]:
    """("file" | "hf", the model file / the folder or config.json), with what is wrong with it as one line."""
    if section.on_hub:
        return "hf", hub_folder(section.source, weights)
    p = section.path(config_path)
    if p.is_dir():
        if not (p / "config.json").is_file():
            raise ModelFileError(f"{section.source}: a folder with no config.json (a Hugging Face model's folder has "
                                 "one; a model file is a .py file)")
        return "hf", p
    if p.suffix == ".json" and p.is_file():
        return "hf", p
    return "file", p


def open_model(model: str | Path | ModelSection, *, config_path: str | Path | None = None, verify: bool = False,
               load_weights: bool = False) -> ModelFile:
    """The model `model` names, with its arguments. `config_path`: a relative source is taken from its folder;
    `verify`: a source whose sha256 is not the one recorded is refused before anything is built; `load_weights`: a
    Hugging Face folder's weights are loaded (training), not only its config."""
    section = model if isinstance(model, ModelSection) else ModelSection(source=str(model))
    where = Path(config_path) if config_path is not None else None
    kind, path = locate(section, where, weights=load_weights)
    now = sha256_of(hashed_file(path))
    if verify and changed(section, where, kind, now) is not None:
        raise ConfigError(f"{changed(section, where, kind, now)}: probe or estimate it again, or delete model.sha256 "
                          "from the config to use it as it is now")
    label = section.source if section.on_hub else path.name if path.name != "config.json" else path.parent.name
    if kind == "file":
        given = [name for name in HF_ONLY if getattr(section, name) not in (None, False)]
        if given:
            raise ModelFileError(f"{path.name}: --{given[0]} is for a Hugging Face model (a folder with a "
                                 "config.json), not a model file")
        model_file = load_model_file(path)
        args = with_args(model_file, section.args)
    else:
        if section.args:
            raise ModelFileError(f"{label}: --model-arg is for a model file's ARGS; a Hugging Face model's shape is "
                                 "its config.json")
        config = read_config(path, label)
        task = task_of(config, section.task, label)
        hooks = HFModel(config, task, path if path.is_dir() else None, section.dtype, section.padding,
                        load_weights, name=section.source if section.on_hub else str(path.resolve()))
        model_file = checked(hooks, path if path.is_dir() else path.parent)
        section = dataclasses.replace(section, task=task, lora=resolved_lora(section.lora, config.model_type))
        args = None
    source = section.source if section.on_hub else str(path.resolve())
    model_file.args = args
    model_file.section = dataclasses.replace(section, source=source, sha256=now, args=args or {})
    check_targets(model_file)
    return model_file


def resolved_lora(lora, model_type: str):
    """LoRA as a config records it: alpha and the targets PEFT would choose written out (None: no LoRA)."""
    if lora is None:
        return None
    targets = lora.targets
    if not targets:
        try:
            from peft.utils.constants import TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING as defaults
        except ImportError:  # (building the model says peft is missing)
            defaults = {}
        targets = tuple(defaults.get(model_type, ()))
    return dataclasses.replace(lora, alpha=2.0 * lora.r if lora.alpha is None else lora.alpha, targets=targets)


def changed(section: ModelSection, config_path: Path | None, kind: str | None = None,
            now: str | None = None) -> str | None:
    """What has changed where the config's model source's sha256 is no longer the one it recorded (None: the same,
    or nothing recorded, or nothing there to read)."""
    if section.sha256 is None:
        return None
    if kind is None:
        kind, path = locate(section, config_path)
        now = sha256_of(hashed_file(path)) if path.exists() else None
    if now is None or now == section.sha256:
        return None
    what = "config.json" if kind == "hf" else "model file"
    return f"{config_path or 'the config'}: the {what} of {section.source} has changed since this config was written"


def with_args(model_file: ModelFile, given: Mapping[str, Any]) -> dict[str, Any] | None:
    """The model file's ARGS with `given` over them, each given value of its default's type (a string from the
    command line converted)."""
    if model_file.args is None:
        if given:
            raise ModelFileError(f"{model_file.label}: --model-arg {next(iter(given))}: the model file declares no "
                                 "ARGS (ARGS = {'name': default, ...}, passed to build_model(**ARGS))")
        return None
    args = dict(model_file.args)
    for key, value in given.items():
        if key not in args:
            raise ModelFileError(f"{model_file.label}: --model-arg {key}: ARGS has no {key!r} (it has: "
                                 f"{', '.join(sorted(args)) or 'none'})")
        args[key] = _typed(value, args[key], f"{model_file.label}: --model-arg {key}")
    return args


def _typed(value: Any, default: Any, where: str) -> Any:
    kind = type(default)
    if isinstance(value, kind) and not (kind is int and isinstance(value, bool)) or kind is float and \
            isinstance(value, int) and not isinstance(value, bool):
        return kind(value)
    if isinstance(value, str):
        text = value.strip()
        try:
            if kind is bool and text.lower() in ("true", "false", "1", "0", "yes", "no"):
                return text.lower() in ("true", "1", "yes")
            if kind in (int, float):
                return kind(text)
        except ValueError:
            pass
        if kind is str:
            return value
    raise ModelFileError(f"{where}: expected {kind.__name__} (its default is {default!r}), got {value!r}")


def model_file_of(model) -> ModelFile:
    """A model from a path (a model file, a Hugging Face folder or config.json, hf:ORG/NAME), a ModelSection, or a
    module or object that has the hooks (a notebook's namespace, a class instance, a dict of them by name): a module
    imported from a file keeps that file's path (a config written for it names the file); another object is
    labelled by its type and cannot be named in a config `oomtune train` loads."""
    if isinstance(model, ModelFile):
        return model
    if isinstance(model, (str, Path, ModelSection)):
        return open_model(model)
    if isinstance(model, Mapping):  # {"build_model": ..., "make_batch": ...}: the hooks by name
        unknown = sorted(str(k) for k in model if not (isinstance(k, str) and k.isidentifier()))
        if unknown:
            raise ModelFileError(f"<dict>: the hooks are named by strings like 'build_model', got {unknown[0]}")
        return checked(SimpleNamespace(**model), Path("<dict>"))
    file = getattr(model, "__file__", None)
    if isinstance(file, str) and file.endswith(".py"):
        path = Path(file).resolve()
        model_file = checked(model, path)
        model_file.section = ModelSection(source=str(path), sha256=sha256_of(path), args=model_file.args or {})
        return model_file
    return checked(model, Path(f"<{getattr(model, '__name__', type(model).__name__)}>"))
