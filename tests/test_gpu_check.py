"""scripts/gpu_check.py without a GPU: its no-GPU path and its helpers (the GPU path is `make gpu-check`)."""

import importlib.util
import json
import os
import subprocess
import sys

import pytest
import torch

from .conftest import ROOT


def load_script():
    spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "scripts" / "gpu_check.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is visible: run the real check, `make gpu-check`")
def test_without_a_gpu_it_says_so_writes_the_report_and_exits_3(tmp_path):
    env = dict(os.environ, OUT=str(tmp_path), PYTHONPATH=str(ROOT))
    r = subprocess.run([sys.executable, "scripts/gpu_check.py"], cwd=ROOT, env=env, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 3, r.stdout + r.stderr
    assert "**no CUDA GPU**: torch.cuda.is_available() is False" in r.stdout
    assert "Nothing was checked" in r.stdout
    data = json.loads((tmp_path / "gpu_check.json").read_text())
    assert data["status"] == "no-gpu" and data["environment"]["cuda_available"] is False
    assert "no CUDA GPU" in (tmp_path / "gpu_check.md").read_text()


def test_pytest_summary_and_relative_error_helpers():
    g = load_script()
    out = "....F.s\nFAILED tests/test_gpu.py::test_x - 2 passed in a message\n1 failed, 8 passed, 1 skipped in 61.2s\n"
    assert g.pytest_counts(out) == {"failed": 1, "passed": 8, "skipped": 1}
    assert g.pytest_counts("no tests ran in 0.01s") == {}
    assert [g.pct(110, 100), g.pct(95, 100), g.pct(None, 100), g.pct(5, 0)] == ["+10.0%", "-5.0%", "n/a", "n/a"]
