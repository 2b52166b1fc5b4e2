"""Where a trial runs and how its memory is measured.

| device | compute   | memory accounting                                    | OOM comes from                 |
| cuda   | real GPU  | torch.cuda.max_memory_allocated / _reserved, NVML    | the caching allocator (capped) |
| cpu    | real CPU  | MemoryTracker (tensor storages, 512-byte rounding)    | the tracker, CUDA-shaped       |
| fake   | none      | the same MemoryTracker, on FakeTensors (no data)      | the tracker, CUDA-shaped       |

Everything else (building the model, the training step) is identical across devices: a device only
decides where tensors live and how the peak is read.
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from ..errors import OomtuneError
from ..units import format_bytes, parse_budget
from .allocator import CachingAllocatorModel
from .fakes import real_code_paths
from .tracker import MemoryTracker, system_memory

DEVICE_KINDS = ("auto", "cuda", "cpu", "fake")


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

    @property
    def batch_peak_bytes(self) -> int | None:
        """Peak of the phases that grow with the micro-batch (forward, backward), in peak_bytes' units (the
        allocator's overhead added on cuda). The optimizer step's peak does not grow with the batch, so a
        line through these points predicts the largest batch even where small batches peak in the optimizer."""
        grows = [self.phase_peaks[p] for p in ("forward", "backward") if p in self.phase_peaks]
        if not grows:
            return None
        return max(grows) + (self.peak_bytes - self.peak_allocated_bytes)


class Device:
    """Base: a torch device plus a way to measure peak memory under a budget."""

    kind: str = ""
    name: str = ""
    torch_device: torch.device
    budget_bytes: int
    capacity_bytes: int | None = None
    computes: bool = True  # False where tensors hold no values (the fake device): losses cannot be read

    @property
    def measures_speed(self) -> bool:
        """Its trials' tokens/s are the speed training will have (not the fake device's, which stands in)."""
        return self.computes

    @property
    def autocast_device_type(self) -> str:
        return self.torch_device.type

    def supports_bf16(self) -> bool:
        return True

    def amp_dtype(self) -> str:
        """Precision `auto`: bf16 where the device supports it, else fp16 (with GradScaler)."""
        return "bf16" if self.supports_bf16() else "fp16"

    @contextlib.contextmanager
    def measure(self) -> Iterator[Reading]:
        """Run work inside; the yielded Reading holds its peaks once the block exits (even by an OOM).
        Call `mark(reading, phase)` at phase boundaries to split the peak by phase."""
        reading = Reading()
        self._reset_peak()
        self.host_ledger().reset_host_peak()
        allocator = self._model_allocator()
        try:
            with self._accounting():
                yield reading
        finally:
            self.mark(reading, None)
            reading.host_peak_bytes = self.host_ledger().host_peak_bytes
            if allocator is not None:  # a simulated device's: its peak read, the model detached from the tracker
                reading.modelled_reserved_bytes, self.tracker.allocator = allocator.peak_reserved_bytes, None

    def _model_allocator(self) -> CachingAllocatorModel | None:
        """A fresh model of the CUDA caching allocator, fed this measurement's storages (simulated devices)."""
        return None

    def host_ledger(self) -> MemoryTracker:
        """The tracker that counts host-resident storages (`host()`)."""
        raise NotImplementedError

    def host(self) -> contextlib.AbstractContextManager:
        """Tensors made inside live in host memory (the offload levers): pinned CPU memory on cuda; on the simulated
        devices, CPU tensors the tracker counts as host memory, apart from the device's budget."""
        return self.host_ledger().hosting()

    @property
    def pin_memory(self) -> bool:
        return False

    def mark(self, reading: Reading, phase: str | None) -> None:
        """Close the running phase (record its peak) and start `phase`."""
        self.synchronize()
        allocated, reserved = self._read_peak()
        reading.phase_peaks[reading.phase] = max(reading.phase_peaks.get(reading.phase, 0), allocated)
        reading.peak_allocated_bytes = max(reading.peak_allocated_bytes, allocated)
        reading.peak_bytes = max(reading.peak_bytes, reserved)
        self._reset_peak()
        if phase is not None:
            reading.phase = phase

    def _accounting(self) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()

    def _read_peak(self) -> tuple[int, int]:
        """(allocated, reserved) peak bytes since the last reset."""
        raise NotImplementedError

    def _reset_peak(self) -> None:
        raise NotImplementedError

    def live_bytes(self) -> int:
        raise NotImplementedError

    @contextlib.contextmanager
    def placement(self) -> Iterator[None]:
        """Tensors created inside land on this device by default (model building, batches)."""
        with torch.device(self.torch_device):
            yield

    def release(self) -> None:
        """Give memory back after a trial (call it outside any `except` block)."""
        gc.collect()

    def synchronize(self) -> None:
        pass

    def describe(self) -> dict:
        return {"device": self.kind, "gpu_name": self.name, "capacity_bytes": self.capacity_bytes}

    def lower_budget(self, budget_bytes: int) -> None:
        """Fit in less (the smallest budget of several ranks, so that they all probe alike)."""
        self.budget_bytes = min(self.budget_bytes, budget_bytes)

    def account(self, *objs) -> None:
        """Count tensors made outside `measure()` (batches drawn before it, a loaded optimizer state) on a simulated
        device; a no-op on cuda, whose allocator sees everything."""


