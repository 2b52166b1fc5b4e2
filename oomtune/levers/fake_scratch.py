"""The 8-bit AdamW's chunk scratch on fake tensors, made from the first chunk of its kind instead of computed.

On the fake device a chunk of BlockwiseAdamW8bit's step (dequantize both moments, update, quantize them back: about
80 ops) computes nothing: all a trial measures of it is the storages its ops make and free, in order. A 7B full
fine-tune's step runs hundreds of such chunks, most of them alike, and they were two thirds of its trial's time. So
the first chunk of each kind (its rows, the parameter's and gradient's dtypes and device, whether it is a slice of
the parameter, whether the step runs in host memory) runs as on every device, watched, and each later chunk of that
kind is made from it (memory/made_calls.py: the same storages made with `torch.empty` and freed in the same order;
what the chunk writes marked as of unknown values). Real tensors and a memory snapshot's trial compute every chunk.
tests/levers/test_fake_scratch.py holds a trial's trace equal, event for event, to every chunk run.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ..memory.made_calls import MadeCalls, fake_call


class FakeScratch:
    """Per optimizer: its chunks' patterns (memory/made_calls.MadeCalls)."""

    def __init__(self):
        self.calls = MadeCalls()

    @staticmethod
    def kind(p: torch.Tensor, rows: int, whole: bool) -> tuple | None:
        """The chunk's kind, or None where it is computed (real tensors; a memory snapshot's trial)."""
        where = fake_call(p, p.grad) if p.grad is not None else None
        return (rows, p.dtype, p.grad.dtype, p.device, whole, *where) if where is not None else None

    def run(self, kind: tuple | None, chunk: Callable[[], None], written: tuple[torch.Tensor, ...] = ()) -> None:
        """chunk(), or its storages made from the first chunk of its `kind` (`written`: the tensors it writes in
        place, whose values, if any were known, are not after it)."""
        self.calls(kind, chunk, written=written)
