"""oomtune as a contender: its real `probe()` on the `cpu` device, with its trials' steps counted."""

from __future__ import annotations

import contextlib
import time
from collections import Counter
from collections.abc import Collection, Iterator
from dataclasses import dataclass

import oomtune.search.prior
import oomtune.search.probe
import oomtune.search.trial
from oomtune.memory.devices import CpuDevice, FakeDevice
from oomtune.memory.margin import Margin
from oomtune.model_file import ModelFile
from oomtune.search.options import resolve_targets
from oomtune.search.probe import ProbeResult, probe

STEPS_PER_TRIAL = 2  # oomtune's default --steps


@contextlib.contextmanager
def counting_steps() -> Iterator[Counter]:
    """Count the training steps oomtune's trials start, keyed (precision, checkpointing, accumulating), by
    wrapping the one training step the trials call. Restored on exit."""
    counts: Counter = Counter()
    step = oomtune.search.trial.train_step

    def counted(t, micro_batches):
        if t.device.kind != "fake":  # the prior's estimate runs on the fake device: not the device's steps
            counts[(t.plan.precision, t.plan.activation_checkpointing, t.plan.grad_accum_steps > 1)] += 1
        return step(t, micro_batches)

    oomtune.search.trial.train_step = counted
    try:
        yield counts
    finally:
        oomtune.search.trial.train_step = step


@contextlib.contextmanager
def only_rungs(names: Collection[str] | None) -> Iterator[None]:
    """Restrict the ladder `probe()` climbs to the named rungs (None: all of them), by filtering what
    `oomtune.search.probe.ladder_rungs` returns. Restored on exit.

    For the fp32 batch search alone: the search runs rung after rung, and a rung's trials depend only on that
    rung's own measurements (each rung starts afresh at its target), so dropping the later rungs changes none
    of the fp32 rung's trials; it only skips rungs the large-batch table does not report (amp on this CPU is
    ~10x slower per step). tests/test_bench.py checks the fp32 trials are the same as the full ladder's."""
    if names is None:
        yield
        return
    full = oomtune.search.probe.ladder_rungs

    def restricted(*args, **kwargs):
        rungs = [r for r in full(*args, **kwargs) if r.name in names]
        if not rungs:
            raise ValueError(f"no rung named {sorted(names)} on this ladder")
        return rungs

    oomtune.search.probe.ladder_rungs = restricted
    try:
        yield
    finally:
        oomtune.search.probe.ladder_rungs = full


@dataclass
class OursResult:
    objective: str
    probe: ProbeResult
    steps_per_rung: dict[str, int]  # rung name -> steps its own trials started (accumulation verifies excluded)
    steps: int  # every step the probe started
    seconds: float  # the whole probe

    def rung(self, name: str):
        return next((r for r in self.probe.ladder.rungs if r.rung.name == name), None)

    def rung_seconds(self, name: str) -> float:
        """Seconds of the rung's own trials (accumulation verifies excluded), as the probe recorded them."""
        return sum(t.seconds for t in self.probe.records if t.rung == name and t.grad_accum_steps == 1)


@contextlib.contextmanager
def hidden_from_the_prior() -> Iterator[None]:
    """The prior's fake device without the cpu device's margin: the margin stands for memory the estimate cannot
    see (a fixed part and a proportion), which the probe's certification must correct for. Restored on exit."""
    make = oomtune.search.prior.prior_device
    oomtune.search.prior.prior_device = lambda device: FakeDevice(f"{device.budget_bytes}B", margin=Margin(),
                                                                  never_runs_out=True, traces=True)
    try:
        yield
    finally:
        oomtune.search.prior.prior_device = make


def run_oomtune(model_file: ModelFile, batch: int, context: int, budget: str, objective: str = "fit",
                headroom: float = 0.0, rungs: Collection[str] | None = None, prior: bool = False,
                hidden: Margin | None = None) -> OursResult:
    """`oomtune probe MODEL --device cpu --budget BUDGET --batch B --context T --headroom H --objective O
    [--no-prior]`, on the rungs named in `rungs` only (None: the whole ladder; see `only_rungs`). `hidden`: memory
    the cpu device counts on top of its tensors (its margin) and the prior's estimate does not see."""
    device = CpuDevice(budget, margin=hidden)
    targets = resolve_targets(model_file, batch, context, None)
    hiding = hidden_from_the_prior() if hidden is not None else contextlib.nullcontext()
    with counting_steps() as counts, only_rungs(rungs), hiding:
        start = time.perf_counter()
        result = probe(model_file, device, targets, headroom=headroom, steps=STEPS_PER_TRIAL, objective=objective,
                       prior=prior)
        seconds = time.perf_counter() - start
    steps = {}
    for r in result.ladder.rungs:  # a rung certified by its plan (from the prior) ran its trials with accumulation
        key = (r.rung.precision, r.rung.activation_checkpointing)
        steps[r.rung.name] = counts.get((*key, False), 0) + (counts.get((*key, True), 0) if r.grad_accum_steps > 1
                                                             else 0)
    return OursResult(objective, result, steps, sum(counts.values()), seconds)
