"""--memory-snapshot: a trial's allocation history as PyTorch's memory viewer reads it (devices: fake and cpu)."""

from __future__ import annotations

import pickle
import subprocess
import sys

from ..conftest import EXAMPLES, run_cli


def test_estimate_writes_a_snapshot_that_pytorchs_memory_viewer_renders(tmp_path):
    snap = tmp_path / "plan.pickle"
    r = run_cli("estimate", EXAMPLES / "mlp_dict.py", "--budget", "600MiB", "--batch", "8", "--context", "16",
                "--out", tmp_path / "best.yaml", "--memory-snapshot", snap)
    assert r.exit_code == 0, r.output
    assert f"wrote the memory snapshot {snap}" in " ".join(r.stderr.split())
    data = pickle.loads(snap.read_bytes())
    (trace,) = data["device_traces"]
    allocs = [e for e in trace if e["action"] == "alloc"]
    frees = [e for e in trace if e["action"] == "free_completed"]
    assert allocs and len(frees) <= len(allocs) and all(e["size"] % 512 == 0 for e in allocs)
    assert {"parameters", "activations", "temporaries", "optimizer_state"} <= {e["category"] for e in allocs}
    assert any(e["frames"][0]["name"] == "mm.default" for e in allocs)  # the op that made it
    html = tmp_path / "plan.html"
    viz = subprocess.run([sys.executable, "-m", "torch.cuda._memory_viz", "trace_plot", str(snap), "-o", str(html)],
                         capture_output=True, text=True)
    assert viz.returncode == 0, viz.stderr
    assert "snapshot.pickle" in html.read_text()


def test_check_on_the_cpu_device_writes_one_too(tmp_path):
    config = tmp_path / "best.yaml"
    assert run_cli("probe", EXAMPLES / "mlp_dict.py", "--device", "cpu", "--budget", "64MiB", "--out",
                   config).exit_code == 0
    snap = tmp_path / "check.pickle"
    r = run_cli("check", "--config", config, "--device", "cpu", "--memory-snapshot", snap)
    assert r.exit_code == 0, r.output
    assert pickle.loads(snap.read_bytes())["device_traces"][0]
