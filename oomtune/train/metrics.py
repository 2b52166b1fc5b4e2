"""The metrics.jsonl line of a logged step: loss (averaged over the ranks), lr, tokens/s, peak memory (the rank that
needs the most), NVML's view of this process on cuda, the eval loss when due, the state's bytes, the plan now."""

from __future__ import annotations

import contextlib
import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..dist.group import Dist
from ..errors import OomtuneError
from ..memory.devices import Device
from ..memory.nvml import used_by
from .events import Event, Note
from .rundir import RunLog
from .state import RunState

NVML_EVERY_S = 2.0  # NVML init + query costs milliseconds: not every step


@dataclass
class Window:
    """What the steps since the last logged one did: tokens, seconds, the largest peak."""

    tokens: int = 0
    seconds: float = 0.0
    peak: int = 0


class StepMetrics:
    """Builds and writes the metrics of logged steps (a sync point, once per logged step)."""

    def __init__(self, dist: Dist, device: Device, log: RunLog):
        self.dist = dist
        self.device = device
        self.log = log
        self.cuda = device.torch_device.type == "cuda"
        self.nvml_at, self.nvml_last = -math.inf, None  # when NVML was last asked, and what it said

    def line(self, state: RunState, loss: float, lr: float, window: Window,
             evaluate: Callable[[], tuple[float, int]] | None, state_bytes: int,
             on_event: Callable[[Event], None]) -> dict:
        """`evaluate` (when an evaluation is due) -> (eval loss, its peak bytes); `state_bytes`: weights +
        gradients + optimizer state of this rank."""
        metrics = {"step": state.step, "loss": self.dist.mean(loss), "lr": lr,
                   "tokens_per_s": round(window.tokens / window.seconds, 1) if window.seconds > 0 else None,
                   "peak_bytes": int(self.dist.max(window.peak)[0])}  # the rank that needs the most
        if self.cuda:
            metrics["nvml_used_bytes"] = self._nvml()
        metrics["state_bytes"] = int(self.dist.max(state_bytes)[0])
        metrics["micro_batch_size"] = state.plan.micro_batch_size  # changes after an OOM fallback
        metrics["grad_accum_steps"] = state.plan.grad_accum_steps
        if evaluate is not None:
            try:
                value, eval_peak = evaluate()
            except BaseException:  # the step trained: its line is kept (a resume starts after it), without the eval
                with contextlib.suppress(OomtuneError):  # (a log that cannot be written: the eval's error first)
                    self.log.metrics(metrics)
                raise
            metrics["eval_loss"] = value
            metrics["peak_bytes"] = int(self.dist.max(max(window.peak, eval_peak))[0])
            if not math.isfinite(value):  # written as null; training itself stops on a NaN loss
                on_event(Note(f"the eval loss is {value} at step {state.step}", warning=True))
        self.log.metrics(metrics)
        return metrics

    def _nvml(self) -> int | None:
        now = time.monotonic()
        if now - self.nvml_at >= NVML_EVERY_S:
            self.nvml_at = now
            try:
                props = torch.cuda.get_device_properties(self.device.torch_device)
                self.nvml_last = used_by(props, os.getpid())
            except Exception:
                self.nvml_last = None
        return self.nvml_last
