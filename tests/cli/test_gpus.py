"""`oomtune gpus` and the NVML seam, with NVML replaced by a fake pynvml module (no GPU needed)."""

from __future__ import annotations

import json
import re
from types import SimpleNamespace

import pytest

from oomtune.memory import cuda, nvml

from ..conftest import run_cli

GiB, MiB = 1024**3, 1024**2


class FakeNVMLError(Exception):
    """Stands in for pynvml.NVMLError: str() is NVML's own error text."""


class FakeNvml:
    """The pynvml functions oomtune.nvml calls, answering from `gpus` (dicts) like a real driver would."""

    def __init__(self, gpus=(), driver="550.54.15", cuda=12040, init_error=None, names=None):
        self.gpus = list(gpus)
        self.driver, self.cuda, self.init_error = driver, cuda, init_error
        self.names = names or {}  # pid -> process name; a missing pid raises like NVML_ERROR_NOT_FOUND
        self.inits = self.shutdowns = 0

    def nvmlInit(self):
        if self.init_error:
            raise FakeNVMLError(self.init_error)
        self.inits += 1

    def nvmlShutdown(self):
        self.shutdowns += 1

    def nvmlSystemGetDriverVersion(self):
        return self.driver

    def nvmlSystemGetCudaDriverVersion(self):
        return self.cuda

    def nvmlDeviceGetCount(self):
        return len(self.gpus)

    def nvmlDeviceGetHandleByIndex(self, i):
        return self.gpus[i]

    def nvmlDeviceGetName(self, h):
        return h["name"]

    def nvmlDeviceGetUUID(self, h):
        return h["uuid"]

    def nvmlDeviceGetMemoryInfo(self, h):
        return SimpleNamespace(total=h["total"], used=h["used"], free=h["total"] - h["used"])

    def nvmlDeviceGetPciInfo(self, h):
        d, b, dev = h["pci"]
        return SimpleNamespace(busId=f"{d:08X}:{b:02X}:{dev:02X}.0".encode(), domain=d, bus=b, device=dev)

    def nvmlDeviceGetCudaComputeCapability(self, h):
        return h["cc"]

    def nvmlDeviceGetComputeRunningProcesses(self, h):
        return [SimpleNamespace(pid=pid, usedGpuMemory=mem) for pid, mem in h.get("compute", ())]

    def nvmlDeviceGetGraphicsRunningProcesses(self, h):
        return [SimpleNamespace(pid=pid, usedGpuMemory=mem) for pid, mem in h.get("graphics", ())]

    def nvmlSystemGetProcessName(self, pid):
        if pid not in self.names:
            raise FakeNVMLError("Not Found")
        return self.names[pid]


def h100(**kw):
    gpu = {"name": "NVIDIA H100 80GB HBM3", "uuid": "GPU-0a1b2c3d-0000-1111-2222-333344445555", "pci": (0, 0x65, 0),
           "total": 80 * GiB, "used": 30 * GiB, "cc": (9, 0)}
    return gpu | kw


@pytest.fixture
def fake_nvml(monkeypatch):
    """fake_nvml(FakeNvml(...)) makes it what oomtune.nvml loads; returns it."""

    def install(fake):
        monkeypatch.setattr(nvml, "_load", lambda: fake)
        return fake

    return install


def row(text: str, first_cell: str) -> list[str]:
    """The cells of the rendered table row whose first cell is `first_cell` (split on 2+ spaces)."""
    for line in text.splitlines():
        cells = re.split(r"\s{2,}", line.strip())
        if cells and cells[0] == first_cell:
            return cells
    raise AssertionError(f"no row starting with {first_cell!r} in:\n{text}")


# -- no driver -----------------------------------------------------------------------------------

