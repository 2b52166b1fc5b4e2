"""Where training batches come from, and how they are cut into micro-batches.

The data are drawn under a private RNG stream (`RngStream`): its state is swapped in around every draw, so
the data's randomness and the model's (dropout) never interleave. A run and its resume from a checkpoint
then see the same batches: the resumed run replays the stream to its position.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.utils._pytree import tree_leaves

from ..dist.group import Dist
from ..errors import ModelFileError, OomtuneError, first_line
from ..memory.devices import Device, is_oom
from ..model_file import Batch, ModelFile
from .rng import RngStream, capture_rng, restore_rng


def split_batch(batch: Batch, size: int, parts: int, label: str = "the data", piece: int | None = None) -> list[Batch]:
    """Cut a batch of `size` examples into `parts` equal micro-batches along dim 0 (views, no copies); with
    `piece`, into micro-batches of `piece` examples, the last one shorter where `piece` does not divide `size`.
    Tensors without a leading dimension of `size` (a scalar, a shared mask) go to every part."""
    if parts == 1:
        return [batch]
    piece = piece or size // parts
    found = False

    def cut(x: Any) -> list:
        nonlocal found
        if isinstance(x, torch.Tensor) and x.dim() > 0 and x.shape[0] == size:
            found = True
            return list(x.split(piece))
        if isinstance(x, (tuple, list)):
            cols = [cut(v) for v in x]
            return [type(x)(c[i] for c in cols) for i in range(parts)]
        if isinstance(x, dict):
            cols = {k: cut(v) for k, v in x.items()}
            return [{k: cols[k][i] for k in cols} for i in range(parts)]
        return [x] * parts

    out = cut(batch)
    if not found:
        raise ModelFileError(f"{label}: a batch has no tensor whose first dimension is its batch size {size}, "
                             f"so it cannot be split into micro-batches of {piece} after an out-of-memory error")
    return out


class DataStream:
    """Batches of `batch_size` from the model file's `hook` (train_batches / eval_batches), or synthetic ones
    from make_batch, drawn under a private RNG stream. An exhausted iterator starts over (a new epoch)."""

    def __init__(self, model_file: ModelFile, hook: str, batch_size: int, context_length: int, device: Device,
                 seed: int):
        self.model_file, self.hook = model_file, hook
        self.batch_size, self.context_length = batch_size, context_length
        self.torch_device = device.torch_device
        self.rng = RngStream(seed, device.torch_device.type == "cuda")
        self.drawn = 0
        self._it: Iterator | None = None
        self._worst: list[tuple[int, ...]] | None = None  # make_batch's tensor shapes (_check_shapes), once read

    def _open(self) -> Iterator:
        if self.hook == "make_batch":
            mf, b, t, d = self.model_file, self.batch_size, self.context_length, self.torch_device
            return (mf.batch(b, t, d) for _ in itertools.count())
        return self.model_file.batches(self.hook, self.batch_size, self.context_length, self.torch_device)

    def _pull(self) -> Batch:
        assert self._it is not None
        try:
            return next(self._it)
        except (StopIteration, OomtuneError):
            raise
        except SystemExit as e:  # not the file's exit code: one line, exit 2
            raise ModelFileError(f"{self.model_file.label}: {self.hook}() called sys.exit({e.code!r})") from e
        except Exception as e:
            if is_oom(e):
                raise
            raise ModelFileError(f"{self.model_file.label}: {self.hook}() raised {type(e).__name__}: "
                                 f"{first_line(e, '(no message)')}") from e

    def next(self, again: bool = True) -> Batch | None:
        """The next batch; at the hook's end, the first of its next pass (`again`), else None."""
        with self.rng.active():
            if self._it is None:
                self._it = self._open()
            try:
                batch = self._pull()
            except StopIteration:
                if self.drawn == 0:
                    raise ModelFileError(f"{self.model_file.label}: {self.hook}() yielded no batches") from None
                if not again:
                    return None
                self._it = self._open()  # next epoch
                try:
                    batch = self._pull()
                except StopIteration:
                    raise ModelFileError(f"{self.model_file.label}: {self.hook}() yielded no batches when "
                                         "called again (an iterator that can only be used once?)") from None
        self.model_file.check_batch(self.hook, batch, self.torch_device)
        if self.hook == "train_batches":  # (an evaluation's short last batch only takes less memory)
            self._check_size(batch)
            self._check_shapes(batch)
        self.drawn += 1
        return batch

    def _check_size(self, batch: Batch) -> None:
        """A batch of another size than the plan's (an epoch's short last batch, a hook that ignores batch_size)
        would train another plan than the one measured, with another global batch."""
        firsts = [t.shape[0] for t in tree_leaves(batch) if isinstance(t, torch.Tensor) and t.dim() > 0]
        if self.batch_size not in firsts:
            raise ModelFileError(f"{self.model_file.label}: {self.hook}() yielded a batch with first dimensions "
                                 f"{sorted(set(firsts))}, none of them the batch_size {self.batch_size} it was "
                                 "given: yield batches of exactly batch_size examples (drop_last=True)")

    def _check_shapes(self, batch: Batch) -> None:
        """A batch larger than make_batch's worst case at the plan's sizes (longer sequences than context_length,
        larger images) takes memory no trial measured: it would run out of memory, and the fallback shrink the
        plan for good, with no word of why."""
        if self._worst is None:
            state = capture_rng(self.torch_device.type == "cuda")  # (make_batch on the cpu may draw: put back)
            sample = self.model_file.sample_tensors(self.context_length, self.batch_size)
            restore_rng(state, self.torch_device.type == "cuda")
            self._worst = [tuple(t.shape) for t in sample[0]] if sample is not None else []
        real = [t for t in tree_leaves(batch) if isinstance(t, torch.Tensor)]
        if len(real) != len(self._worst):  # (another structure: nothing to match the tensors by)
            return
        for t, worst in zip(real, self._worst, strict=True):
            if t.dim() == len(worst) and any(n > w for n, w in zip(t.shape[1:], worst[1:], strict=True)):
                raise ModelFileError(
                    f"{self.model_file.label}: {self.hook}() yielded a tensor of shape {tuple(t.shape)} where "
                    f"make_batch({self.batch_size}, {self.context_length}) makes {worst}, the worst case the plan was "
                    "measured at: a larger batch takes memory no trial measured. Yield at most context_length "
                    f"{self.context_length} (cut or pack the sequences), or probe again at the real size")

    def take(self, n: int) -> list[Batch]:
        return [self.next() for _ in range(n)]

    def take_once(self, n: int) -> list[Batch]:
        """Up to n batches, none twice: a finite hook (a held-out set) ends the list where it ends."""
        batches = []
        while len(batches) < n and (batch := self.next(again=False)) is not None:
            batches.append(batch)
        return batches

    def skip(self, n: int, until: Callable[[], bool] | None = None) -> None:
        """Replay n batches (resume): the stream then stands where the interrupted run's stood. `until`: checked
        before each batch, a True ends the replay early (a Ctrl-C during a replay that takes minutes: the
        checkpoint resumed from is the state to keep)."""
        for _ in range(n):
            if until is not None and until():
                return
            self.next()



