"""The real GPU as a Device: torch.cuda's peak statistics under a budget enforced on the caching allocator."""

from __future__ import annotations

import contextlib
import gc

import torch

from ..errors import OomtuneError
from ..units import format_bytes, parse_budget
from .cards import GpuSpec, card_for
from .devices import Device
from .leftovers import drop_failed_backward
from .tracker import MemoryTracker


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
        self.budget_bytes = parse_budget(budget, self.capacity_bytes) if budget is not None else free
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

    def profile(self) -> GpuSpec:
        """This card's profile: the card table's entry for its name, or one made from what the driver reports."""
        props = torch.cuda.get_device_properties(self.torch_device)
        return card_for(props.name, props.total_memory, (props.major, props.minor))

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
        drop_failed_backward()
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