class TrackedDevice(Device):
    """Simulated memory: a MemoryTracker enforces the budget the way the CUDA allocator would."""

    def __init__(self, kind: str, torch_device: torch.device, budget_bytes: int, capacity_bytes: int | None):
        self.kind = kind
        self.torch_device = torch_device
        self.budget_bytes = budget_bytes
        self.capacity_bytes = capacity_bytes
        self.tracker = MemoryTracker(budget_bytes, kind=kind)  # one accountant for the device's lifetime

    def _accounting(self) -> contextlib.AbstractContextManager:
        return self.tracker

    def _model_allocator(self) -> CachingAllocatorModel:
        model = CachingAllocatorModel()
        for key, size in self.tracker._sizes.items():  # what is alive already holds blocks too
            model.malloc(key, size)
        self.tracker.allocator = model
        return model

    def host_ledger(self) -> MemoryTracker:
        return self.tracker

    def _read_peak(self) -> tuple[int, int]:
        return self.tracker.peak_bytes, self.tracker.peak_bytes

    def _reset_peak(self) -> None:
        self.tracker.reset_peak()

    def live_bytes(self) -> int:
        return self.tracker.live_bytes

    def account(self, *objs) -> None:
        self.tracker.track(*objs)

    def lower_budget(self, budget_bytes: int) -> None:
        super().lower_budget(budget_bytes)
        self.tracker.budget_bytes = self.tensor_budget(self.budget_bytes)

    def tensor_budget(self, budget_bytes: int) -> int:
        """The tensor bytes a budget leaves: all of it (the fake device keeps its margin outside the tensors)."""
        return budget_bytes


class CpuDevice(TrackedDevice):
    def __init__(self, budget: str | None = None):
        total, available = system_memory()
        budget_bytes = parse_budget(budget, total) if budget else available
        super().__init__("cpu", torch.device("cpu"), budget_bytes, total)
        self.tracker.host_budget_bytes = available  # offloaded tensors share the machine's RAM with the rest
        self.name = f"cpu (simulated memory, budget {format_bytes(budget_bytes)})"


