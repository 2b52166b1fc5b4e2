"""`oomtune export`: a config's plan as another trainer takes it."""

from __future__ import annotations

from typing import Annotated

import typer
from rich.markup import escape

from . import app
from .console import err, out
from .guard import user_errors
from .options import ConfigOpt, DebugOpt

ToOpt = Annotated[str, typer.Option("--to", help="hf (TrainingArguments keyword arguments, JSON) | lightning "
                                    "(Trainer keyword arguments and the DataLoader batch size, JSON) | accelerate "
                                    "(an accelerate config, YAML) | torchtune (recipe overrides, key=value).")]
StrictOpt = Annotated[bool, typer.Option("--strict/--no-strict", help="Exit 2 when the target cannot express "
                                         "every plan key, or the model file's own optimizer(); what any training "
                                         "script sets (the sequence length, a DataLoader's batch size) is not "
                                         "refused (default: print what it can, name the rest on stderr).")]


@app.command()
def export(config_path: ConfigOpt, to: ToOpt, strict: StrictOpt = False, debug: DebugOpt = False):
    """Print what another trainer needs to run the config's plan.

    Example: [cyan]oomtune export --config best.yaml --to hf > training_args.json[/]
    """
    with user_errors(debug):
        from ..config.export import defines
        from ..config.export import export as make_export
        from ..config.loading import load_config
        from ..errors import OomtuneError
        from ..models.source import changed

        config = load_config(config_path)
        if not config.model.on_hub and (grown := changed(config.model, config_path)) is not None:
            raise OomtuneError(f"{grown}: its plan may not fit it; probe or estimate it again, or delete model.sha256 "
                               "from the config to export the plan as it is")
        model = config.model_path(config_path)
        wrapped = defines(model, "blocks") or (config.found_by is not None
                                               and config.found_by.checkpointing_via == "blocks")
        result = make_export(config.plan, to, model.name if defines(model, "optimizer") else None,
                             model.name if wrapped else None, model.name if defines(model, "loss") else None,
                             config.model)
        for line in result.in_your_code:
            err.print(f"[cyan]set in your code:[/] {escape(line)}")
        for line in result.unexpressed:
            err.print(f"[yellow]not expressed:[/] {escape(line)}")
        if strict and result.unexpressed:
            keys = ", ".join(line.split(":", 1)[0] for line in result.unexpressed)
            raise OomtuneError(f"--strict: {to} cannot express {keys} (each is named above)")
        out.print(result.text(), markup=False, highlight=False, soft_wrap=True)
