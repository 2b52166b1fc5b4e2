"""The bench machinery on one tiny model and one budget (device: cpu for the contenders, fake for the truth).

Needs the bench extra (lightning, accelerate); CI installs only `.[dev]`, so there these tests are skipped."""

import pytest
import torch

pytest.importorskip("lightning", reason="the bench extra is not installed (pip install -e '.[bench]')")
pytest.importorskip("accelerate", reason="the bench extra is not installed (pip install -e '.[bench]')")

from bench.ours import run_oomtune  # noqa: E402
from bench.peers import oom_recognised, run_accelerate, run_lightning  # noqa: E402
from bench.truth import peak_table, truth_device  # noqa: E402
from oomtune.config.schema import Plan  # noqa: E402
from oomtune.memory.devices import CpuDevice  # noqa: E402
from oomtune.model_file import load_model_file  # noqa: E402
from oomtune.search.trial import run_trial  # noqa: E402

from .conftest import TINY_MODEL  # noqa: E402

pytestmark = pytest.mark.slow  # ~15 s of CPU: a probe, three peer searches and an exhaustive table

B, T = 8, 16
TRUE_MAX = 4  # the budget below is set halfway between the fp32 peaks of micro-batch 4 and 5


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """As `make bench` runs: on two shared cores, multi-threaded ops mostly wait for each other."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = tmp_path_factory.mktemp("bench") / "tiny.py"
    path.write_text(TINY_MODEL)
    return load_model_file(path)


@pytest.fixture(scope="module")
def table(model):
    return peak_table(model, B, T, only=["fp32"])


@pytest.fixture(scope="module")
def budget(table):
    low, high = table.peaks[("fp32", TRUE_MAX, 1)], table.peaks[("fp32", TRUE_MAX + 1, 1)]
    assert low < high
    return str((low + high) // 2)  # bytes


def test_truth_table_is_exhaustive_and_matches_the_cpu_device(model, table, budget):
    assert table.device_kind == truth_device().kind
    assert [r.name for r in table.rungs] == ["fp32"]
    assert {(name, b) for name, b, accum in table.peaks if accum == 1} == {("fp32", b) for b in range(1, B + 1)}
    assert table.trials == len(table.peaks)
    limit = int(budget)
    assert table.true_max("fp32", limit) == TRUE_MAX
    cpu = CpuDevice(budget)
    assert run_trial(model, Plan(TRUE_MAX, T), cpu).peak_bytes == table.peaks[("fp32", TRUE_MAX, 1)]
    assert run_trial(model, Plan(TRUE_MAX + 1, T), cpu).oom


def test_the_peers_recognise_the_simulated_oom():
    assert oom_recognised() == {"lightning": True, "accelerate": True}


def test_accelerate_real_function_tries_its_schedule_and_finds_a_batch_that_fits(model, budget):
    r = run_accelerate(model, B, T, budget)
    # find_executable_batch_size retries at int(0.9 x size): 8 -> 7 -> 6 -> 5 -> 4
    assert r.attempts == [(8, False), (7, False), (6, False), (5, False), (4, True)]
    assert r.found == TRUE_MAX and r.trials == 5
    assert 4 + 2 <= r.steps <= 4 * 2 + 2  # an OOM attempt stops in its first or second step; the last ran both
    cpu = CpuDevice(budget)  # what it returned trains in the budget with oomtune's step; one more does not
    assert not run_trial(model, Plan(r.found, T), cpu).oom
    assert run_trial(model, Plan(r.found + 1, T), cpu).oom


def test_lightning_binsearch_doubles_then_bisects_to_the_true_max(model, budget):
    r = run_lightning(model, T, budget, "binsearch")
    assert r.attempts == [(2, True), (4, True), (8, False), (6, False), (5, False)]
    assert r.found == TRUE_MAX
    assert 2 * 2 + 3 <= r.steps <= 2 * 2 + 3 * 2


def test_lightning_power_returns_the_last_power_of_two_that_ran(model, budget):
    r = run_lightning(model, T, budget, "power")
    assert r.attempts == [(2, True), (4, True), (8, False)]
    assert r.found == 4 and r.trials == 3


@pytest.fixture(scope="module")
def ours_fit(model, budget):
    return run_oomtune(model, B, T, budget, "fit")


def test_oomtune_fp32_rung_finds_the_true_max_and_its_steps_are_counted(model, table, budget, ours_fit):
    ours = ours_fit
    fp32 = ours.rung("fp32")
    assert fp32.micro_batch_size == table.true_max("fp32", int(budget))
    runs = [t for t in ours.probe.records if t.rung == "fp32" and t.grad_accum_steps == 1]
    assert fp32.trials == len(runs)
    fits = sum(1 for t in runs if t.result == "fits")
    assert 2 * fits + (len(runs) - fits) <= ours.steps_per_rung["fp32"] <= 2 * len(runs)
    accum_trials = sum(1 for t in ours.probe.records if t.grad_accum_steps > 1)
    assert 0 <= ours.steps - sum(ours.steps_per_rung.values()) <= 2 * accum_trials  # the only other steps


def test_oomtune_on_the_fp32_rung_only_runs_the_whole_ladders_fp32_trials(model, budget, ours_fit):
    """The realistic-batch cases cut the ladder to fp32: that must skip the later rungs, not change fp32's trials."""
    import oomtune.search.probe

    full_rungs = oomtune.search.probe.ladder_rungs
    only = run_oomtune(model, B, T, budget, "fit", rungs=["fp32"])
    assert oomtune.search.probe.ladder_rungs is full_rungs  # restored
    assert [r.rung.name for r in only.probe.ladder.rungs] == ["fp32"]
    assert len(ours_fit.probe.ladder.rungs) > 1  # the whole ladder did climb on

    def fp32(o):
        return [(t.micro_batch_size, t.stage, t.result, t.peak_bytes) for t in o.probe.records
                if t.rung == "fp32" and t.grad_accum_steps == 1]

    assert fp32(only) == fp32(ours_fit)
    assert only.rung("fp32") == ours_fit.rung("fp32")
    assert only.steps_per_rung == {"fp32": ours_fit.steps_per_rung["fp32"]}


