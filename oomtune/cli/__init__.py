"""The command line, the only code that prints: one rich Console for results (stdout), one for progress
and errors (stderr). Commands are thin: parse, call the library, render, map errors to exit codes."""

from __future__ import annotations

from contextlib import contextmanager
from typing import Annotated

import typer
from rich.console import Console

from ..errors import OomtuneError
from ..units import format_bytes

app = typer.Typer(
    help="Find the largest PyTorch training configuration that fits in GPU memory, then train with it.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode="rich",
)
out = Console(highlight=False)
err = Console(stderr=True, highlight=False, soft_wrap=True)



@app.callback()
def _root() -> None:
    """oomtune: probe, estimate, train and check PyTorch training configurations that fit in memory."""


DebugOpt = Annotated[bool, typer.Option("--debug", help="Show full tracebacks instead of one-line errors.")]


@contextmanager
def user_errors(debug: bool):
    """One project error -> one line on stderr and its exit code; anything else -> a short line + exit 1."""
    try:
        yield
    except OomtuneError as e:
        if debug:
            raise
        err.print(f"[bold red]error:[/] {e.message}")
        raise typer.Exit(e.exit_code) from None
    except KeyboardInterrupt:
        err.print("[yellow]interrupted[/]")
        raise typer.Exit(130) from None
    except (typer.Exit, typer.Abort):
        raise
    except Exception as e:
        if debug:
            raise
        err.print(f"[bold red]error:[/] {type(e).__name__}: {str(e).strip().splitlines()[0] if str(e) else ''} "
                  "(rerun with --debug for the traceback)")
        raise typer.Exit(1) from None


def fmt_bytes(n) -> str:
    return format_bytes(n)


RESULT_STYLE = {"fits": "green", "oom": "red", "over-headroom": "yellow"}
RESULT_SHORT = {"fits": "fits", "oom": "OOM", "over-headroom": ">limit"}  # >limit: ran, but ate the headroom


def main() -> None:
    app()


# each module registers its commands on `app`
from . import gpus_cmd, probe_cmd, train_cmd  # noqa: E402, F401

from . import estimate_cmd  # noqa: E402, F401  # isort: skip
