"""Exhaustive truth: the peak of every micro-batch 1..B on every rung, and of every accumulation plan that keeps
the global batch exact, measured on the `fake` device (oomtune's training step on FakeTensors: no compute, the
same tracker as `cpu`, so the same bytes). One table per model serves every budget: a plan fits a budget
exactly when its peak is at most the budget (the tracker raises as soon as live bytes pass it, and the peak is
the most they ever were), which `verify_boundary` re-checks with the budget actually set.

Throughput needs compute: `time_plans` runs each fitting plan's real training step on the cpu device.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass, field

import torch

from oomtune.config.schema import Plan, TrainConfig
from oomtune.memory.breakdown import static_memory
from oomtune.memory.devices import CpuDevice, TrackedDevice
from oomtune.model_file import ModelFile
from oomtune.search.ladder import Rung
from oomtune.search.probe import ladder_rungs
from oomtune.search.trial import run_trial
from oomtune.step import build_training, train_step

from .ours import counting_steps

UNBOUNDED = "1TiB"  # no plan here comes near it: every trial runs to its end and reports its peak
STEPS_PER_TRIAL = 2  # as the probe's trials


def truth_device(budget: str = UNBOUNDED) -> TrackedDevice:
    """The fake device with no margin (its tensor peak is the cpu device's to the byte); the cpu device (same
    bytes, real compute, slower) where this oomtune has no fake device yet."""
    try:
        from oomtune.memory.devices import FakeDevice
        from oomtune.memory.margin import Margin
    except ImportError:
        return CpuDevice(budget)
    return FakeDevice(budget, margin=Margin())


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def plan_for(rung: Rung, micro_batch: int, context: int, accum: int = 1) -> Plan:
    return Plan(micro_batch, context, rung.precision, rung.activation_checkpointing, accum)


def plan_label(plan: Plan) -> str:
    """'fp32 6', 'bf16+ckpt 8x2' (micro-batch x accumulation)."""
    rung = plan.precision + ("+ckpt" if plan.activation_checkpointing else "")
    size = f"{plan.micro_batch_size}" + (f"x{plan.grad_accum_steps}" if plan.grad_accum_steps > 1 else "")
    return f"{rung} {size}"


@dataclass
class PeakTable:
    """Peak bytes of (rung name, micro-batch, accumulation) at context T, target global batch B."""

    batch: int
    context: int
    rungs: list[Rung]
    device_kind: str
    peaks: dict[tuple[str, int, int], int] = field(default_factory=dict)
    batch_peaks: dict[tuple[str, int, int], int | None] = field(default_factory=dict)  # forward/backward peak
    trials: int = 0
    steps: int = 0  # training steps the trials ran (counted, not assumed)
    seconds: float = 0.0
    trial_seconds: dict[tuple[str, int, int], float] = field(default_factory=dict)
    search_steps: dict[str, int] = field(default_factory=dict)  # rung -> steps of its micro-batch 1..B trials

    def search_seconds(self, rung: str) -> float:
        """What exhaustive search over micro-batches 1..B of one rung cost (the accumulation plans excluded)."""
        return sum(s for (name, _, accum), s in self.trial_seconds.items() if name == rung and accum == 1)

    def rung(self, name: str) -> Rung:
        return next(r for r in self.rungs if r.name == name)

    def fits(self, rung: str, micro_batch: int, accum: int, limit: int) -> bool:
        return self.peaks[(rung, micro_batch, accum)] <= limit

    def true_max(self, rung: str, limit: int) -> int | None:
        """The largest micro-batch <= B (no accumulation) whose peak is within `limit`; None if not even 1."""
        fitting = [b for b in range(1, self.batch + 1) if self.fits(rung, b, 1, limit)]
        return max(fitting) if fitting else None

    def largest_plan(self, rung: str, limit: int) -> int | None:
        """The largest divisor d of B whose plan d x B/d fits within `limit` on `rung` (what the probe certifies for
        a rung that will accumulate); None if not even 1 x B."""
        fitting = [d for d in divisors(self.batch) if self.fits(rung, d, self.batch // d, limit)]
        return max(fitting) if fitting else None

    def fitting_plans(self, limit: int) -> list[tuple[int, Plan]]:
        """Every plan with global batch exactly B that fits: (rung index, plan)."""
        out = []
        for i, rung in enumerate(self.rungs):
            for d in divisors(self.batch):
                accum = self.batch // d
                if self.fits(rung.name, d, accum, limit):
                    out.append((i, plan_for(rung, d, self.context, accum)))
        return out

    def best_fit_plan(self, limit: int) -> Plan | None:
        """The fit objective over every plan: the largest micro-batch (context is fixed at T here), then the
        earliest rung (fp32 before amp before checkpointing)."""
        plans = self.fitting_plans(limit)
        if not plans:
            return None
        return max(plans, key=lambda ip: (ip[1].micro_batch_size, -ip[0]))[1]


def peak_table(model_file: ModelFile, batch: int, context: int, device: TrackedDevice | None = None,
               only: Iterable[str] | None = None, accumulation: bool = True) -> PeakTable:
    """Run every micro-batch 1..B on every rung (or the rungs named in `only`), and every accumulation plan
    d x B/d (d < B) unless `accumulation` is False (the batch search alone needs none), once each."""
    device = device or truth_device()
    rungs = ladder_rungs(device, "auto", static_memory(model_file).checkpointing_supported)
    if only is not None:
        rungs = [r for r in rungs if r.name in set(only)]
    table = PeakTable(batch, context, rungs, device.kind)
    start = time.perf_counter()
    with counting_steps() as counted:
        for rung in rungs:
            points = [(b, 1) for b in range(1, batch + 1)]
            if accumulation:
                points += [(d, batch // d) for d in divisors(batch) if d < batch]
            for b, accum in points:
                r = run_trial(model_file, plan_for(rung, b, context, accum), device, steps=STEPS_PER_TRIAL)
                if r.oom:
                    raise RuntimeError(f"{model_file.label}: {rung.name} {b}x{accum} ran out of {UNBOUNDED}")
                table.peaks[(rung.name, b, accum)] = r.peak_bytes
                table.batch_peaks[(rung.name, b, accum)] = r.batch_peak_bytes
                table.trial_seconds[(rung.name, b, accum)] = r.seconds
                table.trials += 1
    table.seconds = time.perf_counter() - start
    table.steps = sum(counted.values())
    table.search_steps = {r.name: counted.get((r.precision, r.activation_checkpointing, False), 0) for r in rungs}
    return table


def verify_boundary(model_file: ModelFile, table: PeakTable, rung: str, budget: str) -> bool | None:
    """With the budget actually set on the truth device: the true max fits and the next size runs out of memory.
    None when there is no boundary below B to check."""
    device = truth_device(budget)
    best = table.true_max(rung, device.budget_bytes)
    r = table.rung(rung)
    ok = True
    if best is not None:
        ok &= not run_trial(model_file, plan_for(r, best, table.context), device, STEPS_PER_TRIAL).oom
    if (best or 0) < table.batch:
        ok &= run_trial(model_file, plan_for(r, (best or 0) + 1, table.context), device, STEPS_PER_TRIAL).oom
    return ok


def time_plans(model_file: ModelFile, plans: Iterable[Plan], warmup: int = 1, steps: int = 2) -> dict[Plan, float]:
    """Tokens per second of each plan's real training step (all grad_accum_steps micro-batches and the optimizer
    step) on the cpu device, no memory tracker: the fastest of `steps` timed steps after `warmup` (the fastest,
    not the mean: other jobs on the machine only ever add time)."""
    lr, clip = TrainConfig().lr, TrainConfig().clip_grad_norm
    device = CpuDevice()
    out = {}
    for plan in plans:
        torch.manual_seed(0)
        t = build_training(model_file, plan, device, lr=lr, clip_grad_norm=clip)
        best = float("inf")
        for i in range(warmup + steps):
            micro = [model_file.batch(plan.micro_batch_size, plan.context_length, device.torch_device)
                     for _ in range(plan.grad_accum_steps)]
            start = time.perf_counter()
            float(train_step(t, micro))  # reading the loss waits for the step
            if i >= warmup:
                best = min(best, time.perf_counter() - start)
        out[plan] = plan.tokens_per_step / best
        del t
    return out