def test_report_renders_the_committed_results_with_both_tables():
    import json
    from pathlib import Path

    from bench import report

    data = json.loads((Path(__file__).resolve().parent.parent / "bench" / "results.json").read_text())
    text = report.render(data, {})
    for group, title in ((report.SMALL, "### Small batches"), (report.LARGE, "## Realistic batch sizes")):
        assert data[group] and title in text
    rows = sum(len(c["budgets"]) for c in data[report.LARGE])
    assert text.count("**met**") + text.count("**not met**") == rows  # a verdict on every realistic row


def test_the_prior_sections_verdict_is_read_off_its_rows():
    """bench_prior.render: the per-context line says 'lower' only where the prior's seconds sum below the search's."""
    from bench.bench_prior import render

    def row(context, seconds):
        return {"context": context, "budget": "1MiB", "plan": "8 x2", "same_plan": True, "trials": [6, 2],
                "device_trial_s": 0.5, "fake_trials": 5, "replayed": 4, "fake_s": 2.5, "seconds": seconds}

    text = render([row(128, [1.0, 3.0]), row(512, [5.0, 4.0]), row(512, [2.0, 2.5])], 10.0)
    assert "Context 128: a device trial 0.50 s; the estimate 0.50 s for each fake trial it ran (its replays and its " \
           "own work included); the probe from the estimate took 3.0 s against 1.0 s alone (3.00): wall time not " \
           "lower." in text
    assert "| 5 fake + 4 replayed / 2.5 s |" in text
    assert "Replays, checked" not in text  # none were checked
    checked = render([row(128, [1.0, 3.0])], 10.0, {"agreed": 7, "differed": ["m.py 8 x1"], "runs": 21})
    assert "7 of 8 replays over 21 estimates read what the fake trial read" in checked
    assert "Differed: m.py 8 x1." in checked
    assert "took 6.5 s against 7.0 s alone (0.93): wall time lower." in text


def test_make_bench_keeps_every_section_a_target_writes_and_runs_it_once(tmp_path, monkeypatch):
    """bench.run.run_other_sections: bench-estimate writes two sections (the estimate, its speed); `make bench`
    dropped the second from bench/RESULTS.md (it listed one section per target). Each target runs once, and every
    section it wrote is kept. No real make: a stand-in writes each target's sections."""
    import json
    import subprocess
    from pathlib import Path

    from bench import report, run
    from bench.sections import OTHER_SECTIONS, write_section

    out = tmp_path / "RESULTS.md"
    out.write_text(report.skeleton())
    calls = []

    def fake_make(cmd, **kw):
        target = cmd[-1]
        calls.append(target)
        for name, t, heading in OTHER_SECTIONS:
            if t == target:
                write_section(out, name, f"figures of {name}", heading=f"## {heading}")
        return subprocess.CompletedProcess(cmd, 0, "", "")

    monkeypatch.setattr(run, "has_make_target", lambda target: True)
    monkeypatch.setattr(run.subprocess, "run", fake_make)
    sections = run.run_other_sections(out)
    assert sorted(calls) == sorted({t for _, t, _ in OTHER_SECTIONS})  # each target once
    assert sections == {name: f"figures of {name}" for name, _, _ in OTHER_SECTIONS}
    assert "estimate-speed" in sections
    text = report.render(json.loads((Path(__file__).resolve().parent.parent / "bench" / "results.json").read_text()),
                         sections)
    assert "## Estimate speed" in text and "figures of estimate-speed" in text
