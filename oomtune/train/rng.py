"""Every random number generator a step may draw from (torch CPU and CUDA, Python's random, numpy's legacy global):
captured as plain tensors and lists (a checkpoint holding them loads with weights_only=True), restored, seeded;
and `RngStream`, a private stream of them that the data are drawn under."""

from __future__ import annotations

import contextlib
import random
from collections.abc import Iterator
from typing import Any

import torch


def _numpy():
    try:
        import numpy
    except ImportError:
        return None
    return numpy


def capture_rng(cuda: bool) -> dict[str, Any]:
    """The global RNG states (torch CPU, torch CUDA when used, Python's random, numpy's legacy global) as
    plain tensors/lists, so a checkpoint holding them loads with weights_only=True."""
    version, internal, gauss = random.getstate()
    state: dict[str, Any] = {"torch": torch.get_rng_state(), "python": [version, list(internal), gauss]}
    if cuda:
        state["cuda"] = torch.cuda.get_rng_state_all()
    np = _numpy()
    if np is not None:
        name, keys, pos, has_gauss, cached = np.random.get_state()
        state["numpy"] = [name, torch.from_numpy(keys.astype("int64")), int(pos), int(has_gauss), float(cached)]
    return state


def restore_rng(state: dict[str, Any], cuda: bool) -> None:
    torch.set_rng_state(state["torch"])
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    if cuda and state.get("cuda") is not None:  # as many GPUs as both runs see (a resume may see fewer)
        for index, rng in enumerate(state["cuda"][:torch.cuda.device_count()]):
            torch.cuda.set_rng_state(rng, index)
    np = _numpy()
    if np is not None and state.get("numpy") is not None:
        name, keys, pos, has_gauss, cached = state["numpy"]
        np.random.set_state((name, keys.numpy().astype("uint32"), pos, has_gauss, cached))


def seed_everything(seed: int, cuda: bool) -> None:
    torch.manual_seed(seed)  # seeds CUDA too where it is initialised
    random.seed(seed)
    np = _numpy()
    if np is not None:
        np.random.seed(seed % 2**32)
    if cuda:
        torch.cuda.manual_seed_all(seed)



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

