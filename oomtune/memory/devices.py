"""Where a trial runs and how its memory is measured.

cuda: a real GPU, read by torch.cuda.max_memory_allocated / _reserved and NVML, the caching allocator's
OOM (capped); cpu: real compute, a MemoryTracker (tensor storages, 512-byte rounding) raising CUDA-shaped OOMs;
fake: the same MemoryTracker on FakeTensors (no data). A card profile (`--gpu NAME`) makes cpu and fake account
like that CUDA card (TrackedDevice). Everything else (building the model, the training step) is identical across
devices: a device only decides where tensors live and how the peak is read.
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator

import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from ..errors import OomtuneError
from ..units import card_budget, format_bytes, parse_budget
from .allocator import CachingAllocatorModel, OutOfMemory
from .cards import GpuSpec
from .cuda_autocast import cuda_autocast
from .cuda_kernels import cuda_kernels
from .fakes import real_code_paths
from .imports import imports_outside
from .leftovers import drop_failed_backward
from .margin import AnyMargin, CardMargin, Margin, parse_margin
from .on_host import CudaOnHost, cuda_autocast_on_host
from .reading import Reading
from .replay import Lines, Trace, replay
from .tracker import MemoryTracker, simulated_oom_message, system_memory

DEVICE_KINDS = ("auto", "cuda", "cpu", "fake")


class Device:
    """Base: a torch device plus a way to measure peak memory under a budget."""

    kind: str = ""
    name: str = ""
    torch_device: torch.device
    budget_bytes: int
    capacity_bytes: int | None = None
    card: GpuSpec | None = None  # the CUDA card a simulated device accounts like (--gpu); cuda is a card itself
    computes: bool = True  # False where tensors hold no values (the fake device): losses cannot be read
    primes: bool = False  # trials make the first step's optimizer state without the step (FakeDevice.primes)

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
            reading.trace = self._take_trace()
            reading.host_peak_bytes = self.host_ledger().host_peak_bytes
            if allocator is not None:  # a simulated device's: the model detached from the tracker
                self.tracker.allocator = None

    def _model_allocator(self) -> CachingAllocatorModel | None:
        """A fresh model of the CUDA caching allocator, fed this measurement's storages (simulated devices)."""
        return None

    def _take_trace(self) -> Trace | None:
        """What the measurement's storages did, where the device traces them (TrackedDevice.traces)."""
        return None

    def host_ledger(self) -> MemoryTracker:
        """The tracker that counts host-resident storages (`host()`)."""
        raise NotImplementedError

    def host(self) -> contextlib.AbstractContextManager:
        """Tensors made inside live in host memory (the offload levers): pinned CPU memory on cuda; on the simulated
        devices, CPU tensors the tracker counts as host memory, apart from the device's budget."""
        return self.host_ledger().hosting()

    pin_memory = False  # (CudaDevice: True)

    def mark(self, reading: Reading, phase: str | None) -> None:
        """Close the running phase (record its peak) and start `phase`."""
        self.synchronize()
        allocated, reserved = self._read_peak()
        modelled = self._read_modelled_peak()
        if modelled is not None:
            reading.modelled_reserved_bytes = max(reading.modelled_reserved_bytes or 0, modelled)
        reading.phase_peaks[reading.phase] = max(reading.phase_peaks.get(reading.phase, 0), allocated)
        reading.peak_allocated_bytes = max(reading.peak_allocated_bytes, allocated)
        reading.peak_bytes = max(reading.peak_bytes, reserved)
        self._reset_peak()
        self._trace_mark(phase)
        if phase is not None:
            reading.phase = phase

    def _accounting(self) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()

    def _trace_mark(self, phase: str | None) -> None:
        pass

    def _read_peak(self) -> tuple[int, int]:
        """(allocated, reserved) peak bytes since the last reset."""
        raise NotImplementedError

    def _reset_peak(self) -> None:
        raise NotImplementedError

    def _read_modelled_peak(self) -> int | None:
        """The caching allocator model's reserved peak since the last reset (simulated devices, inside measure())."""
        return None

    def live_bytes(self) -> int:
        raise NotImplementedError

    @contextlib.contextmanager
    def placement(self) -> Iterator[None]:
        """Tensors made inside land here by default (model, batches); simulated: `.to("cuda")` too (on_host.py)."""
        with torch.device(self.torch_device), CudaOnHost() if self.kind != "cuda" else contextlib.nullcontext():
            yield

    def release(self) -> None:
        """Give memory back after a trial (call it outside any `except` block); a failed backward's too (leftovers)."""
        drop_failed_backward()
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
    """Simulated memory: a MemoryTracker enforces the budget the way the CUDA allocator would.

    With a card profile (`card`, `--gpu NAME`) it accounts like that CUDA card: CUDA autocast's policy
    (cuda_autocast.py), the SDPA and dropout kernels the card would run (cuda_kernels.py), and, unless a flat
    `margin` is given, the card's margin (margin.CardMargin: context + the caching allocator model, which runs out
    of memory where the card's allocator would). Without one it accounts CPU semantics, and `margin` (default none)
    is added to the tensor peak."""

    def __init__(self, kind: str, torch_device: torch.device, budget_bytes: int, capacity_bytes: int | None,
                 card: GpuSpec | None = None, margin: AnyMargin | None = None):
        self.kind = kind
        self.torch_device = torch_device
        self.budget_bytes = budget_bytes
        self.capacity_bytes = capacity_bytes
        if isinstance(margin, CardMargin) and card is not None and margin.card != card:
            raise OomtuneError(f"--margin {margin.describe()} is another card's margin than --gpu {card.aliases[0]}'s")
        self.card = margin.card if isinstance(margin, CardMargin) else card
        self.margin = margin if margin is not None else (CardMargin(card) if card is not None else Margin())
        self.never_runs_out = False  # (the prior's fake device: FakeDevice)
        self.traces = False  # each measurement's Reading holds its Trace (replay.py: the probe's prior sets it)
        self.traced_from = [], []  # a traced measurement's live storages at its start (key, size): device, host
        self.tracker = MemoryTracker(kind=kind)  # one accountant for the device's lifetime
        self.tracker.budget_bytes = self.tensor_budget(budget_bytes)
        if self.tracker.budget_bytes <= 0:
            raise OomtuneError(f"budget {format_bytes(budget_bytes)} is not more than what a GPU needs beyond tensors "
                               f"({self.margin.text()}): give a larger --budget, or --margin 0 to count tensors alone")

    def supports_bf16(self) -> bool:
        return self.card is None or self.card.bf16

    def _accounting(self) -> contextlib.AbstractContextManager:
        self.tracker.limit_to_ram(self.computes)  # real tensors: a budget past the RAM must not take the machine down
        with contextlib.ExitStack() as stack:  # (what was entered is exited if a later one fails)
            stack.enter_context(cuda_autocast_on_host())  # a model file's own torch.autocast("cuda")
            if self.card is not None:
                stack.enter_context(cuda_autocast())
                stack.enter_context(cuda_kernels(self.card))
            stack.enter_context(self.tracker)
            stack.enter_context(imports_outside())  # what a library makes as it is imported is not the trial's
            return stack.pop_all()

    def _model_allocator(self) -> CachingAllocatorModel:
        model = self.fresh_allocator()
        alive = list(self.tracker._sizes.items())  # (a storage's finalizer may run while the model is filled)
        if self.traces:
            self.tracker.events = []
            self.traced_from = alive, list(self.tracker._host_sizes.items())
        try:
            for key, size in alive:  # what is alive already holds blocks too
                model.malloc(key, size)
        except OutOfMemory as e:  # what lives already does not fit: the trial runs out of memory at once
            raise torch.cuda.OutOfMemoryError(simulated_oom_message(
                size, model.capacity_bytes, model.reserved_bytes, self.kind, f" {e}.")) from None
        self.tracker.allocator = model
        for key in {k for k, _ in alive} - self.tracker._sizes.keys():  # died while the model was filled
            model.free(key)
        model.reset_peak()
        return model

    def fresh_allocator(self) -> CachingAllocatorModel:
        """The allocator model a measurement starts from (seeded with what the margin holds), before it is fed what
        lives already."""
        # with no budget to run out of (a breakdown's, lifted to measure a plan that does not fit too; the prior's)
        # it frees its cache at the capacity as the card does, then goes past it: a plan that fits reads as its trial
        model = CachingAllocatorModel(self.margin.allocator_capacity(self.budget_bytes),
                                      overflows=self.tracker.budget_bytes is None)
        self.margin.seed(model)  # the budget check made room for it
        return model

    def _trace_mark(self, phase: str | None) -> None:
        if self.tracker.events is not None:
            self.tracker.events.append(("mark", phase))

    def _take_trace(self) -> Trace | None:
        events, self.tracker.events = self.tracker.events, None
        return Trace.of(self.traced_from[0], events, self.traced_from[1]) if events is not None else None

    def replay(self, lines: Lines, micro_batch: int) -> Reading | None:
        """The Reading a traced measurement would give at `micro_batch` (replay.py); None where the lines do not
        reach it. Only on a device that never runs out of memory (the prior's): a replay does not raise the OOM."""
        if not self.never_runs_out:
            raise ValueError("replay() needs a device that never runs out of memory")
        return replay(lines, micro_batch, self.fresh_allocator(), self.margin.total)

    def host_ledger(self) -> MemoryTracker:
        return self.tracker

    def _read_peak(self) -> tuple[int, int]:
        return self.tracker.peak_bytes, self.margin.total(self.tracker.peak_bytes, self._read_modelled_peak())

    def _read_modelled_peak(self) -> int | None:
        model = self.tracker.allocator
        return model.peak_reserved_bytes if model is not None else None

    def _reset_peak(self) -> None:
        self.tracker.reset_peak()
        if self.tracker.allocator is not None:
            self.tracker.allocator.reset_peak()

    def live_bytes(self) -> int:
        return self.tracker.live_bytes

    def account(self, *objs) -> None:
        self.tracker.track(*objs)

    def lower_budget(self, budget_bytes: int) -> None:
        super().lower_budget(budget_bytes)
        if not self.never_runs_out:
            self.tracker.budget_bytes = self.tensor_budget(self.budget_bytes)

    def tensor_budget(self, budget_bytes: int) -> int:
        """The tensor bytes a budget leaves once the margin is taken out."""
        return self.margin.tensor_budget(budget_bytes)

    def card_text(self) -> str:
        """Which card's rules it accounts by, for the user."""
        return "CPU semantics (no card profile)" if self.card is None else f"{self.card.name} ({self.card.sm})"