class FakeDevice(TrackedDevice):
    """The estimator: no compute. Inside `measure()` every tensor is a FakeTensor on the cpu device (shape,
    dtype and storage size, no data), so a trial builds the model and runs the real training step for the
    cost of its Python, and the same MemoryTracker as `cpu` counts the bytes: the two agree to the byte.
    The model is built straight into fake tensors (the design's meta device, already materialised), and
    `fakes.real_code_paths` makes them take real tensors' code path (`.to()` in build_model, masks' values).
    Where a shape depends on values it lacks, `compute_instead` measures on real tensors from then on.

    It stands in for a GPU of `budget` bytes: the peak it reports is the tensor peak plus `margin` (what a
    real GPU needs beyond tensors, see margin.Margin); its OOM fires when that total passes the budget."""

    kind = "fake"
    computes = False

    def __init__(self, budget: str | None = None, *, gpu=None, margin=None):
        from .margin import parse_margin

        capacity = gpu.memory_bytes if gpu is not None else None
        if budget is None and capacity is None:
            raise OomtuneError("--device fake has no memory of its own: give --budget (e.g. --budget 24GiB), "
                               "or estimate for a named card: oomtune estimate MODEL --gpu NAME")
        budget_bytes = parse_budget(budget, capacity) if budget else capacity
        self.margin = margin if margin is not None else parse_margin(None)
        super().__init__("fake", torch.device("cpu"), budget_bytes, capacity)
        self.tracker.budget_bytes = self.tensor_budget(budget_bytes)
        if self.tracker.budget_bytes <= 0:
            raise OomtuneError(f"budget {format_bytes(budget_bytes)} is not more than the margin "
                               f"{self.margin.describe()} a GPU needs beyond tensors (estimate and check take "
                               "--margin)")
        self._bf16 = gpu.bf16 if gpu is not None else True
        self.name = f"{gpu.name} (estimated)" if gpu is not None else "fake (estimated)"

    def supports_bf16(self) -> bool:
        return self._bf16

    @property
    def measures_speed(self) -> bool:
        return False  # it stands in for a GPU: the cpu's speed (after compute_instead) says nothing of the GPU's

    def tensor_budget(self, budget_bytes: int) -> int:
        return self.margin.tensor_budget(budget_bytes)

    def compute_instead(self) -> None:
        """Measure on real tensors from now on: the same tracker, budget and margin, the step computed on the cpu.
        For a model whose shapes depend on values fake tensors do not have (fakes.NeedsValues)."""
        self.computes = True

    def _accounting(self) -> contextlib.AbstractContextManager:
        if self.computes:
            return self.tracker
        stack = contextlib.ExitStack()  # a fresh FakeTensorMode per measured stretch; the tracker innermost
        stack.enter_context(FakeTensorMode(allow_non_fake_inputs=True))
        stack.enter_context(real_code_paths())  # .to() swaps, values of masks, libraries' tracing checks
        stack.enter_context(self.tracker)
        return stack

    def _read_peak(self) -> tuple[int, int]:
        return self.tracker.peak_bytes, self.margin.total(self.tracker.peak_bytes)


