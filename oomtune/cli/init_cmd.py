"""`oomtune init`: write a commented model-file template (from a Hugging Face folder or Hub id, or plain torch) for
users who need their own loss or data; never over a file that exists."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated

import typer

from . import app
from .console import err, out
from .guard import user_errors
from .options import DebugOpt


@app.command()
def init(
    model: Annotated[str | None, typer.Argument(help="A Hugging Face folder, config.json or hf:ORG/NAME to start "
                                                "from (default: a small plain-PyTorch transformer).")] = None,
    out_path: Annotated[Path, typer.Option("--out", "-o", help="The model file to write.")] = Path("model.py"),
    task: Annotated[str | None, typer.Option("--task", help="causal-lm | sequence-classification | seq2seq "
                                             "(default: from config.json).")] = None,
    debug: DebugOpt = False,
):
    """Write a model file to edit: every hook of the contract, commented.

    Example: [cyan]oomtune init ./my-llama --out llama.py[/] then [cyan]oomtune estimate llama.py --gpu rtx4090[/]
    """
    with user_errors(debug):
        from ..config.schema import ModelSection
        from ..errors import OomtuneError
        from ..files import atomic_write
        from ..models.template import hf_template, plain_template

        if out_path.exists() or out_path.is_symlink():
            raise OomtuneError(f"--out {out_path} exists: not overwriting it; name another file")
        if out_path.suffix != ".py":
            raise OomtuneError(f"--out {out_path}: a model file is a .py file")
        if model is None:
            text = plain_template(out_path.name)
        else:
            from ..models.hf import read_config, task_of
            from ..models.source import locate

            section = ModelSection(source=model, task=task)
            kind, where = locate(section)
            if kind != "hf":
                raise OomtuneError(f"{model}: init starts from a Hugging Face folder, config.json or hf:ORG/NAME")
            config = read_config(where, model)
            folder = where if where.is_dir() else where.parent
            source = model if section.on_hub else os.path.relpath(folder.resolve(), out_path.resolve().parent)
            try:
                text = hf_template(out_path.name, source, config, task_of(config, task, model))
            except ValueError as e:
                raise OomtuneError(f"{model}: no template for it: {e}") from None
        try:
            out_path.parent.mkdir(parents=True, exist_ok=True)
            atomic_write(out_path, text)
        except OSError as e:
            raise OomtuneError(f"--out {out_path}: cannot write it ({e.strerror or e})") from None
        err.print(f"wrote {out_path}: edit its hooks, then [cyan]oomtune estimate {out_path} --gpu NAME[/]")
        out.print(str(out_path), markup=False, highlight=False)
