"""The two consoles the command line prints to: results on stdout, progress and errors on stderr."""

from __future__ import annotations

import os
import sys

from rich.console import Console

from ..units import format_bytes

SIGPIPE_EXIT = 128 + 13  # what a shell reports for a program SIGPIPE ended


class _Console(Console):
    def on_broken_pipe(self) -> None:
        """stdout's reader left (`oomtune estimate ... | head`): stop quietly with the code a program SIGPIPE ended
        gets (rich's own exits 1, which reads as "does not fit")."""
        self.quiet = True
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # Python's flush at exit must not fail
        raise SystemExit(SIGPIPE_EXIT)


class _ProgressConsole(Console):
    def on_broken_pipe(self) -> None:
        """stderr's reader left (`2>&1 | head`, a log pipe or a `tee` that died): the progress goes nowhere from
        here and the work goes on (rich's own exits 1 at once: a training run died mid-step, its finished steps
        not saved). The run dir's logs and checkpoints still record it; the exit code is the work's."""
        self.quiet = True
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stderr.fileno())  # later writes (warnings, the file's prints)


out = _Console(highlight=False)
err = _ProgressConsole(stderr=True, highlight=False, soft_wrap=True)

RESULT_STYLE = {"fits": "green", "oom": "red", "over-headroom": "yellow"}
RESULT_SHORT = {"fits": "fits", "oom": "OOM", "over-headroom": ">limit"}  # >limit: ran, but ate the headroom


def rung_label(rung: str, precision: str) -> str:
    """A rung as every table, chart and progress line names it: its precision and what it adds ("bf16+ckpt")."""
    if rung.startswith(("chunked-loss", "step-in-backward")) and precision != "bf16-true":  # (names saying none)
        return f"{precision}+{rung}"
    return {"fp32": "fp32", "amp": precision, "checkpointing": f"{precision}+ckpt",
            "fsdp": f"{precision}+fsdp"}.get(rung, rung)


def rate_unit(context_length: int, long: bool = False) -> str:
    """What a speed counts: tokens, or examples where the model has no sequence (context 1: images)."""
    if context_length == 1:
        return "examples/s" if long else "ex/s"
    return "tokens/s" if long else "tok/s"


def fmt_bytes(n) -> str:
    return format_bytes(n)


def compiled(job) -> str:
    """What the header adds where every rung is compiled (--compile): the rung names in the progress lines do not
    say it."""
    from ..search.options import COMPILE

    return ", every rung compiled (torch.compile)" if COMPILE in job.options.get("levers", ()) else ""