def test_no_driver_says_so_and_exits_0(fake_nvml):
    fake = fake_nvml(FakeNvml(init_error="Driver Not Loaded"))
    r = run_cli("gpus")
    assert r.exit_code == 0, r.output
    assert len(r.stdout.strip().splitlines()) == 1, r.stdout  # one line, whatever the terminal's width
    text = r.stdout
    assert "no NVIDIA GPU visible: NVML is unavailable (Driver Not Loaded)" in text
    assert "--device cpu" in text
    assert fake.shutdowns == 0  # nothing to shut down when init failed

    r = run_cli("gpus", "--json")
    assert r.exit_code == 0
    assert json.loads(r.stdout) == {"available": False, "reason": "Driver Not Loaded", "driver_version": None,
                                    "cuda_driver_version": None, "gpus": []}


def test_without_the_nvml_package_the_reason_names_it(fake_nvml):
    fake_nvml(None)  # `import pynvml` failed
    r = run_cli("gpus", "--json")
    assert r.exit_code == 0
    assert json.loads(r.stdout)["reason"] == "the nvidia-ml-py package (module pynvml) is not installed"


# -- one GPU, two processes ----------------------------------------------------------------------

def one_gpu_two_processes() -> FakeNvml:
    gpu = h100(compute=[(4242, 20 * GiB), (777, 512 * MiB)], graphics=[(777, 512 * MiB)])
    return FakeNvml([gpu], names={4242: "python3 train.py", 777: "/usr/lib/xorg/Xorg"})


def test_one_gpu_with_two_processes_renders_memory_versions_and_processes(fake_nvml):
    fake = fake_nvml(one_gpu_two_processes())
    r = run_cli("gpus")
    assert r.exit_code == 0, r.output
    out = r.stdout
    assert "NVIDIA driver 550.54.15, CUDA 12.4" in out
    assert "1 GPU" in out and "1 GPUs" not in out
    assert row(out, "0") == ["0", "NVIDIA H100 80GB HBM3", "80.00 GiB", "30.00 GiB", "50.00 GiB", "9.0", "yes", "2"]
    assert "processes on GPU 0" in out
    assert row(out, "4242") == ["4242", "20.00 GiB", "compute", "python3 train.py"]
    # in both NVML lists (compute and graphics): one row, like nvidia-smi's C+G
    assert row(out, "777") == ["777", "512.00 MiB", "compute+graphics", "/usr/lib/xorg/Xorg"]
    assert fake.inits == fake.shutdowns == 1


def test_one_gpu_with_two_processes_json(fake_nvml):
    fake_nvml(one_gpu_two_processes())
    r = run_cli("gpus", "--json")
    assert r.exit_code == 0, r.output
    data = json.loads(r.stdout)
    assert (data["available"], data["driver_version"], data["cuda_driver_version"]) == (True, "550.54.15", "12.4")
    (g,) = data["gpus"]
    assert g == {
        "index": 0, "name": "NVIDIA H100 80GB HBM3", "uuid": "GPU-0a1b2c3d-0000-1111-2222-333344445555",
        "pci_bus_id": "00000000:65:00.0", "pci": [0, 0x65, 0], "total_bytes": 80 * GiB, "used_bytes": 30 * GiB,
        "free_bytes": 50 * GiB, "compute_capability": "9.0", "bf16": True,
        "processes": [
            {"pid": 777, "name": "/usr/lib/xorg/Xorg", "used_bytes": 512 * MiB, "kind": "compute+graphics"},
            {"pid": 4242, "name": "python3 train.py", "used_bytes": 20 * GiB, "kind": "compute"},
        ],
    }


def test_a_process_nvml_will_not_name_or_measure_is_shown_as_unknown(fake_nvml):
    fake_nvml(FakeNvml([h100(compute=[(99, None)])]))  # another container: no name, no memory figure
    r = run_cli("gpus")
    assert row(r.stdout, "99") == ["99", "n/a", "compute", "?"]
    assert json.loads(run_cli("gpus", "--json").stdout)["gpus"][0]["processes"] == [
        {"pid": 99, "name": "?", "used_bytes": None, "kind": "compute"}]


# -- two GPUs ------------------------------------------------------------------------------------

