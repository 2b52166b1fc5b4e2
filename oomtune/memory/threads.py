"""How many threads torch computes with on the simulated devices (`cpu`, `fake`), so that probe's tokens/s and
train's mean the same thing.

torch starts with one thread per core. The models the simulated devices run are small (a CI job, a laptop): each op
is too short to split, and OpenMP's workers spin-wait between ops, which on cores other processes share (a CI
runner, this project's 2-core machine shared by four test runs) costs far more than it gains. Measured there:
examples/tiny_gpt.py's probe (`make demo`'s plan) at 154-299 tokens/s on torch's 2 threads, 300-800 on one; its
training at 138-249 against 328-988. So oomtune runs the simulated devices on one thread, unless OMP_NUM_THREADS
says otherwise; `train` on a plan probed on the `cpu` device uses the thread count the probe measured its tokens/s
with (found_by.threads). The real GPU (`cuda`) is left as torch set it. The count is put back when the command's
work ends (the API's callers keep theirs)."""

from __future__ import annotations

import contextlib
import dataclasses
import os
from collections.abc import Iterator
from dataclasses import dataclass

import torch

SIMULATED_THREADS = 1  # one thread: small models' ops are too short to split (above)
SIMULATED = ("cpu", "fake")


@dataclass(frozen=True)
class Threads:
    count: int
    why: str  # how the count was chosen, for the note

    def note(self, device_kind: str) -> str:
        return f"threads: {self.count} (torch's, on the {device_kind} device: {self.why})"


def choose(device_kind: str, probed_with: int | None = None) -> Threads | None:
    """The thread count for a command on `device_kind` (None: leave torch's, the real GPU); `probed_with`: the
    count the plan was probed with (a config's found_by.threads), which train keeps."""
    if device_kind not in SIMULATED:
        return None
    if os.environ.get("OMP_NUM_THREADS", "").strip():  # the user's (torch read it when it started)
        return Threads(torch.get_num_threads(), "OMP_NUM_THREADS")
    if probed_with is not None:
        return Threads(probed_with, "as the plan was probed, found_by.threads; OMP_NUM_THREADS sets another")
    return Threads(SIMULATED_THREADS, "oomtune's choice for small models on shared cores; OMP_NUM_THREADS sets "
                   "another")


def with_threads(result, threads: Threads | None, device_kind: str):
    """A probe's result (search.probe.ProbeResult) on the `cpu` device, saying the thread count its tokens/s were
    measured with: a note, and found_by.threads in the config (train uses as many)."""
    if threads is None or device_kind != "cpu":
        return result
    config = result.config
    if config is not None:
        found = config.found_by
        config = dataclasses.replace(config, found_by=dataclasses.replace(
            found, threads=threads.count, notes=(*found.notes, threads.note(device_kind))))
    return dataclasses.replace(result, config=config, notes=(*result.notes, threads.note(device_kind)))


@contextlib.contextmanager
def simulated_threads(device_kind: str, probed_with: int | None = None) -> Iterator[Threads | None]:
    """Run the block with `choose`'s thread count, then put torch's back."""
    chosen = choose(device_kind, probed_with)
    before = torch.get_num_threads()
    if chosen is not None and chosen.count != before:
        torch.set_num_threads(chosen.count)
    try:
        yield chosen
    finally:
        if torch.get_num_threads() != before:
            torch.set_num_threads(before)
