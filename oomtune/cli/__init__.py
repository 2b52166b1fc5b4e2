"""The command line, the only code that prints: one rich Console for results (stdout), one for progress and errors
(stderr). Commands are thin: parse, call the library, render, map errors to exit codes (guard.py). Each command is
a module; the options they share are defined once (options.py)."""

from __future__ import annotations

import os
import sys
import traceback

import typer

from ..dist.launch import worker_rank
from .usage import OneLineUsageErrors

app = typer.Typer(
    cls=OneLineUsageErrors,  # a command line that does not parse: one line and exit 2 (usage.py)
    help="Find the largest PyTorch training configuration that fits in GPU memory, then train with it.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode="rich",
)


def _print_version(asked: bool) -> None:
    if asked:
        from .. import __version__

        print(f"oomtune {__version__}")
        raise typer.Exit()


@app.callback()
def _root(version: bool = typer.Option(False, "--version", is_eager=True, callback=_print_version,
                                       help="Print oomtune's version and exit.")) -> None:
    """oomtune: probe, estimate, train and check PyTorch training configurations that fit in memory."""


def main() -> None:
    if worker_rank() is None:
        app()
        return
    # A rank ends with os._exit, after its process group is destroyed and its output flushed: interpreter
    # teardown after distributed work can abort (SIGABRT, "terminate called without an active exception") as C++
    # threads of torch.distributed are destroyed joinable, turning a finished rank into a failed one.
    code: int | str | None
    try:
        app()
        code = 0
    except SystemExit as e:
        code = e.code
    except KeyboardInterrupt:
        code = 130
    except BaseException:  # noqa: BLE001 - printed as Python would, then the same exit
        traceback.print_exc()
        code = 1
    from ..dist.group import close

    close()
    if isinstance(code, str):  # sys.exit("message")
        print(code, file=sys.stderr)
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code or 0)


# each module registers its command on `app`, in the order --help lists them
from . import probe_cmd, estimate_cmd, check_cmd, train_cmd, export_cmd, gpus_cmd, init_cmd  # noqa: E402, F401, I001  # isort: skip
