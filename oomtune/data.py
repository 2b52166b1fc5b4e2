"""Where training batches come from, and how they are cut into micro-batches.

The data are drawn under a private RNG stream (`RngStream`): its state is swapped in around every draw, so
the data's randomness and the model's (dropout) never interleave. A run and its resume from a checkpoint
then see the same batches: the resumed run replays the stream to its position.
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Iterator
from typing import Any

import torch

from .checkpoint import capture_rng, restore_rng, seed_everything
from .devices import Device, is_oom
from .errors import ModelFileError, OomtuneError
from .model_file import Batch, ModelFile


def split_batch(batch: Batch, size: int, parts: int, label: str = "the data") -> list[Batch]:
    """Cut a batch of `size` examples into `parts` equal micro-batches along dim 0 (views, no copies).
    Tensors without a leading dimension of `size` (a scalar, a shared mask) go to every part."""
    if parts == 1:
        return [batch]
    piece = size // parts
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



class RngStream:
    """A private stream of the global RNGs (torch CPU/CUDA, random, numpy): `with stream.active():` swaps its
    state in and the caller's back out, so code inside draws from its own deterministic sequence without
    shifting anyone else's."""

    def __init__(self, seed: int, cuda: bool):
        self.cuda = cuda
        outer = capture_rng(cuda)
        seed_everything(seed, cuda)
        self.state = capture_rng(cuda)
        restore_rng(outer, cuda)

    @contextlib.contextmanager
    def active(self) -> Iterator[None]:
        outer = capture_rng(self.cuda)
        restore_rng(self.state, self.cuda)
        try:
            yield
        finally:
            self.state = capture_rng(self.cuda)
            restore_rng(outer, self.cuda)


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
            line = str(e).strip().splitlines()[0] if str(e).strip() else "(no message)"
            raise ModelFileError(f"{self.model_file.label}: {self.hook}() raised {type(e).__name__}: {line}") from e

    def next(self) -> Batch:
        with self.rng.active():
            if self._it is None:
                self._it = self._open()
            try:
                batch = self._pull()
            except StopIteration:
                if self.drawn == 0:
                    raise ModelFileError(f"{self.model_file.label}: {self.hook}() yielded no batches") from None
                self._it = self._open()  # next epoch
                try:
                    batch = self._pull()
                except StopIteration:
                    raise ModelFileError(f"{self.model_file.label}: {self.hook}() yielded no batches when "
                                         "called again (an iterator that can only be used once?)") from None
        self.model_file.check_batch(self.hook, batch, self.torch_device)
        self.drawn += 1
        return batch

    def take(self, n: int) -> list[Batch]:
        return [self.next() for _ in range(n)]

    def skip(self, n: int) -> None:
        """Replay n batches (resume): the stream then stands where the interrupted run's stood."""
        for _ in range(n):
            self.next()
