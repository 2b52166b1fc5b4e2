"""--memory-snapshot: a trial's allocation history as PyTorch's memory viewer reads it (devices: fake and cpu)."""

from __future__ import annotations

import base64
import json
import pickle
import re
import subprocess
import sys

import pytest

from ..conftest import EXAMPLES, ROOT, run_cli


def test_estimate_writes_a_snapshot_that_pytorchs_memory_viewer_renders(tmp_path):
    snap = tmp_path / "plan.pickle"
    r = run_cli("estimate", EXAMPLES / "mlp_dict.py", "--budget", "600MiB", "--batch", "8", "--context", "16",
                "--out", tmp_path / "best.yaml", "--memory-snapshot", snap, "--json")
    assert r.exit_code == 0, r.output
    assert f"wrote the memory snapshot {snap}" in " ".join(r.stderr.split())
    data = pickle.loads(snap.read_bytes())
    assert _live_peak(data) == json.loads(r.stdout)["breakdown"]["tensor_peak_bytes"]  # the trial the plan's
    (trace,) = data["device_traces"]
    allocs = [e for e in trace if e["action"] == "alloc"]
    frees = [e for e in trace if e["action"] == "free_completed"]
    assert allocs and len(frees) <= len(allocs) and all(e["size"] % 512 == 0 for e in allocs)
    assert {"parameters", "activations", "temporaries", "optimizer_state"} <= {e["category"] for e in allocs}
    assert any(e["frames"][0]["name"] == "mm.default" for e in allocs)  # the op that made it
    model_lines = {(f["line"], f["name"]) for e in allocs for f in e["frames"][1:]
                   if f["filename"] == str(EXAMPLES / "mlp_dict.py")}
    assert (29, "forward") in model_lines  # the model file's line that made it: `h = h + layer(h)`
    files = {f["filename"] for e in allocs for f in e["frames"][1:]}
    step = str(ROOT / "oomtune" / "step.py")
    model = str(EXAMPLES / "mlp_dict.py")
    assert {model, step} <= files <= {model, step, str(ROOT / "oomtune" / "levers" / "__init__.py")}  # the build's
    # and the step's: not torch's, nor the test's, the CLI's or the search's that ran the trial
    assert {(f["name"]) for e in allocs for f in e["frames"][1:] if f["filename"] == step} >= {"_accumulate",
                                                                                              "train_step"}
    html = tmp_path / "plan.html"
    viz = subprocess.run([sys.executable, "-m", "torch.cuda._memory_viz", "trace_plot", str(snap), "-o", str(html)],
                         capture_output=True, text=True)
    assert viz.returncode == 0, viz.stderr
    embedded = re.search(r'"base64": "([^"]+)"', html.read_text()).group(1)  # the page holds this snapshot
    assert pickle.loads(base64.b64decode(embedded)) == data


def test_check_on_the_cpu_device_writes_one_too(tmp_path):
    config = tmp_path / "best.yaml"
    assert run_cli("probe", EXAMPLES / "mlp_dict.py", "--device", "cpu", "--budget", "64MiB", "--out",
                   config).exit_code == 0
    snap = tmp_path / "check.pickle"
    r = run_cli("check", "--config", config, "--device", "cpu", "--memory-snapshot", snap)
    assert r.exit_code == 0, r.output
    assert _live_peak(pickle.loads(snap.read_bytes())) == json.loads(
        run_cli("check", "--config", config, "--device", "cpu", "--json").stdout)["new_breakdown"]["tensor_peak_bytes"]


def test_a_snapshot_path_that_cannot_be_written_stops_before_any_trial(tmp_path):
    (tmp_path / "a-file").write_text("mine")
    for bad, why in ((tmp_path / "a-file" / "x.pickle", "is not a folder"), (tmp_path, "is a folder")):
        r = run_cli("estimate", EXAMPLES / "mlp_dict.py", "--budget", "600MiB", "--out", tmp_path / "best.yaml",
                    "--memory-snapshot", bad)
        assert r.exit_code == 2 and why in " ".join(r.output.split()), r.output
        assert "trial" not in r.output and not (tmp_path / "best.yaml").exists()
    assert (tmp_path / "a-file").read_text() == "mine"


def test_a_snapshot_never_overwrites_the_model_the_config_or_a_file_of_yours(tmp_path):
    model = tmp_path / "model.py"
    model.write_text((EXAMPLES / "mlp_dict.py").read_text())
    config = tmp_path / "best.yaml"
    assert run_cli("estimate", model, "--budget", "600MiB", "--out", config).exit_code == 0
    before = {p: p.read_bytes() for p in (model, config)}
    notes = tmp_path / "notes.txt"
    notes.write_text("mine")
    runs = [(("estimate", model, "--budget", "600MiB", "--out", config, "--memory-snapshot", config), "which the"),
            (("estimate", model, "--budget", "600MiB", "--out", config, "--memory-snapshot", model), "which the"),
            (("check", "--config", config, "--memory-snapshot", config), "which the"),
            (("check", "--config", config, "--memory-snapshot", model), "which the"),
            (("check", "--config", config, "--memory-snapshot", notes), "is not a memory snapshot")]
    for args, why in runs:
        r = run_cli(*args)
        assert r.exit_code == 2 and why in " ".join(r.output.split()), r.output
    assert {p: p.read_bytes() for p in (model, config)} == before and notes.read_text() == "mine"
    snap = tmp_path / "mem.pickle"  # a snapshot already there is replaced
    for _ in range(2):
        assert run_cli("check", "--config", config, "--memory-snapshot", snap).exit_code == 0
    assert pickle.loads(snap.read_bytes())["device_traces"]


def test_an_interruption_after_the_snapshot_trial_writes_neither_file(tmp_path):
    """The commands stop on a Ctrl-C Python dropped (before_writing) after the snapshot's trial, the last one, and
    before the config or the snapshot is written."""
    from oomtune import api

    out, snap = tmp_path / "best.yaml", tmp_path / "mem.pickle"
    job = api.prepare_estimate(EXAMPLES / "mlp_dict.py", budget="600MiB", batch=8, context=16, out=out,
                               memory_snapshot=snap)
    result = job.run()
    seen = []

    def interrupted():
        seen.append(snap.exists() or out.exists())
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        job.write(result, before_writing=interrupted)
    assert seen == [False] and not out.exists() and not snap.exists()
    assert job.write(result) is False and out.exists() and snap.exists()  # (no train: section was there to keep)


def _live_peak(data: dict) -> int:
    """The most bytes the trace has allocated and not yet freed at once."""
    live = peak = 0
    for e in data["device_traces"][0]:
        live += {"alloc": e["size"], "free_completed": -e["size"]}.get(e["action"], 0)
        peak = max(peak, live)
    return peak
