"""The probe's trials on its device, as the search asks for them: each run, recorded (the config's and --json's
TrialRecord) and told to the callbacks; and the timing that decides whether the prior would pay."""

from __future__ import annotations

from collections.abc import Callable

from ..config.schema import Plan, TrialRecord
from ..memory.devices import Device
from ..model_file import ModelFile
from .ladder import Measurement, Point, Trial
from .leaks import LeakWatch
from .prior import fake_trial_seconds, why_it_would_not_pay
from .trial import TrialResult


def record_of(trial: Trial, seconds: float, world_size: int = 1, host: int = 0, build: float = 0.0,
              source: str = "run") -> TrialRecord:
    p, m = trial.point, trial.measurement
    return TrialRecord(rung=p.rung.name, stage=trial.stage, micro_batch_size=p.micro_batch_size,
                       context_length=p.context_length, grad_accum_steps=p.grad_accum_steps,
                       precision=p.rung.precision, activation_checkpointing=p.rung.activation_checkpointing,
                       result=trial.result, peak_bytes=m.peak_bytes,
                       tokens_per_s=round(m.tokens_per_s, 1) if m.tokens_per_s else None,
                       seconds=round(seconds, 3), world_size=world_size, sharding=p.rung.sharding,
                       host_peak_bytes=host or None, build_seconds=round(build, 3),
                       source=source)


class DeviceTrials:
    """The probe's trials on its device: each point run (`run(point) -> TrialResult`), recorded as a TrialRecord,
    and told to the callbacks."""

    def __init__(self, run: Callable[[Point], TrialResult], world: int, on_start: Callable[[Point], None] | None,
                 on_trial: Callable[[TrialRecord], None] | None, leaks: LeakWatch):
        self.run, self.world, self.on_start, self.on_trial, self.leaks = run, world, on_start, on_trial, leaks
        self.records: list[TrialRecord] = []
        self.seconds: dict[Point, float] = {}
        self.host: dict[Point, int] = {}
        self.build: dict[Point, float] = {}
        self.sources: dict[Point, str] = {}  # how each was found, where not run (TrialRecord.source)
        self.ahead: dict[Point, TrialResult] = {}  # run before the search asked (run_ahead)

    def run_ahead(self, point: Point) -> TrialResult:
        """Run `point` now (timing the device for the prior); the search's own trial of it is this one."""
        self.ahead[point] = r = self.run(point)
        self.leaks.after(r.left_bytes)
        return r

    def measure(self, point: Point) -> Measurement:
        if self.on_start:
            self.on_start(point)
        r = self.ahead.pop(point, None)
        if r is None:
            r = self.run(point)
            self.leaks.after(r.left_bytes)  # (a model file that keeps tensors from trial to trial: exit 2 past a share)
        self.seconds[point], self.host[point], self.build[point] = r.seconds, r.host_peak_bytes, r.build_seconds
        self.sources[point] = ("replayed" if r.replayed else "extrapolated" if r.extrapolated else
                               "first-step-run" if r.second_step_made else "bounded" if r.bounded else "run")
        return Measurement(oom=r.oom, peak_bytes=r.peak_bytes, tokens_per_s=r.tokens_per_s,
                           batch_peak_bytes=r.batch_peak_bytes)

    def collect(self, trial: Trial) -> None:
        p = trial.point
        self.records.append(record_of(trial, self.seconds.get(p, 0.0), self.world, self.host.get(p, 0),
                                    self.build.get(p, 0.0), self.sources.get(p, "run")))
        if self.on_trial:
            self.on_trial(self.records[-1])


def prior_would_not_pay(trials: DeviceTrials, model_file: ModelFile, device: Device, point: Point, plan: Plan,
                        steps: int, batch: int) -> str | None:
    """Time `point` (micro-batch 1 at the target context, the first rung: a trial the search runs anyway, kept for
    it) on the device and on fake tensors; why the prior would not pay, or None (it does, or the device trial ran
    out of memory and says nothing of a trial's speed)."""
    ran = trials.run_ahead(point)
    if ran.oom:
        return None
    fake = fake_trial_seconds(model_file, plan, device, steps)
    if isinstance(fake, str):
        return fake
    return why_it_would_not_pay(max(ran.seconds - ran.build_seconds, 1e-6), fake, batch)
