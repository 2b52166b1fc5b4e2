"""What a model file prints during a search, shown once: each trial builds the model and draws its batches again,
so a `print` in build_model or make_batch came out once a trial (17 times in one probe). Python-level prints only
(print, sys.stdout.write); oomtune's own output is not filtered."""

from __future__ import annotations

import io
import sys
from collections.abc import Iterator
from contextlib import contextmanager

from .console import err, out


class OnceEach(io.TextIOBase):
    """A text stream passing each distinct line to `stream` the first time it is written, counting the repeats."""

    def __init__(self, stream):
        super().__init__()
        self.stream = stream
        self.seen: set[str] = set()
        self.repeats = 0
        self._partial = ""

    def writable(self) -> bool:
        return True

    def write(self, text: str) -> int:
        self._partial += text
        *lines, self._partial = self._partial.split("\n")
        for line in lines:
            self._line(line)
        return len(text)

    def _line(self, line: str) -> None:
        if line in self.seen:
            self.repeats += 1
            return
        self.seen.add(line)
        self.stream.write(line + "\n")

    def flush(self) -> None:
        if self._partial:
            self._line(self._partial)
            self._partial = ""
        self.stream.flush()

    def fileno(self) -> int:
        return self.stream.fileno()

    @property
    def encoding(self):
        return getattr(self.stream, "encoding", "utf-8")


@contextmanager
def model_lines_once() -> Iterator[OnceEach]:
    """Inside, sys.stdout shows each distinct line once (oomtune's own results still go to the real stdout); after,
    one line on stderr says how many were left out."""
    before, pinned = sys.stdout, out._file  # (rich's console writes to sys.stdout as it is at each print)
    out.file = before
    once = OnceEach(before)
    sys.stdout = once
    try:
        yield once
    finally:
        once.flush()
        sys.stdout = before
        out._file = pinned
        if once.repeats:
            err.print(f"[dim](the model file printed {once.repeats} line(s) again, one trial after another: each "
                      "is shown once)[/]")
