"""The command line, the only code that prints: one rich Console for results (stdout), one for progress
and errors (stderr). Commands are thin: parse, call the library, render, map errors to exit codes."""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
import traceback
import warnings
from contextlib import contextmanager
from typing import Annotated

import typer
from rich.console import Console
from rich.markup import escape

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


def _drop_record(record: logging.LogRecord) -> bool:
    return False


def _quiet_torch_noise(debug: bool) -> None:
    """A model error on fake tensors makes torch log its own traceback (logger.exception) before raising; the
    one-line error says it all, so drop those records unless --debug. A filter, not a level: importing torch
    resets its loggers' levels, and the commands import torch after this runs."""
    log = logging.getLogger("torch._subclasses.fake_tensor")
    if debug:
        log.removeFilter(_drop_record)
    elif _drop_record not in log.filters:
        log.addFilter(_drop_record)
    # torch < 2.5 warns about its own deprecated torch.cpu.amp.autocast inside checkpoint() on every recompute
    warnings.filterwarnings("ignore", category=FutureWarning, module=r"torch\.utils\.checkpoint")


@app.callback()
def _root() -> None:
    """oomtune: probe, estimate, train and check PyTorch training configurations that fit in memory."""


DebugOpt = Annotated[bool, typer.Option("--debug/--no-debug", help="Show full tracebacks instead of one-line errors.")]


def worker_rank() -> int | None:
    """This process's rank when torchrun started it (its environment variables), else None."""
    if all(k in os.environ for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")):
        return int(os.environ["RANK"])
    return None


def _peer_failure(e: BaseException) -> bool:
    """A collective that broke or timed out: another rank failed, died or hangs (not this rank's own error)."""
    torch = sys.modules.get("torch")
    dist_error = getattr(getattr(torch, "distributed", None), "DistError", None) if torch else None
    if dist_error is not None and isinstance(e, dist_error):
        return True
    text = str(e)
    return worker_rank() is not None and any(s in text for s in (
        "Connection closed by peer", "Connection reset by peer", "Broken pipe", "Timed out", "timed out",
        "NCCL communicator was aborted", "[gloo/"))


_interrupted = False  # Ctrl-C came during this command (see _on_sigint)


def _on_sigint(signum, frame) -> None:
    """Python's own Ctrl-C, remembered: a KeyboardInterrupt raised while a finalizer runs (torch's storage
    weakrefs, in every trial) is printed and dropped by Python, and the search would go on to write its
    config. `stop_if_interrupted` turns the remembered one back into an interruption."""
    global _interrupted
    _interrupted = True
    raise KeyboardInterrupt


def stop_if_interrupted() -> None:
    """Between trials and before a file is written: a Ctrl-C that was swallowed still stops the command."""
    if _interrupted:
        raise KeyboardInterrupt


@contextmanager
def _remember_sigint():
    global _interrupted
    _interrupted = False
    own = threading.current_thread() is threading.main_thread() and \
        signal.getsignal(signal.SIGINT) is signal.default_int_handler  # not where Ctrl-C is ignored (nohup, &)
    previous = signal.signal(signal.SIGINT, _on_sigint) if own else None
    try:
        yield
    finally:
        if own:
            signal.signal(signal.SIGINT, previous)


@contextmanager
def user_errors(debug: bool):
    """One project error -> one line on stderr and its exit code; anything else -> a short line + exit 1. A
    worker on several ranks prefixes its rank, and exits 3 when it only stopped because a peer did."""
    rank = worker_rank()
    who = escape(f"[rank {rank}] ") if rank is not None else ""
    _quiet_torch_noise(debug)
    try:
        with _remember_sigint():
            yield
    except OomtuneError as e:
        if debug:
            raise
        err.print(f"[bold red]error:[/] {who}{escape(e.message)}")
        raise typer.Exit(e.exit_code) from None
    except KeyboardInterrupt:
        err.print("[yellow]interrupted[/]")
        raise typer.Exit(130) from None
    except (typer.Exit, typer.Abort):
        raise
    except Exception as e:
        if debug:
            raise
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        if rank is not None and _peer_failure(e):
            from ..errors import PEER_FAILED

            err.print(f"[bold red]error:[/] {who}a collective with the other ranks failed ({escape(first[:200])}): "
                      "another rank failed, died or stopped answering (--dist-timeout)")
            raise typer.Exit(PEER_FAILED) from None
        err.print(f"[bold red]error:[/] {who}{type(e).__name__}: {escape(first)} (rerun with --debug for the "
                  "traceback)")
        raise typer.Exit(1) from None


def fmt_bytes(n) -> str:
    return format_bytes(n)


RESULT_STYLE = {"fits": "green", "oom": "red", "over-headroom": "yellow"}
RESULT_SHORT = {"fits": "fits", "oom": "OOM", "over-headroom": ">limit"}  # >limit: ran, but ate the headroom


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
    from .. import parallel

    parallel.close()
    if isinstance(code, str):  # sys.exit("message")
        print(code, file=sys.stderr)
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code or 0)


# each module registers its commands on `app`
from . import gpus_cmd, probe_cmd, train_cmd  # noqa: E402, F401

from . import estimate_cmd  # noqa: E402, F401  # isort: skip