class CpuDevice(TrackedDevice):
    def __init__(self, budget: str | None = None, card: GpuSpec | None = None, margin: AnyMargin | None = None):
        """The budget: --budget (a percentage of the card's memory with a card, else of the RAM); without it the
        card's memory, or else the available RAM."""
        total, available = system_memory()
        card_memory = card.memory_bytes if card is not None else None
        budget_bytes = parse_budget(budget, card_memory or total) if budget is not None else (card_memory or available)
        super().__init__("cpu", torch.device("cpu"), budget_bytes, total, card, margin)
        self.tracker.host_budget_bytes = available  # offloaded tensors share the machine's RAM with the rest
        like = f", accounting as {self.card_text()}" if card is not None else ""
        self.name = f"cpu (simulated memory, budget {format_bytes(budget_bytes)}{like})"


class FakeDevice(TrackedDevice):
    """The estimator: no compute. Inside `measure()` every tensor is a FakeTensor on the cpu device (shape,
    dtype and storage size, no data), so a trial builds the model and runs the real training step for the
    cost of its Python, and the same MemoryTracker as `cpu` counts the bytes: the two agree to the byte.
    The model is built straight into fake tensors (the design's meta device, already materialised), and
    `fakes.real_code_paths` makes them take real tensors' code path (`.to()` in build_model, masks' values).
    Where a shape depends on values it lacks, `compute_instead` measures on real tensors from then on.

    It stands in for a GPU of `budget` bytes (default: the card's memory): the peak it reports is the tensor peak
    plus the margin (the card's own, or a flat `margin`; without a card, the default flat rule), and its OOM fires
    where that passes the budget. `may_compute=False`: never switch to real tensors (the probe's prior, which
    stands in for a GPU and must not train the model on the host instead). `never_runs_out` (the prior's, which
    never computes): no trial runs out of memory, each reports its peak, however far past the budget, and the search
    still judges it against the limit; a size past the limit then tells the search by how much, which an OOM
    does not (fewer trials: ladder.LadderSearch.largest_batch's chord). `traces` (the prior's too): each
    measurement's Reading holds its Trace, from which other micro-batches are replayed (replay.py)."""

    kind = "fake"
    computes = False

    def __init__(self, budget: str | None = None, *, gpu: GpuSpec | None = None, margin: AnyMargin | None = None,
                 may_compute: bool = True, never_runs_out: bool = False, traces: bool = False):
        capacity = gpu.memory_bytes if gpu is not None else None
        if budget is None and capacity is None:  # (the generic card: --gpu generic, or probe's without --gpu)
            nor = " (nor has the generic card)" if gpu is not None else ""
            raise OomtuneError(f"--device fake has no memory of its own{nor}: give --budget (e.g. --budget 24GiB) or "
                               "a card, --gpu NAME (e.g. --gpu a100-80)")
        budget_bytes = parse_budget(budget, capacity) if budget is not None else capacity
        if margin is None and gpu is None:
            margin = parse_margin(None)
        super().__init__("fake", torch.device("cpu"), budget_bytes, capacity, gpu, margin)
        self.name = f"{gpu.name} (estimated)" if gpu is not None else "fake (estimated)"
        self.may_compute = may_compute and not never_runs_out  # (real tensors with no budget could fill the RAM)
        self.never_runs_out = never_runs_out
        self.traces = traces
        if never_runs_out:
            self.tracker.budget_bytes = None

    @property
    def measures_speed(self) -> bool:
        return False  # it stands in for a GPU: the cpu's speed (after compute_instead) says nothing of the GPU's

    @property
    def primes(self) -> bool:
        """A trial makes the first step's optimizer state without that step (step.make_optimizer_state): the same
        tensor peak for one forward and backward less. Not where the caching allocator model decides the peak (a
        card's margin): what it reserves depends on every allocation before, the first step's included."""
        return not self.computes and not isinstance(self.margin, CardMargin)

    def compute_instead(self) -> None:
        """Real tensors from now on, computed on the cpu, same tracker, budget and margin (fakes.NeedsValues)."""
        self.computes = True

    def _accounting(self) -> contextlib.AbstractContextManager:
        if self.computes:
            return super()._accounting()
        with contextlib.ExitStack() as stack:  # a fresh FakeTensorMode per measured stretch; the tracker innermost
            stack.enter_context(FakeTensorMode(allow_non_fake_inputs=True))  # .to() swaps, masks' values, the CPU's
            stack.enter_context(real_code_paths(cpu_kernels=True, tracker=self.tracker))  # kernels, run by the tracker
            stack.enter_context(super()._accounting())
            return stack.pop_all()


def resolve_kind(kind: str) -> str:
    """`auto` is cuda when PyTorch sees a GPU, else cpu; any other kind is itself."""
    if kind == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return kind


def make_device(kind: str = "auto", budget: str | None = None, card: GpuSpec | None = None,
                margin: AnyMargin | None = None) -> Device:
    """A device of `kind` (auto: see resolve_kind) under `budget`; a simulated one accounting like `card`, with
    `margin` (None: the device's default) for what a GPU needs beyond tensors."""
    kind = resolve_kind(kind)
    if kind == "cuda":
        if card is not None:
            raise OomtuneError(f"--gpu {card.aliases[0]} is for the simulated devices (--device cpu or fake): on cuda "
                               "the card is the one you have")
        from .cuda import CudaDevice

        return CudaDevice(budget)
    if budget is not None and card is not None:  # the user's --budget with --gpu: no more than the card has
        card_budget(budget, card)
    if kind == "cpu":
        return CpuDevice(budget, card, margin)
    if kind == "fake":
        return FakeDevice(budget, gpu=card, margin=margin)
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
