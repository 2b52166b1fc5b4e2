"""What a device's measurement reads: the peaks of one stretch of work, overall and per phase of the step."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .replay import Trace


@dataclass
class Reading:
    """Peak memory of one measured stretch of work, overall and per phase of the training step.
    On the simulated devices allocated and reserved are the same number."""

    peak_bytes: int = 0  # what must fit: reserved on cuda (what the card holds), tracked bytes on cpu
    peak_allocated_bytes: int = 0  # bytes in live tensors at the peak
    phase_peaks: dict[str, int] = field(default_factory=dict)  # allocated peak per phase: setup, forward, ...
    phase: str = "setup"  # the phase running now
    host_peak_bytes: int = 0  # host memory held at most by what the offload levers moved there
    modelled_reserved_bytes: int | None = None  # simulated devices: the CUDA caching allocator model's peak
    trace: Trace | None = field(default=None, repr=False)  # what the storages did, where the device traces
    events: list | None = field(default=None, repr=False)  # the tracker's own record of it, where a trial keeps it
    points: tuple[int, ...] = ()  # where in `events` each step began and returned, and the steps ended
    loss_key: int | None = None  # the tracker's key of the first step's loss, which the trial held

    @property
    def batch_peak_bytes(self) -> int | None:
        """Peak of the phases that grow with the micro-batch (forward, backward), in peak_bytes' units (the
        allocator's overhead added on cuda). The optimizer step's peak does not grow with the batch, so a
        line through these points predicts the largest batch even where small batches peak in the optimizer."""
        grows = [self.phase_peaks[p] for p in ("forward", "backward") if p in self.phase_peaks]
        if not grows:
            return None
        return max(grows) + (self.peak_bytes - self.peak_allocated_bytes)
