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


def load_tables():
    load_script()  # puts scripts/ on the path, as `make gpu-check` does
    import gpu_tables

    return gpu_tables


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
    g, t = load_script(), load_tables()
    out = "....F.s\nFAILED tests/test_gpu.py::test_x - 2 passed in a message\n1 failed, 8 passed, 1 skipped in 61.2s\n"
    assert g.pytest_counts(out) == {"failed": 1, "passed": 8, "skipped": 1}
    assert g.pytest_counts("no tests ran in 0.01s") == {}
    assert [t.pct(110, 100), t.pct(95, 100), t.pct(None, 100), t.pct(5, 0)] == ["+10.0%", "-5.0%", "n/a", "n/a"]


def test_the_implied_margin_is_the_least_squares_line_of_card_less_tensors():
    t = load_tables()
    MiB = 1 << 20
    exact = [(n * MiB, n * MiB + 300 * MiB + n * MiB // 20) for n in (100, 400, 2000)]  # 300 MiB + 5%
    fixed, pct = t.implied_margin(exact)
    assert abs(fixed - 300 * MiB) < 1 and abs(pct - 0.05) < 1e-9
    assert t.implied_margin([(MiB, 2 * MiB), (MiB, 3 * MiB)]) is None  # one tensor peak: no line


def test_the_memory_table_dry_run_on_the_cpu_device_reads_zero_error():
    """device: cpu standing in for the GPU (accounting as an H100), fake for the estimate (the same card). The fake
    device equals the cpu device to the byte, so every row's tensor and reserved errors must read +0.0%: this checks
    the table's arithmetic and layout, which otherwise run only on a GPU."""
    from oomtune.memory.cards import find_gpu
    from oomtune.memory.devices import CpuDevice

    t = load_tables()
    rep = t.Report()
    context = t.memory_table(rep, CpuDevice("1GiB", card=find_gpu("h100")), float("inf"), {}, examples=("mlp_dict",),
                             scales=(1,), batch=4)
    assert context is None and not rep.problems, rep.problems  # no NVML numbers off a GPU
    md = "\n".join(rep.md)
    rows = [ln for ln in md.splitlines() if ln.startswith("| mlp_dict")]
    assert len(rows) == 7  # fp32, amp, checkpointing; past accumulation: bf16-true, +8bit, +offload, +activations
    for row in rows:
        cells = [c.strip() for c in row.strip("|").split("|")]
        assert len(cells) == len(t.MEMORY_HEADER)
        errors = [c for c, h in zip(cells, t.MEMORY_HEADER, strict=True) if h == "error"]
        assert errors == ["+0.0%", "+0.0%", "n/a"], row  # tensors, reserved; no context off a GPU
    data = rep.data["memory"]["rows"]
    assert all(r["fake_tensor_peak_bytes"] == r["real_max_allocated_less_live_before_bytes"] > 0 for r in data)
    assert all(r["fake_host_peak_bytes"] == r["real_host_peak_bytes"] for r in data)
    assert [r["real_host_peak_bytes"] > 0 for r in data] == [False] * 5 + [True] * 2  # the two offload rows
    assert rep.data["memory"]["implied_margin"] is None  # no context without NVML: nothing to fit


def load_probe_tables():
    load_script()
    import gpu_probe

    return gpu_probe


def test_the_probe_table_dry_run_compares_the_plans():
    """device: cpu standing in for the GPU (1 GiB budget: mlp_dict's 32 x 64 fits outright), fake for the estimate."""
    from oomtune.memory.devices import CpuDevice

    p = load_probe_tables()
    rep = p.Report()
    case = p.ProbeCase("mlp_dict", ROOT / "examples" / "mlp_dict.py", 32, "1GiB")
    p.probe_table(rep, float("inf"), None, make_real=CpuDevice, cases=(case,))
    assert not rep.problems, rep.problems
    (row,) = rep.data["probe"]
    assert row["plan"] == "micro-batch 32, context 64, fp32 (global batch 32)" and row["same_plan"] == "yes"
    assert row["trials"] == row["fake_trials"] == row["no_prior_trials"] == 1
    assert row["no_prior_device_trial_seconds"] > 0
    (line,) = [ln for ln in "\n".join(rep.md).splitlines() if ln.startswith("| mlp_dict")]
    assert len(line.strip("|").split("|")) == len(p.HEADER)


def test_the_realistic_row_says_it_did_not_run_where_the_time_box_is_short():
    """device: none (it stops before building one). A row the time box leaves no room for is a problem (exit 1), not a
    pass, and its table says why."""
    import time

    p = load_probe_tables()
    rep = p.Report()
    p.realistic_table(rep, time.monotonic() + 60, None, needs_s=150)
    assert rep.problems == ["probe gpt2_small not run (time)"]
    assert "NOT RUN:" in rep.md[-1] and "it needs about 150 s" in rep.md[-1]
    assert rep.data["probe_realistic"][0]["error"].startswith("not run: ")


def test_the_kernel_tables_cpu_side_reads_onednns_lstm_workspaces():
    """device: cpu (the cuda side needs the GPU). The workspace the fake device counts for an LSTM is there to read,
    one per layer, and grows with the sequence."""
    tables = load_tables()
    short, long = (tables.rnn_buffer_bytes(torch, "cpu", (4, steps, 16, 16, 2), torch.float32) for steps in (8, 64))
    assert 0 < short < long