def _first_dims(batch: Batch) -> list[int]:
    return [t.shape[0] for t in tree_leaves(batch) if isinstance(t, torch.Tensor) and t.dim() > 0]


class Shares:
    """Cuts the global stream's batches into this rank's micro-batches. Every rank draws the same global batches and
    keeps its share - rank r the r-th of world_size equal slices - as pieces of `piece` examples (whole drawn batches
    of `data_batch`, or equal cuts of one), then cuts each piece into micro-batches of the plan."""

    def __init__(self, dist: Dist, data_batch: int, piece: int, label: str):
        self.dist = dist
        self.data_batch = data_batch
        self.piece = piece
        self.label = label  # "model.py: train_batches()": named when a batch cannot be split

    def share(self, batches: list[Batch]) -> list[Batch]:
        """This rank's pieces of the global batches."""
        ws, r = self.dist.world_size, self.dist.rank
        if ws == 1:
            return batches
        if self.piece == self.data_batch:
            k = len(batches) // ws
            return batches[r * k:(r + 1) * k]
        parts = self.data_batch // self.piece
        pieces = [p for b in batches for p in split_batch(b, self.data_batch, parts, self.label)]
        k = len(pieces) // ws
        return pieces[r * k:(r + 1) * k]

    def micro_batches(self, pieces: list[Batch], micro_batch_size: int, size: int | None = None) -> list[Batch]:
        size = size or self.piece
        parts = size // micro_batch_size
        return [m for b in pieces for m in split_batch(b, size, parts, self.label)]

    def eval_share(self, batches: list[Batch], micro_batch_size: int) -> tuple[list[Batch], list[int]]:
        """Evaluation micro-batches of this rank, and the examples in each (the loss is their mean, so that a short
        last batch weighs what its examples weigh, whatever the micro-batch): an equal share when they divide
        evenly, else all of them."""
        cut = [pair for b in batches for pair in self._eval_cut(b, micro_batch_size)]
        ws = self.dist.world_size
        if ws > 1 and not len(cut) % ws:
            k = len(cut) // ws
            cut = cut[self.dist.rank * k:(self.dist.rank + 1) * k]
        return [m for m, _ in cut], [n for _, n in cut]

    def _eval_cut(self, batch: Batch, micro_batch_size: int) -> list[tuple[Batch, int]]:
        """One evaluation batch as (micro-batch, its examples) of the plan. eval_batches may end on a short batch:
        it is cut into micro-batches of at most `micro_batch_size` (the last one shorter), or run whole where it is
        no larger."""
        firsts = _first_dims(batch)
        shorter = [n for n in firsts if n < self.data_batch]
        if self.data_batch in firsts or not shorter:  # (none shorter and not this size: split_batch's own error)
            return [(m, micro_batch_size) for m in self.micro_batches([batch], micro_batch_size, self.data_batch)]
        size = max(set(shorter), key=lambda n: (shorter.count(n), n))  # the examples' dimension: the most tensors
        if size <= micro_batch_size:
            return [(batch, size)]
        parts = split_batch(batch, size, -(-size // micro_batch_size), self.label, piece=micro_batch_size)
        return [(m, min(micro_batch_size, size - i * micro_batch_size)) for i, m in enumerate(parts)]
