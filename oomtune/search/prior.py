"""The probe's prior: the same ladder on the fake device first, accounting as the probe's device does, so that each
rung can be certified on the device in two trials (certify.py)."""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field

from ..errors import first_line
from ..memory.devices import Device, FakeDevice, TrackedDevice
from .certify import RungPrior, priors_from


@dataclass
class PriorReport:
    """What the prior cost and did: its fake trials and seconds (apart from the device's), the rungs the device
    searched because the prior was off, or why there was none."""

    trials: int = 0
    seconds: float = 0.0
    fell_back: tuple[str, ...] = ()
    missing: str | None = None  # why the probe ran without a prior (None: it had one)
    priors: dict = field(default_factory=dict, repr=False)  # Rung -> RungPrior

    def summary(self) -> str:
        """One line: how the probe's trials were chosen (the config's found_by.prior)."""
        if self.missing is not None:
            return f"searched without a prior: {self.missing}"
        off = f"; searched where it was off: {', '.join(self.fell_back)}" if self.fell_back else ""
        return f"certified from an estimate on fake tensors ({self.trials} fake trials, {self.seconds:.1f} s){off}"

    def to_json(self) -> dict:
        return {"used": self.missing is None, "fake_trials": self.trials, "fake_seconds": round(self.seconds, 2),
                "fell_back_rungs": list(self.fell_back), "why_not": self.missing}


def prior_device(device: Device) -> FakeDevice:
    """The fake device that accounts as `device` (cpu or cuda) does: a simulated device's own card and margin; for a
    real GPU, its card's profile (autocast, kernels, allocator, workspaces) without a context, which the GPU's
    budget (its free memory, the context already taken) excludes too. It never runs out of memory: a size past the
    limit reports its peak, which the search's chord uses (fewer fake trials than where it ran out)."""
    if isinstance(device, TrackedDevice):
        return FakeDevice(f"{device.budget_bytes}B", gpu=device.card, margin=device.margin, never_runs_out=True)
    card = dataclasses.replace(device.profile(), context_bytes=0)
    return FakeDevice(f"{device.budget_bytes}B", gpu=card, never_runs_out=True)


def run_prior(run_ladder, device: Device, label: str) -> PriorReport:
    """`run_ladder(fake_device) -> ProbeResult` on the fake device standing in for `device`; the priors of the rungs
    it searched. Where the fake device cannot stand in or cannot run the model (an op that needs tensor values,
    too: the prior never computes on the host), the report says why and has none (the device then searches as
    without a prior)."""
    fake = prior_device(device)
    start = time.perf_counter()
    try:
        result = run_ladder(fake)
    except Exception as e:  # noqa: BLE001 - whatever the fake device cannot do, the device's own search can
        return PriorReport(seconds=time.perf_counter() - start,
                           missing=f"the estimate of {label} on fake tensors failed: {first_line(e)}")
    return PriorReport(len(result.records), time.perf_counter() - start, priors=priors_from(result.ladder))


__all__ = ["PriorReport", "RungPrior", "prior_device", "run_prior"]