class CudaDevice(Device):
    """The real GPU. A budget below the card's free memory is enforced by capping the caching allocator."""

    kind = "cuda"

    def __init__(self, budget: str | None = None, index: int | None = None):
        if not torch.cuda.is_available():
            raise OomtuneError("--device cuda: no CUDA GPU is visible to PyTorch (try --device cpu)")
        index = torch.cuda.current_device() if index is None else index
        self.torch_device = torch.device("cuda", index)
        torch.cuda.set_device(self.torch_device)
        props = torch.cuda.get_device_properties(index)
        self.name = props.name
        self.capacity_bytes = props.total_memory
        self._bf16 = bool(torch.version.hip) or props.major >= 8  # native bf16; older cards only emulate it
        # cudaMemGetInfo creates this process's CUDA context first, so the free memory read below already
        # excludes it (the context and kernels live outside the caching allocator and outside any cap)
        cuda_free, device_total = torch.cuda.mem_get_info(index)
        nvml_free = _nvml_free_bytes(props)
        self.free_source = "nvml" if nvml_free is not None else "cudaMemGetInfo"
        # NVML's index is not torch's (CUDA_VISIBLE_DEVICES), so the GPU is matched by PCI address / UUID;
        # min(): under MIG NVML reports the whole card while cudaMemGetInfo reports this slice
        free = cuda_free if nvml_free is None else min(nvml_free, cuda_free)
        free += torch.cuda.memory_reserved(index)  # what our allocator already holds is ours to reuse
        self.free_bytes = free
        self.budget_bytes = parse_budget(budget, self.capacity_bytes) if budget else free
        if self.budget_bytes > free:
            raise OomtuneError(
                f"--budget {format_bytes(self.budget_bytes)} is more than the {format_bytes(free)} free on "
                f"{self.name} (other processes hold the rest; see `oomtune gpus`)"
            )
        # the cap applies to what the caching allocator reserves (past it, allocation raises an OOM) and is a
        # fraction of a total: cudaMemGetInfo's in older torch, totalGlobalMem in newer. The two agree in practice;
        # dividing by the larger keeps the cap at or under the budget either way
        self._total = max(device_total, props.total_memory)
        self._cap()
        self._host = MemoryTracker(kind="host")  # counts the pinned host tensors the offload levers make

    def host_ledger(self) -> MemoryTracker:
        return self._host

    def host(self) -> contextlib.AbstractContextManager:
        stack = contextlib.ExitStack()  # the ledger sees only the work done inside
        stack.enter_context(self._host)
        stack.enter_context(self._host.hosting())
        return stack

    @property
    def pin_memory(self) -> bool:
        return True

    def _cap(self) -> None:
        torch.cuda.set_per_process_memory_fraction(min(1.0, self.budget_bytes / self._total), self.torch_device)

    def lower_budget(self, budget_bytes: int) -> None:
        super().lower_budget(budget_bytes)
        self._cap()

    def supports_bf16(self) -> bool:
        # not torch.cuda.is_bf16_supported(): by default it also says yes where bf16 is only emulated (slow)
        return self._bf16

    def _read_peak(self) -> tuple[int, int]:
        return (torch.cuda.max_memory_allocated(self.torch_device),
                torch.cuda.max_memory_reserved(self.torch_device))

    def _reset_peak(self) -> None:
        torch.cuda.reset_peak_memory_stats(self.torch_device)

    def live_bytes(self) -> int:
        return torch.cuda.memory_allocated(self.torch_device)

    def release(self) -> None:
        gc.collect()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(self.torch_device)

    def synchronize(self) -> None:
        torch.cuda.synchronize(self.torch_device)


def _nvml_free_bytes(props) -> int | None:
    """NVML's free bytes for the GPU behind torch device properties `props` (None where NVML cannot say)."""
    from . import nvml

    gpu = nvml.gpu_of(props)
    return None if gpu is None else gpu.free_bytes


def resolve_kind(kind: str) -> str:
    """`auto` is cuda when PyTorch sees a GPU, else cpu; any other kind is itself."""
    if kind == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return kind


def make_device(kind: str = "auto", budget: str | None = None) -> Device:
    """A device of `kind` (auto: see resolve_kind) under `budget`."""
    kind = resolve_kind(kind)
    if kind == "cuda":
        return CudaDevice(budget)
    if kind == "cpu":
        return CpuDevice(budget)
    if kind == "fake":
        return FakeDevice(budget)
    raise OomtuneError(f"--device {kind!r}: expected one of {', '.join(DEVICE_KINDS)}")


_OOM_TEXT = (
    "CUDA out of memory",  # the caching allocator (and the simulated devices)
    "CUBLAS_STATUS_ALLOC_FAILED",  # cuBLAS could not get its workspace
    "CUDNN_STATUS_ALLOC_FAILED",  # nor cuDNN
    "CUDA error: out of memory",  # memory taken outside the caching allocator (kernels loaded lazily, NCCL)
    "DefaultCPUAllocator: can't allocate memory",  # the host ran out
)


def is_oom(exc: BaseException) -> bool:
    """Is this error the device running out of memory (real or simulated), rather than a bug?"""
    if isinstance(exc, torch.cuda.OutOfMemoryError):  # torch.OutOfMemoryError is this class, but only from 2.5
        return True
    return isinstance(exc, RuntimeError) and any(s in str(exc) for s in _OOM_TEXT)
