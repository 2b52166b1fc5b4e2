"""Standard output while a --json command runs: file descriptor 1 points at stderr, so whatever the model file writes
there (print, os.write(1, ...), sys.__stdout__, a child process, a logging handler) stays off the JSON, which goes
to a copy of the real stdout. Ranks launched meanwhile get the real stdout back: rank 0 prints the JSON."""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator

_REAL: list[int] = []  # the copy of the real stdout's descriptor, while descriptor 1 points at stderr


@contextlib.contextmanager
def descriptor_1_to_stderr() -> Iterator[object]:
    """Inside, descriptor 1 is stderr's and sys.stdout is sys.stderr; yields the stream the JSON is written to (the
    real stdout; under a test's runner, whose sys.stdout is no descriptor, that object itself)."""
    original = stdout = sys.stdout
    real = None
    try:
        if stdout.fileno() == 1:
            stdout.flush()
            real = os.dup(1)
            stdout = open(real, "w", closefd=False)  # noqa: SIM115 - closed below
            os.dup2(2, 1)
            _REAL.append(real)
    except (OSError, ValueError, AttributeError):  # (io.UnsupportedOperation is an OSError and a ValueError)
        real = None
    sys.stdout = sys.stderr
    try:
        yield stdout
    finally:
        sys.stdout = original
        if real is not None:
            for f in (sys.__stdout__, sys.stderr, stdout):
                with contextlib.suppress(OSError, ValueError, AttributeError):
                    f.flush()
            os.dup2(real, 1)
            _REAL.remove(real)
            stdout.close()
            os.close(real)


@contextlib.contextmanager
def real_stdout() -> Iterator[None]:
    """Inside, descriptor 1 is the real stdout again (processes started here inherit it: the ranks, whose rank 0
    prints the JSON); outside, back to stderr. Nothing where no redirection is on."""
    if not _REAL:
        yield
        return
    with contextlib.suppress(OSError, ValueError, AttributeError):
        sys.__stdout__.flush()
    os.dup2(_REAL[-1], 1)
    try:
        yield
    finally:
        os.dup2(2, 1)
