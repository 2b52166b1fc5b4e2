"""Where `oomtune train` runs: which device (and budget), stopping on Ctrl-C / SIGTERM, and the GPU memory NVML
reports for this process."""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from collections.abc import Iterator

import torch

from .devices import Device, make_device
from .errors import OomtuneError
from .plan import Config


def device_kind(config: Config, kind: str | None) -> str:
    """Train where the probe ran unless told otherwise: cuda or cpu."""
    found = config.found_by
    if kind is None and found is not None and found.device in ("cuda", "cpu"):
        kind = found.device
        if kind == "cuda" and not torch.cuda.is_available():
            raise OomtuneError(f"the config was probed on cuda ({found.gpu_name}) but PyTorch sees no GPU here; "
                               "pass --device cpu to train on the CPU")
    kind = kind or "auto"
    if kind == "auto":
        kind = "cuda" if torch.cuda.is_available() else "cpu"
    if kind not in ("cuda", "cpu"):
        raise OomtuneError(f"--device {kind}: training needs a device that computes (cuda or cpu)")
    return kind


def resolve_device(config: Config, kind: str | None, budget: str | None) -> Device:
    """Train where the probe ran unless told otherwise; on the simulated cpu device also in the budget it
    probed (the memory the plan was found for). On cuda the default budget is the card's free memory (of the
    GPU torch.cuda.set_device chose: one per rank)."""
    kind = device_kind(config, kind)
    found = config.found_by
    if budget is None and kind == "cpu" and found is not None and found.device == "cpu":
        budget = str(found.budget_bytes)
    return make_device(kind, budget)


class StopRequest:
    signal_name: str | None = None


@contextlib.contextmanager
def graceful_stop() -> Iterator[StopRequest]:
    """SIGINT / SIGTERM ask the loop to stop after the step in flight and save a checkpoint; a second one
    stops at once (KeyboardInterrupt; the last checkpoint on disk stays whole). Main thread only."""
    request = StopRequest()
    if threading.current_thread() is not threading.main_thread():
        yield request
        return
    # under torchrun one Ctrl-C arrives twice (from the terminal and from the agent): one request, not two
    same_request_s = 1.0 if "TORCHELASTIC_RUN_ID" in os.environ else 0.0
    first = [0.0]

    def handler(signum, frame):
        if request.signal_name is not None:
            if time.monotonic() - first[0] < same_request_s:
                return
            raise KeyboardInterrupt
        request.signal_name = signal.Signals(signum).name
        first[0] = time.monotonic()

    previous = {s: signal.signal(s, handler) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield request
    finally:
        for s, h in previous.items():
            signal.signal(s, h)


def nvml_used_bytes(device: Device) -> int | None:
    """This process's memory on the GPU as nvidia-smi shows it (NVML), else the whole GPU's used memory
    (inside a container NVML's pids may not match ours); None without NVML."""
    from . import nvml

    props = torch.cuda.get_device_properties(device.torch_device)
    pci = None
    if all(hasattr(props, a) for a in ("pci_domain_id", "pci_bus_id", "pci_device_id")):
        pci = (props.pci_domain_id, props.pci_bus_id, props.pci_device_id)
    uuid = str(props.uuid) if getattr(props, "uuid", None) is not None else None
    gpu = nvml.find_gpu(nvml.query(processes=True), pci=pci, uuid=uuid)
    if gpu is None:
        return None
    mine = next((p.used_bytes for p in gpu.processes if p.pid == os.getpid() and p.used_bytes is not None), None)
    return mine if mine is not None else gpu.used_bytes
