"""`oomtune check`: the CI gate - does a config's plan still fit?"""

from __future__ import annotations

import json
from typing import Annotated

import typer

from ..config.schema import TRIAL_STEPS
from . import app
from .guard import print_json, stop_if_interrupted, user_errors
from .options import ConfigOpt, DebugOpt, JsonOpt, SnapshotOpt, budget_option, device_option
from .render import check_json, render_check, snapshot_written


@app.command()
def check(
    config_path: ConfigOpt,
    budget: Annotated[str | None, budget_option("with --gpu the card's memory, else the config's "
                                                "found_by.budget_bytes", "Memory to fit in; with a card at most "
                                                "its memory, and a percentage of it (80%)")] = None,
    device: Annotated[str, device_option("fake (default: no GPU, estimated) | cpu (real compute, simulated memory) | "
                                         "cuda (the real GPU).")] = "fake",
    gpu: Annotated[str | None, typer.Option("--gpu", help="fake / cpu: account like this card, in its memory unless "
                                            "--budget says otherwise (default: the card the config was found with, "
                                            "found_by.card, in the config's budget).")] = None,
    headroom: Annotated[float | None, typer.Option(help="Fraction of the budget kept free (default: the "
                                                   "config's).")] = None,
    margin: Annotated[str | None, typer.Option("--margin", help="fake / cpu. Default: the margin the config "
                                               "was estimated with; for a config probed on a GPU 512MiB+5%; for one "
                                               "probed on cpu 0 (with a card: the card's).")] = None,
    steps: Annotated[int, typer.Option(help="Optimizer steps to run, at least 2 (default 2: the optimizer state "
                                       "exists when the peak is read).")] = TRIAL_STEPS,
    memory_snapshot: SnapshotOpt = None,
    as_json: JsonOpt = False,
    debug: DebugOpt = False,
):
    """CI gate: re-measure the config's plan; exit 0 if it still fits, 1 if it no longer does, 2 for bad input.

    Example: [cyan]oomtune check --config best.yaml[/]
    """
    with user_errors(debug, as_json, searches=True):
        from ..api import check as run_check

        result = run_check(config_path, device=device, budget=budget, headroom=headroom, margin=margin, steps=steps,
                           gpu=gpu, memory_snapshot=memory_snapshot, before_writing=stop_if_interrupted)
        snapshot_written(memory_snapshot, result.plan)
        if as_json:
            print_json(json.dumps(check_json(result), indent=2))
        else:
            render_check(result, config_path)
        if not result.fits:
            raise typer.Exit(1)
