"""How a command ends: one project error is one line on stderr and its exit code, anything else a short line and
exit 1 (a full traceback with --debug); Ctrl-C is remembered even where Python drops it; a worker on several
ranks prefixes its rank and exits 3 when it only stopped because a peer did."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import sys
import threading
import traceback
import warnings
from contextlib import contextmanager

import typer
from rich.markup import escape

from ..dist.launch import worker_rank
from ..errors import PEER_FAILED, OomtuneError, capped, first_line
from .console import err, out
from .model_output import model_lines_once
from .stdio import descriptor_1_to_stderr


def _drop_record(record: logging.LogRecord) -> bool:
    return False


# libraries a model file brings whose one-time warnings (deprecations, "Failed to load" an optional kernel) are noise
# in every command's output; --debug shows them. torch.utils._pytree warns when one of them registers a constant the
# old way.
LIBRARIES = ("transformers", "peft", "torchao", "accelerate", "bitsandbytes", "huggingface_hub", "tokenizers")
LIBRARY_LOGGERS = ("torchao", "peft", "accelerate", "bitsandbytes", "huggingface_hub", "torch.utils._pytree")


def _library_quiet(record: logging.LogRecord) -> bool:
    """Keep a record unless a library's logger (or one of its modules' loggers) made it below ERROR."""
    return record.levelno >= logging.ERROR or not any(
        record.name == name or record.name.startswith(name + ".") for name in LIBRARY_LOGGERS)


def _quiet_libraries(debug: bool) -> None:
    """Library warnings off unless --debug: Python warnings raised in their modules, their loggers' records below
    ERROR (transformers through its own TRANSFORMERS_VERBOSITY, read when it is imported, and its API where it was).
    A logger's filter only sees the records made on that very logger, and a library logs on its modules' own
    (bitsandbytes' CPU backend says "Failed to load CPU gemm_4bit_forward" on its import on a CPU with AVX512-BF16,
    on bitsandbytes.backends.cpu.ops), so the filter is also on the handlers those records reach: the root's,
    the libraries' own and logging's last resort, which writes them to stderr where nothing is configured."""
    handlers = [logging.lastResort, *logging.getLogger().handlers]
    for name in LIBRARY_LOGGERS:
        log = logging.getLogger(name)
        handlers += log.handlers
        (log.removeFilter if debug else log.addFilter)(_library_quiet)
    for handler in handlers:
        if handler is not None:
            (handler.removeFilter if debug else handler.addFilter)(_library_quiet)
    if debug:
        return
    warnings.filterwarnings("ignore", module=rf"({'|'.join(LIBRARIES)})(\.|$)")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    hf_logging = sys.modules.get("transformers.utils.logging")
    if hf_logging is not None:
        hf_logging.set_verbosity_error()


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
    if not debug:  # copy.deepcopy of a module built on fake tensors (nn.TransformerEncoder's layers) reads this
        warnings.filterwarnings("ignore", message="Accessing the data pointer of FakeTensor", category=UserWarning)
        # nn.TransformerEncoder's fast path (enable_nested_tensor, in eval) says so on every run
        warnings.filterwarnings("ignore", message="The PyTorch API of nested tensors is in prototype stage",
                                category=UserWarning)


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


_interrupted = 0  # the signal (SIGINT: Ctrl-C, SIGTERM) that came during this command (see _on_signal)


def _on_signal(signum, frame) -> None:
    """Ctrl-C (or SIGTERM: a scheduler, `timeout`, `kill`) as Python's own Ctrl-C, remembered: a KeyboardInterrupt
    raised while a finalizer runs (torch's storage weakrefs, in every trial) is printed and dropped by Python, and
    the search would go on to write its config. `stop_if_interrupted` turns the remembered one back into an
    interruption. Training installs its own handlers over these (train/signals.py: it checkpoints first)."""
    global _interrupted
    _interrupted = signum
    raise KeyboardInterrupt


def stop_if_interrupted() -> None:
    """Between trials and before a file is written: a Ctrl-C that was swallowed still stops the command."""
    if _interrupted:
        raise KeyboardInterrupt


@contextmanager
def _remember_signals():
    global _interrupted
    _interrupted = 0
    main = threading.current_thread() is threading.main_thread()
    defaults = {signal.SIGINT: signal.default_int_handler}
    if worker_rank() is None:  # (a rank: the launcher's agent stops the others with SIGTERM, and reads -15 so)
        defaults[signal.SIGTERM] = signal.SIG_DFL
    own = {sig: signal.signal(sig, _on_signal) for sig, default in defaults.items()  # not where a signal is
           if main and signal.getsignal(sig) is default}  # ignored (nohup, &) or someone else handles it
    try:
        yield
    finally:
        for sig, previous in own.items():
            signal.signal(sig, previous)


@contextmanager
def user_errors(debug: bool, as_json: bool = False, searches: bool = False):
    """One project error -> one line on stderr and its exit code; anything else -> a short line + exit 1; with
    `debug` the traceback first, and the same line and code; with `as_json` (--json) also {"error", "exit_code"} on
    stdout, where a script parses the result. A worker on several ranks prefixes its rank, and exits 3 when it only
    stopped because a peer did. `searches` (probe, estimate, check: trials build the model again and again): what
    the model file prints is shown a line once."""
    rank = worker_rank()
    who = escape(f"[rank {rank}] ") if rank is not None else ""
    _quiet_torch_noise(debug)
    _quiet_libraries(debug)
    with _json_alone_on_stdout() if as_json else contextlib.nullcontext(), \
            model_lines_once() if searches else contextlib.nullcontext():
        yield from _reporting_errors(debug, as_json, rank, who, searches)


_json_stdout: list = []  # under --json, the real stdout (sys.stdout is stderr meanwhile)


@contextmanager
def _json_alone_on_stdout():
    """--json: what the model file prints goes to stderr, so stdout holds the JSON alone (print_json); see stdio.py."""
    with descriptor_1_to_stderr() as stdout:
        _json_stdout.append(stdout)
        try:
            yield
        finally:
            _json_stdout.pop()


def print_json(text: str) -> None:
    """--json's output: to the real stdout, where a script parses it."""
    print(text, file=_json_stdout[-1] if _json_stdout else sys.stdout, flush=True)


def _reporting_errors(debug: bool, as_json: bool, rank, who: str, searches: bool = False):
    try:
        if searches:  # OOMTUNE_PROCESSES read (a bad value refused) before the model file loads
            from ..search.fan_out import cores

            cores()
        with _remember_signals():
            yield
    except OomtuneError as e:
        if debug:  # the traceback, then the same line and exit code as without --debug (2: bad input)
            traceback.print_exc()
        message = capped(e.message)
        err.print(f"[bold red]error:[/] {who}{escape(message)}")
        _json_error(as_json, message, e.exit_code)
        raise typer.Exit(e.exit_code) from None
    except KeyboardInterrupt:
        terminated = _interrupted == signal.SIGTERM
        err.print(f"[yellow]{'terminated (SIGTERM)' if terminated else 'interrupted'}[/]")
        code = 128 + (signal.SIGTERM if terminated else signal.SIGINT)
        _json_error(as_json, "terminated" if terminated else "interrupted", code)
        raise typer.Exit(code) from None
    except (typer.Exit, typer.Abort):
        raise
    except BrokenPipeError:  # stdout's reader left (`| head`) while print() wrote: as the console does
        out.on_broken_pipe()
    except Exception as e:
        if debug:
            traceback.print_exc()
        first = capped(first_line(e, ""))
        if rank is not None and _peer_failure(e):
            err.print(f"[bold red]error:[/] {who}a collective with the other ranks failed ({escape(first[:200])}): "
                      "another rank failed, died or stopped answering (--dist-timeout)")
            raise typer.Exit(PEER_FAILED) from None
        err.print(f"[bold red]error:[/] {who}{type(e).__name__}: {escape(first)}" +
                  ("" if debug else " (rerun with --debug for the traceback)"))
        _json_error(as_json, f"{type(e).__name__}: {first}", 1)
        raise typer.Exit(1) from None


def _json_error(as_json: bool, message: str, code: int) -> None:
    if as_json:
        print_json(json.dumps({"error": message, "exit_code": code}, indent=2))