def two_gpus() -> FakeNvml:
    a100 = {"name": "NVIDIA A100-SXM4-40GB", "uuid": "GPU-aaaa", "pci": (0, 0x07, 0), "total": 40 * GiB,
            "used": 1 * GiB, "cc": (8, 0), "compute": [(1001, 1 * GiB)]}
    v100 = {"name": "Tesla V100-SXM2-16GB", "uuid": "GPU-bbbb", "pci": (0, 0x3B, 0), "total": 16 * GiB,
            "used": 256 * MiB, "cc": (7, 0)}
    return FakeNvml([a100, v100], driver="535.104.05", cuda=12020, names={1001: "python"})


def test_two_gpus_each_get_a_row_and_bf16_follows_compute_capability(fake_nvml):
    fake_nvml(two_gpus())
    r = run_cli("gpus")
    assert r.exit_code == 0, r.output
    out = r.stdout
    assert "NVIDIA driver 535.104.05, CUDA 12.2" in out and "2 GPUs" in out
    assert row(out, "0") == ["0", "NVIDIA A100-SXM4-40GB", "40.00 GiB", "1.00 GiB", "39.00 GiB", "8.0", "yes", "1"]
    assert row(out, "1") == ["1", "Tesla V100-SXM2-16GB", "16.00 GiB", "256.00 MiB", "15.75 GiB", "7.0", "no", "0"]
    assert row(out, "1001") == ["1001", "1.00 GiB", "compute", "python"]
    assert "no processes on GPU 1" in out


def test_two_gpus_json(fake_nvml):
    fake_nvml(two_gpus())
    data = json.loads(run_cli("gpus", "--json").stdout)
    assert [(g["index"], g["name"], g["free_bytes"], g["compute_capability"], g["bf16"], len(g["processes"]))
            for g in data["gpus"]] == [(0, "NVIDIA A100-SXM4-40GB", 39 * GiB, "8.0", True, 1),
                                       (1, "Tesla V100-SXM2-16GB", 16 * GiB - 256 * MiB, "7.0", False, 0)]


# -- mapping torch's device to NVML's --------------------------------------------------------------

def test_free_bytes_finds_the_gpu_by_pci_address_not_by_index(fake_nvml):
    fake_nvml(two_gpus())
    # CUDA_VISIBLE_DEVICES=1: torch's cuda:0 is NVML's GPU 1 (bus 0x3B)
    assert nvml.free_bytes(pci=(0, 0x3B, 0)) == 16 * GiB - 256 * MiB
    assert nvml.free_bytes(pci=(0, 0x07, 0)) == 39 * GiB
    assert nvml.free_bytes(pci=(0, 0x99, 0)) is None  # a GPU NVML does not list: no number rather than a wrong one


def test_free_bytes_falls_back_to_the_uuid_with_or_without_nvml_prefix(fake_nvml):
    fake_nvml(two_gpus())
    assert nvml.free_bytes(uuid="bbbb") == 16 * GiB - 256 * MiB  # torch prints the uuid without "GPU-"
    assert nvml.free_bytes(pci=None, uuid="GPU-AAAA") == 39 * GiB


def test_free_bytes_is_none_without_a_driver(fake_nvml):
    fake_nvml(FakeNvml(init_error="Driver Not Loaded"))
    assert nvml.free_bytes(pci=(0, 0x65, 0)) is None


def test_the_cuda_device_asks_nvml_for_its_own_gpu_by_torch_device_properties(fake_nvml):
    fake_nvml(two_gpus())
    props = SimpleNamespace(pci_domain_id=0, pci_bus_id=0x3B, pci_device_id=0, uuid="not-a-known-uuid")
    assert cuda._nvml_free_bytes(props) == 16 * GiB - 256 * MiB
    older_torch = SimpleNamespace(uuid="aaaa")  # no pci_* attributes: the uuid decides
    assert cuda._nvml_free_bytes(older_torch) == 39 * GiB
    assert cuda._nvml_free_bytes(SimpleNamespace()) is None


def test_cuda_version_text():
    assert [nvml.cuda_version_text(v) for v in (12040, 12020, 11080, 13000)] == ["12.4", "12.2", "11.8", "13.0"]
