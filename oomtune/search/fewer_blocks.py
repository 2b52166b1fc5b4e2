"""The model with fewer of its repeated blocks: what a trial traces at k, k+1 and k+2 blocks so that the trace at all
N of them is made, not traced (memory/repeats.py).

The repeated blocks are the longest run of alike members at the end of the model's block stacks (checkpointing's:
a transformer's layers; T5's first layer, which holds the relative position bias, stays out of the run), alike
meaning the same classes, parameter and buffer shapes, dtypes and trainability, and the same flags (a hybrid's
layer type). Every stack with a run as long as the longest keeps k of its run. The model is built untracked and
truncated, then the tensors it keeps are counted, in the order the model holds them: the blocks cut never exist on
the device.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field

from torch import nn

from ..checkpointing import block_stacks
from ..memory.tracker import adopt, untracked
from ..model_file import ModelFile


def _signature(member: nn.Module) -> tuple:
    tensors = tuple((name, tuple(t.shape), t.dtype, getattr(t, "requires_grad", False))
                    for name, t in (*member.named_parameters(), *member.named_buffers()))
    flags = tuple((name, type(m).__name__, tuple(sorted((k, v) for k, v in vars(m).items()
                                                        if isinstance(v, (str, bool)) and not k.startswith("_"))))
                  for name, m in member.named_modules())
    return tensors, flags


def repeated_runs(model: nn.Module) -> list[tuple[nn.ModuleList, int]]:
    """(stack, where its run of alike members starts) for each stack whose run is as long as the longest; [] where
    no run has two members."""
    found = []
    for stack in block_stacks(model):
        signatures = [_signature(m) for m in stack]
        start = len(stack) - 1
        while start > 0 and signatures[start - 1] == signatures[-1]:
            start -= 1
        found.append((stack, start))
    longest = max((len(s) - start for s, start in found), default=0)
    return [(s, start) for s, start in found if len(s) - start == longest] if longest >= 2 else []


@dataclass(frozen=True)
class Stacks:
    """What a first build found: the repeated blocks' class, how many the stacks hold and where their runs start."""

    kind: type
    length: int
    start: int


@contextlib.contextmanager
def cut_when_made(stacks: Stacks, keep: int) -> Iterator[None]:
    """Inside, an nn.ModuleList made with the stacks' length of their blocks' class keeps `keep` of its run as it is
    made: what the model file does to the model next (PEFT wrapping every projection of every layer) is done to the
    blocks kept only. (A list filled after it is made is cut after the build.)"""
    made = nn.ModuleList.__init__

    def init(self, modules=None):
        made(self, modules)
        if len(self) == stacks.length and all(type(m) is stacks.kind for m in list(self)[stacks.start:]):
            del self[stacks.start + keep:]

    nn.ModuleList.__init__ = init
    try:
        yield
    finally:
        nn.ModuleList.__init__ = made


@dataclass
class FewerBlocks:
    """A model file whose model keeps `keep` of its repeated blocks (every hook else is the file's own). `repeated`:
    how many blocks the full model repeats, once a build has seen it (0: no run to cut). `seen`: what an earlier
    build found (cut_when_made then cuts the stacks as they are made); set by this build where it was None."""

    model_file: ModelFile
    keep: int
    seen: Stacks | None = None
    repeated: int | None = field(default=None, init=False)

    def __getattr__(self, name):
        return getattr(self.model_file, name)

    def build(self) -> nn.Module:
        cut = cut_when_made(self.seen, self.keep) if self.seen is not None else contextlib.nullcontext()
        with untracked():
            with cut:
                model = self.model_file.build()
            runs = repeated_runs(model)
            if self.seen is None:
                self.repeated = len(runs[0][0]) - runs[0][1] if runs else 0
                self.seen = Stacks(type(runs[0][0][-1]), len(runs[0][0]), runs[0][1]) if runs else None
            else:
                self.repeated = self.seen.length - self.seen.start
            for stack, start in runs:
                del stack[start + self.keep:]
        adopt(*model.parameters(), *model.buffers())
        return model
