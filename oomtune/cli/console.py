"""The two consoles the command line prints to: results on stdout, progress and errors on stderr."""

from __future__ import annotations

from rich.console import Console

from ..units import format_bytes

out = Console(highlight=False)
err = Console(stderr=True, highlight=False, soft_wrap=True)

RESULT_STYLE = {"fits": "green", "oom": "red", "over-headroom": "yellow"}
RESULT_SHORT = {"fits": "fits", "oom": "OOM", "over-headroom": ">limit"}  # >limit: ran, but ate the headroom


def fmt_bytes(n) -> str:
    return format_bytes(n)
