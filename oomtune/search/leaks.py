"""Tensors a model file keeps from one trial to the next (a module-level list it appends each batch or output to):
each trial's peak then counts what the trials before it left, the search reads the model as larger than it is
and plans too small a batch ("needs gradient accumulation ... lower --batch"), and training keeps growing too.

`LeakWatch` is told what each trial left alive after it let go of its memory (TrialResult.left_bytes); where trial
after trial leaves more, it says so: a note while the leftovers are small, and one line (exit 2) once they are a
share of the limit that moves the answer."""

from __future__ import annotations

from ..errors import ModelFileError
from ..units import format_bytes

TOLERATED = 0.01  # of the limit: leftovers below it are a note, above it the search is wrong (exit 2)
BOOKKEEPING = 4096  # a trial's leftovers below it are not counted: torch's own (a collective's result on several
# ranks left 512 B a trial), not a batch or an output


class LeakWatch:
    def __init__(self, label: str, limit_bytes: int):
        self.label, self.limit_bytes = label, limit_bytes
        self.left: list[int] = []  # bytes each trial left alive, in order

    def after(self, left_bytes: int) -> None:
        """Told after each trial; ModelFileError once two trials in a row left more and what they left, less the
        largest single share, passes the tolerated share of the limit."""
        self.left.append(left_bytes if left_bytes >= BOOKKEEPING else 0)
        if self.growing() and self._beyond_the_largest() > TOLERATED * self.limit_bytes:
            raise ModelFileError(f"{self.label} keeps tensors alive from one trial to the next: "
                                 f"{self._amounts()} (a module-level list the step or make_batch appends to?): "
                                 "each trial then measured the ones before it too, which is no plan; keep nothing "
                                 "of a step beyond it (log .item() or .detach().cpu(), not the tensors)")

    def _beyond_the_largest(self) -> int:
        """What the trials left, less the largest share (a one-time cache, as FSDP's first trial on ranks made)."""
        kept = [b for b in self.left if b > 0]
        return sum(kept) - max(kept, default=0)

    def growing(self) -> bool:
        """Two trials in a row, at least, each left more alive (a one-time cache, made once, is not a leak)."""
        return any(a > 0 and b > 0 for a, b in zip(self.left, self.left[1:], strict=False))

    def _amounts(self) -> str:
        said = [f"trial {i} left {format_bytes(b)}" for i, b in enumerate(self.left, 1) if b > 0]
        shown = said if len(said) <= 4 else [*said[:2], "...", *said[-2:]]
        return ", ".join(shown) + f": {format_bytes(sum(b for b in self.left if b > 0))} in all"

    def note(self) -> str | None:
        """The note for leftovers that grew but stayed under the tolerated share, else None."""
        if not self.growing():
            return None
        return (f"{self.label} keeps tensors alive from one trial to the next ({self._amounts()}): small enough here "
                "to leave the plan as measured, but training would keep growing too; keep nothing of a step beyond "
                "it")
