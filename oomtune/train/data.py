"""Where training batches come from, and how they are cut into micro-batches.

The data are drawn under a private RNG stream (`RngStream`): its state is swapped in around every draw, so
the data's randomness and the model's (dropout) never interleave. A run and its resume from a checkpoint
then see the same batches: the resumed run replays the stream to its position.

A pass of `train_batches` may end on a short batch (a DataLoader's default drop_last=False): it trains with its
true size (`Shares.train_cut` gives each micro-batch its part of the step's gradient), and the next pass begins a
new epoch. A batch of 0 examples is skipped. Both are told through `DataStream.notices`.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
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


def examples_in(batch: Batch, full: int) -> int | None:
    """The examples `batch` holds, read off its tensors' first dimensions: `full` where some tensor has it, else the
    shorter one most tensors have (a tie: the larger); None where none is `full` or shorter."""
    firsts = _first_dims(batch)
    if full in firsts:
        return full
    shorter = [n for n in firsts if n < full]
    return max(set(shorter), key=lambda n: (shorter.count(n), n)) if shorter else None


@dataclass(frozen=True)
class Notice:
    """Something about the data the run tells (the console) and logs (events.jsonl, as `event` with `fields`)."""

    event: str
    message: str
    fields: dict = field(default_factory=dict)


class DataStream:
    """Batches of `batch_size` from the model file's `hook` (train_batches / eval_batches), or synthetic ones
    from make_batch, drawn under a private RNG stream. An exhausted iterator starts over (a new epoch). `drawn`
    counts the batches handed out (a checkpoint's data position; batches of 0 examples are skipped, not counted)."""

    def __init__(self, model_file: ModelFile, hook: str, batch_size: int, context_length: int, device: Device,
                 seed: int):
        self.model_file, self.hook = model_file, hook
        self.batch_size, self.context_length = batch_size, context_length
        self.torch_device = device.torch_device
        self.rng = RngStream(seed, device.torch_device.type == "cuda")
        self.drawn = 0
        self.epoch = 1  # the pass over the hook's data the stream is in
        self.in_pass = 0  # batches of this pass handed out
        self.notices: list[Notice] = []  # a new epoch, an empty batch skipped: the trainer tells and drops them
        self._short: int | None = None  # the examples of a short batch just handed out (it must end its pass)
        self._empty = 0  # batches of 0 examples skipped
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
        while True:
            batch = self._draw(again)
            if batch is None:
                return None
            self.model_file.check_batch(self.hook, batch, self.torch_device)
            examples = self._examples(batch)
            if examples != 0:
                break
            self._empty += 1
            if self._empty == 1:
                self.notices.append(Notice("empty_batch", f"{self.model_file.label}: {self.hook}() yielded a batch "
                                           "of 0 examples: skipped (and any more like it)", {"hook": self.hook}))
        if self.hook == "train_batches":  # (an evaluation's short last batch only takes less memory)
            self._check_shapes(batch)
            self._short = examples if examples is not None and examples < self.batch_size else None
        self.drawn += 1
        self.in_pass += 1
        return batch

    def _draw(self, again: bool) -> Batch | None:
        with self.rng.active():
            if self._it is None:
                self._it = self._open()
            try:
                return self._pull()
            except StopIteration:
                if self.drawn == 0:
                    raise ModelFileError(f"{self.model_file.label}: {self.hook}() yielded no batches"
                                         f"{self._empties()}") from None
                if not again:
                    return None
                if self.in_pass == 0:  # a pass of nothing but empty batches
                    raise ModelFileError(f"{self.model_file.label}: {self.hook}() yielded no batches when called "
                                         f"again{self._empties()}") from None
                self._new_pass()
                try:
                    return self._pull()
                except StopIteration:
                    raise ModelFileError(f"{self.model_file.label}: {self.hook}() yielded no batches when "
                                         "called again (an iterator that can only be used once?)") from None

    def _empties(self) -> str:
        return f" ({self._empty} of 0 examples, skipped)" if self._empty else ""

    def _new_pass(self) -> None:
        """The hook ended: the next epoch begins, noted with how the last one ended."""
        fields = {"epoch": self.epoch + 1, "batches": self.in_pass, "last_batch_examples": self._short}
        last = f", the last of {self._short} examples (of {self.batch_size})" if self._short is not None else ""
        self.notices.append(Notice("epoch", f"epoch {self.epoch + 1} begins: {self.hook}() ended after "
                                   f"{self.in_pass:,} batches{last}", fields))
        self._it = self._open()
        self.epoch, self.in_pass, self._short = self.epoch + 1, 0, None

    def _examples(self, batch: Batch) -> int | None:
        """The batch's examples; a training batch larger than the plan's, or a short one not at its pass's end,
        would train another plan than the one measured, with another global batch."""
        examples = examples_in(batch, self.batch_size)
        if self.hook != "train_batches":
            return examples
        label, firsts = f"{self.model_file.label}: {self.hook}()", sorted(set(_first_dims(batch)))
        if examples is None:
            raise ModelFileError(f"{label} yielded a batch with first dimensions {firsts}, none of them the "
                                 f"batch_size {self.batch_size} it was given or fewer: yield batches of batch_size "
                                 "examples (the last of a pass may be shorter)")
        if self._short is not None and examples:
            raise ModelFileError(f"{label} yielded a batch of {self._short} example{'s' * (self._short > 1)} (of "
                                 f"batch_size {self.batch_size}) that was not the last of its pass: yield batches of "
                                 "batch_size examples (only a pass's last may be shorter, as a DataLoader's is)")
        return examples

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
        short = next((n for b in batches if (n := examples_in(b, self.data_batch) or 0) < self.data_batch), None)
        if short is not None:  # (the ranks' gradients are averaged with equal weights: not a short batch's)
            raise ModelFileError(f"{self.label} yielded a batch of {short} examples (of {self.data_batch}): on "
                                 f"{ws} ranks every batch must be whole (a DataLoader's drop_last=True)")
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

    def train_cut(self, pieces: list[Batch], micro_batch_size: int) -> tuple[list[Batch], list[float] | None]:
        """This rank's micro-batches of a step, and each one's part of the step's gradient: None where all are whole
        (equal parts); else its examples over the step's, so that the step's gradient is the mean over the
        examples it saw (exact for a loss that is the mean over a micro-batch's examples). One process only: on
        several ranks `share` refuses a short batch."""
        cut = [pair for b in pieces for pair in self._cut(b, micro_batch_size, self.piece)]
        sizes = [n for _, n in cut]
        if all(n == micro_batch_size for n in sizes):
            return [m for m, _ in cut], None
        return [m for m, _ in cut], [n / sum(sizes) for n in sizes]

    def eval_share(self, batches: list[Batch], micro_batch_size: int) -> tuple[list[Batch], list[int]]:
        """Evaluation micro-batches of this rank, and the examples in each (the loss is their mean, so that a short
        last batch weighs what its examples weigh, whatever the micro-batch): an equal share when they divide
        evenly, else all of them."""
        cut = [pair for b in batches for pair in self._cut(b, micro_batch_size, self.data_batch)]
        ws = self.dist.world_size
        if ws > 1 and not len(cut) % ws:
            k = len(cut) // ws
            cut = cut[self.dist.rank * k:(self.dist.rank + 1) * k]
        return [m for m, _ in cut], [n for _, n in cut]

    def _cut(self, batch: Batch, micro_batch_size: int, full: int) -> list[tuple[Batch, int]]:
        """One batch of `full` examples as (micro-batch, its examples) of the plan. A short batch (the last of a
        pass) is cut into micro-batches of at most `micro_batch_size` (the last one shorter), or run whole where it
        is no larger."""
        size = examples_in(batch, full)
        if size is None or size == full:  # (None: split_batch's own error)
            return [(m, micro_batch_size) for m in self.micro_batches([batch], micro_batch_size, full)]
        if size <= micro_batch_size:
            return [(batch, size)]
        parts = split_batch(batch, size, -(-size // micro_batch_size), self.label, piece=micro_batch_size)
        return [(m, min(micro_batch_size, size - i * micro_batch_size)) for i, m in enumerate(parts)]
