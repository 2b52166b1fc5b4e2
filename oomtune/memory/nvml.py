"""The one seam to NVML (the library behind nvidia-smi): the only module that imports pynvml.

Tests replace `_load()` with a fake module that has the few pynvml functions used here. Everything
returns plain dataclasses; nothing here prints or imports torch.

NVML numbers GPUs by PCI bus order and ignores CUDA_VISIBLE_DEVICES, while PyTorch's index follows
CUDA_VISIBLE_DEVICES (and CUDA_DEVICE_ORDER): never pass a torch index to NVML. `find_gpu` matches by
PCI address (domain, bus, device), then by UUID.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field

BF16_MIN_CC = (8, 0)  # native bfloat16 from Ampere on; older cards only emulate it (slowly)


class NvmlUnavailable(Exception):
    """NVML cannot be used here: no driver, no library, no package. The message says which."""


@dataclass(frozen=True)
class GpuProcess:
    pid: int  # as the driver sees it: a host pid, which inside a container may not match /proc
    name: str  # the executable NVML reports, "?" where it will not say (another container, no permission)
    used_bytes: int | None  # None where the driver does not report it (MIG, some containers, Windows WDDM)
    kind: str = "compute"  # compute | graphics | compute+graphics


@dataclass(frozen=True)
class GpuInfo:
    index: int  # NVML's index (PCI order): what nvidia-smi shows, not necessarily torch's cuda:N
    name: str
    uuid: str  # "GPU-..."
    pci_bus_id: str  # "00000000:65:00.0"
    pci: tuple[int, int, int] | None  # (domain, bus, device): what torch's device properties report too
    total_bytes: int
    used_bytes: int
    free_bytes: int  # what another process may still allocate: other processes' memory already excluded
    compute_capability: tuple[int, int] | None
    processes: tuple[GpuProcess, ...] = ()

    @property
    def bf16(self) -> bool | None:
        """Native bfloat16 (compute capability 8.0+); None where NVML did not report the capability."""
        return None if self.compute_capability is None else self.compute_capability >= BF16_MIN_CC


@dataclass(frozen=True)
class NvmlReport:
    available: bool
    reason: str | None = None  # why NVML is unavailable (available=False)
    driver_version: str | None = None  # "550.54.15"
    cuda_driver_version: str | None = None  # the newest CUDA the driver supports: "12.4"
    gpus: tuple[GpuInfo, ...] = field(default=())


def _load():
    """The pynvml module (from the nvidia-ml-py package), not yet initialised; None where it is not
    installed. Tests replace this function with a fake module."""
    try:
        import pynvml
    except ImportError:
        return None
    return pynvml


def _text(value) -> str:
    return value.decode(errors="replace") if isinstance(value, bytes) else str(value)


@contextlib.contextmanager
def _session() -> Iterator:
    """NVML initialised for the block, shut down after (NVML counts init/shutdown pairs)."""
    nv = _load()
    if nv is None:
        raise NvmlUnavailable("the nvidia-ml-py package (module pynvml) is not installed")
    try:
        nv.nvmlInit()
    except Exception as e:  # NVMLError_LibraryNotFound / _DriverNotLoaded / _NoPermission / ...
        raise NvmlUnavailable(_text(e) or type(e).__name__) from e
    try:
        yield nv
    finally:
        with contextlib.suppress(Exception):
            nv.nvmlShutdown()


def cuda_version_text(v: int) -> str:
    """NVML's integer CUDA version -> "major.minor": 12040 -> "12.4"."""
    return f"{v // 1000}.{v % 1000 // 10}"


def _processes(nv, handle) -> tuple[GpuProcess, ...]:
    """Compute and graphics processes on one GPU, merged by pid (a process can be both)."""
    found: dict[int, GpuProcess] = {}
    for kind, getter in (("compute", "nvmlDeviceGetComputeRunningProcesses"),
                         ("graphics", "nvmlDeviceGetGraphicsRunningProcesses")):
        fn = getattr(nv, getter, None)
        if fn is None:
            continue
        try:
            procs = fn(handle)
        except Exception:  # not supported on this GPU / driver: that list is simply unknown
            continue
        for p in procs:
            pid = int(p.pid)
            used = getattr(p, "usedGpuMemory", None)
            used = None if used is None else int(used)
            if pid in found:  # the same process in both lists: one row, as nvidia-smi's "C+G"
                prev = found[pid]
                sizes = [x for x in (prev.used_bytes, used) if x is not None]
                found[pid] = GpuProcess(pid, prev.name, max(sizes) if sizes else None, f"{prev.kind}+{kind}")
                continue
            try:
                name = _text(nv.nvmlSystemGetProcessName(pid)) or "?"
            except Exception:
                name = "?"
            found[pid] = GpuProcess(pid, name, used, kind)
    return tuple(sorted(found.values(), key=lambda p: p.pid))


