"""The model with fewer of its repeated blocks: what a trial traces at k, k+1 and k+2 blocks so that the trace at all
N of them is made, not traced (memory/repeats.py).

The repeated blocks are the longest run of alike members at the end of the model's block stacks (checkpointing's: a
transformer's layers; T5's first layer, which holds the relative position bias, stays out of the run), alike meaning
the same classes, parameter and buffer shapes, dtypes and trainability, and the same settings (a hybrid's layer type,
a local layer's window; a layer's index apart: checkpointing._signature).
Every stack with a run as long as the longest keeps k of its run. The whole model's static build finds them
(StaticMemory.repeated_blocks), or else a first build, untracked; every fewer-block build is then tracked as the
whole model's is, with the blocks it cuts never built (cut_when_made): the blocks cut never exist on the device, and
the build's own temporaries are in the trace.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterator
from dataclasses import dataclass, field

from torch import nn

from ..checkpointing import repeated_runs
from ..memory.tracker import adopt, untracked
from ..model_file import ModelFile


@dataclass
class Stacks:
    """What a first build found: the repeated blocks' class, how many the stacks hold and where their runs start;
    `cut`: False once a build made them otherwise than by constructing each block (NotCut)."""

    kind: type
    length: int
    start: int
    cut: bool = True


CONTAINERS = (nn.ModuleList, nn.ModuleDict, nn.Sequential)  # blocks that are themselves containers (vit-pytorch's)


class NotCut(Exception):
    """The stacks were not made as the first build made them (blocks copied, not constructed; another count): the
    fewer-block trial cannot be traced as the whole model's would be, and the trial runs whole."""


@contextlib.contextmanager
def cut_when_made(stacks: Stacks, keep: int) -> Iterator[weakref.WeakSet]:
    """Inside, a stack of the blocks' class keeps `keep` of its run as it is made, and the blocks it will not keep
    are never built: each is a bare nn.Module of the class (its own __init__ not run: a 7B Llama's 30 cut layers
    cost their construction on fake tensors, about as much as the kept layers' steps) until the stack is made and
    cuts it. What the model file does to the model next (PEFT wrapping every projection of every layer) is done to
    the blocks kept only, and the build traces as the whole model's does, one period a block kept (its temporaries
    included, which the caching allocator model's state after the build depends on). Blocks are counted as they are
    constructed, from each stack made to the next; a stack made of another count of them raises NotCut (and code
    that reads a cut block before its stack is made fails: the trial then runs whole)."""
    made = nn.ModuleList.__init__
    kind = stacks.kind
    own_init = kind.__dict__.get("__init__")
    constructed = [0]
    limit = stacks.start + keep
    bare: weakref.WeakSet = weakref.WeakSet()  # (yielded) the blocks never built, while anything holds one

    def block_init(self, *args, **kwargs):
        def run():
            if own_init is None:
                return super(kind, self).__init__(*args, **kwargs)
            return own_init(self, *args, **kwargs)

        if type(self) is not kind:  # (a subclass's super().__init__)
            return run()
        constructed[0] += 1
        if constructed[0] <= limit:
            return run()
        nn.Module.__init__(self)  # a block the stack will not keep: never built
        bare.add(self)

    def init(self, modules=None):
        made(self, modules)
        if len(self) == stacks.length and all(type(m) is kind for m in list(self)[stacks.start:]):
            if constructed[0] != stacks.length:
                stacks.cut = False
                raise NotCut(f"{stacks.length} blocks in the stack, {constructed[0]} constructed")
            del self[limit:]
            constructed[0] = 0

    if issubclass(kind, CONTAINERS):  # (its __init__ is the stack's own: nothing to count blocks by)
        stacks.cut = False
        raise NotCut(f"the blocks are {kind.__name__}s")
    try:
        nn.ModuleList.__init__ = init
        kind.__init__ = block_init
        yield bare
        if constructed[0]:  # a stack not made of them as counted (filled after it was made, another length)
            stacks.cut = False
            raise NotCut(f"{constructed[0]} blocks constructed after the last stack was made")
    finally:
        nn.ModuleList.__init__ = made
        if own_init is None:
            del kind.__init__
        else:
            kind.__init__ = own_init


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
        """The model with `keep` blocks. The first build (nothing seen yet) finds the stacks on a whole model built
        untracked; then, where there is a run to cut, the model is built again, tracked, cut as it is made."""
        if self.seen is None:
            with untracked():
                model = self.model_file.build()
                runs = repeated_runs(model)
            self.seen = Stacks(type(runs[0][0][-1]), len(runs[0][0]), runs[0][1]) if runs else None
            if self.seen is None:
                self.repeated = 0
                adopt(*model.parameters(), *model.buffers())
                return model
            del model, runs
        self.repeated = self.seen.length - self.seen.start
        with cut_when_made(self.seen, self.keep) as bare:
            model = self.model_file.build()
        if any(m in bare for m in model.modules()):  # a block never built is still in the model
            self.seen.cut = False
            raise NotCut("a stack kept a block it was to cut")
        return model