def _gpu(nv, index: int, with_processes: bool) -> GpuInfo:
    handle = nv.nvmlDeviceGetHandleByIndex(index)
    mem = nv.nvmlDeviceGetMemoryInfo(handle)
    try:
        uuid = _text(nv.nvmlDeviceGetUUID(handle))
    except Exception:
        uuid = ""
    try:
        pci_info = nv.nvmlDeviceGetPciInfo(handle)
        pci_bus_id = _text(pci_info.busId)
        pci = (int(pci_info.domain), int(pci_info.bus), int(pci_info.device))
    except Exception:
        pci_bus_id, pci = "", None
    try:
        major, minor = nv.nvmlDeviceGetCudaComputeCapability(handle)
        cc = (int(major), int(minor))
    except Exception:
        cc = None
    return GpuInfo(
        index=index, name=_text(nv.nvmlDeviceGetName(handle)), uuid=uuid, pci_bus_id=pci_bus_id, pci=pci,
        total_bytes=int(mem.total), used_bytes=int(mem.used), free_bytes=int(mem.free), compute_capability=cc,
        processes=_processes(nv, handle) if with_processes else (),
    )


def query(processes: bool = True) -> NvmlReport:
    """Every GPU NVML sees, with memory and (optionally) the processes using it. Never raises: where NVML
    cannot be used the report says why (available=False)."""
    try:
        with _session() as nv:
            try:
                driver = _text(nv.nvmlSystemGetDriverVersion())
            except Exception:
                driver = None
            try:
                cuda = cuda_version_text(int(nv.nvmlSystemGetCudaDriverVersion()))
            except Exception:
                cuda = None
            count = int(nv.nvmlDeviceGetCount())
            gpus = tuple(_gpu(nv, i, processes) for i in range(count))
    except NvmlUnavailable as e:
        return NvmlReport(available=False, reason=str(e))
    except Exception as e:  # NVML answered init but failed a query (GPU lost, permissions)
        return NvmlReport(available=False, reason=f"NVML query failed: {_text(e) or type(e).__name__}")
    return NvmlReport(available=True, driver_version=driver, cuda_driver_version=cuda, gpus=gpus)


def _bare_uuid(u: str) -> str:
    u = u.strip().lower()
    for prefix in ("gpu-", "mig-"):
        u = u.removeprefix(prefix)
    return u


def find_gpu(report: NvmlReport, *, pci: tuple[int, int, int] | None = None,
             uuid: str | None = None) -> GpuInfo | None:
    """The GPU with this PCI address (domain, bus, device) or, failing that, this UUID (with or without
    NVML's "GPU-" prefix, as torch prints it). None when neither matches exactly one GPU."""
    if pci is not None:
        hits = [g for g in report.gpus if g.pci == tuple(pci)]
        if len(hits) == 1:
            return hits[0]
    if uuid:
        hits = [g for g in report.gpus if g.uuid and _bare_uuid(g.uuid) == _bare_uuid(uuid)]
        if len(hits) == 1:
            return hits[0]
    return None


def free_bytes(*, pci: tuple[int, int, int] | None = None, uuid: str | None = None) -> int | None:
    """Free memory on the GPU with this PCI address or UUID as NVML sees it (other processes' memory
    already excluded), or None where NVML is unavailable or the GPU is not found."""
    gpu = find_gpu(query(processes=False), pci=pci, uuid=uuid)
    return None if gpu is None else gpu.free_bytes


def ids_of(props) -> tuple[tuple[int, int, int] | None, str | None]:
    """(PCI address, UUID) of the GPU behind torch's device properties (`torch.cuda.get_device_properties`): what
    matches it to NVML's GPU whatever CUDA_VISIBLE_DEVICES says. Attributes of recent PyTorch: None where missing."""
    pci = None
    if all(hasattr(props, a) for a in ("pci_domain_id", "pci_bus_id", "pci_device_id")):
        pci = (props.pci_domain_id, props.pci_bus_id, props.pci_device_id)
    uuid = str(props.uuid) if getattr(props, "uuid", None) is not None else None
    return pci, uuid


def gpu_of(props, report: NvmlReport | None = None, processes: bool = False) -> GpuInfo | None:
    """NVML's view of the GPU behind torch's device properties (from `report`, else a fresh query); None where NVML
    is unavailable or does not list it."""
    pci, uuid = ids_of(props)
    if pci is None and uuid is None:
        return None
    return find_gpu(report if report is not None else query(processes=processes), pci=pci, uuid=uuid)


def used_by(props, pid: int) -> int | None:
    """Memory process `pid` holds on the GPU behind `props`, as nvidia-smi shows it; else the whole GPU's used memory
    (inside a container NVML's pids may not match ours); None without NVML."""
    gpu = gpu_of(props, processes=True)
    if gpu is None:
        return None
    mine = next((p.used_bytes for p in gpu.processes if p.pid == pid and p.used_bytes is not None), None)
    return mine if mine is not None else gpu.used_bytes
