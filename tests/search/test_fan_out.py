"""Measurements side by side in forked copies of the process (search/fan_out.py): each result is the one the task
gives run here, in order; whatever a copy cannot do is run here; an estimate made with copies is the estimate made
in one process, to the byte. Devices: none (the unit tests), fake (the estimates)."""

from __future__ import annotations

import dataclasses
import os
import sys
import time
from pathlib import Path

import pytest
import torch

from oomtune.memory.cards import find_gpu
from oomtune.memory.devices import FakeDevice
from oomtune.model_file import load_model_file
from oomtune.search import fan_out
from oomtune.search.estimate import estimate
from oomtune.search.options import resolve_targets
from tests.search.test_block_extrapolation import ROOT, _deeper

pytestmark = pytest.mark.skipif(sys.platform != "linux" or torch.cuda.is_initialized(),
                                reason="copies are forked on Linux only, where CUDA has not started")


@pytest.fixture(autouse=True)
def two_cores(monkeypatch):
    """Copies run whatever this machine's cores (the estimate counts them: fan_out.cores)."""
    monkeypatch.setattr(fan_out, "PROCESSES", 2)


@pytest.fixture
def started(monkeypatch) -> list[int]:
    """The copies started (counted here, in the parent)."""
    count: list[int] = []
    start = fan_out._start

    def counted(task, handed):
        count.append(1)
        return start(task, handed)

    monkeypatch.setattr(fan_out, "_start", counted)
    return count


def where(i: int):
    return lambda: (i, os.getpid(), bool(fan_out._IN_COPY))


def test_the_first_runs_here_then_the_middle_ones_in_copies_and_the_last_here(started):
    fanned = fan_out.Fanned([where(i) for i in range(4)])
    results = [fanned.result(i) for i in range(4)]
    assert [r[0] for r in results] == [0, 1, 2, 3]
    assert [r[2] for r in results] == [False, True, True, False]  # 1 and 2 in copies
    assert results[0][1] == results[3][1] == os.getpid() != results[1][1] != results[2][1]
    assert len(started) == 2


def test_warm_tasks_start_in_copies_at_the_first_fetch_all_but_the_last(started):
    """Warm (an earlier run of the same kind filled the caches): no core waits for the first, alone."""
    fanned = fan_out.Fanned([where(i) for i in range(3)], warm=True)
    results = [fanned.result(i) for i in range(3)]
    assert [r[0] for r in results] == [0, 1, 2]
    assert [r[2] for r in results] == [True, True, False]
    assert len(started) == 2


def test_warm_but_not_ready_at_first_runs_the_first_here_and_tries_again_at_the_second(started):
    asked = []
    fanned = fan_out.Fanned([where(i) for i in range(3)], warm=True, ready=lambda: (asked.append(1), len(asked) > 1)[1])
    assert [fanned.result(i)[2] for i in range(3)] == [False, True, False]
    assert len(asked) == 2 and len(started) == 1


def test_a_caller_that_stops_after_the_first_starts_no_copy(started):
    with fan_out.Fanned([where(i) for i in range(3)]) as fanned:
        assert fanned.result(0)[0] == 0
    assert started == []


def test_a_copy_that_fails_or_cannot_send_its_result_is_run_here(started):
    def fails_in_a_copy():
        if fan_out._IN_COPY:
            raise RuntimeError("only there")
        return "here"

    def dies_in_a_copy():
        if fan_out._IN_COPY:
            os._exit(3)
        return "here too"

    def unpicklable():
        return (lambda: 1) if fan_out._IN_COPY else "and here"

    tasks = [where(0), fails_in_a_copy, dies_in_a_copy, unpicklable, where(4)]
    fanned = fan_out.Fanned(tasks)
    assert [fanned.result(i) for i in range(4)][1:] == ["here", "here too", "and here"]
    assert len(started) == 3


def test_state_a_copy_hands_back_is_taken_here():
    box = {"verdicts": []}

    def check(i):
        def task():
            box["verdicts"].append(i)  # (in a copy: its own box)
            return i
        return task

    taken = []
    fanned = fan_out.Fanned([check(i) for i in range(4)], handed=lambda: list(box["verdicts"]), take=taken.append)
    assert [fanned.result(i) for i in range(4)] == [0, 1, 2, 3]
    assert box["verdicts"] == [0, 3]  # run here
    assert sorted(taken) == [[0, 1], [0, 2]]  # each copy's: what it had (0, from before the fork) and its own


def test_one_process_or_not_ready_runs_all_here(started, monkeypatch):
    fanned = fan_out.Fanned([where(i) for i in range(3)], ready=lambda: False)
    assert not any(fanned.result(i)[2] for i in range(3))
    monkeypatch.setattr(fan_out, "PROCESSES", 1)
    fanned = fan_out.Fanned([where(i) for i in range(3)])
    assert not any(fanned.result(i)[2] for i in range(3))
    assert started == []


def test_an_estimate_with_copies_is_the_one_made_in_one_process(tmp_path: Path, started, monkeypatch):
    """device: fake. An 8-layer GPT (made from fewer blocks from 5 alike on, not 16, to keep it quick): the trials
    made from 2, 3 and 4 of its blocks (and the floors) with 3 and 4 traced in copies give the plan, the breakdown and
    every trial's figures of the estimate run in one process."""
    mf = load_model_file(_deeper(tmp_path, ROOT / "examples" / "tiny_gpt.py", 8))
    targets = resolve_targets(mf, None, None, None)
    warms: list[bool] = []
    init = fan_out.Fanned.__init__

    def noted(self, tasks, *args, warm=False, **kwargs):
        warms.append(warm)
        init(self, tasks, *args, warm=warm, **kwargs)

    monkeypatch.setattr(fan_out.Fanned, "__init__", noted)
    side = estimate(mf, FakeDevice("640MiB", gpu=find_gpu("generic")), targets, min_blocks=5)
    assert started, "no copy ran"
    assert True in warms and False in warms  # (a later trial with a rung's levers: its 2 blocks in a copy too)
    monkeypatch.setattr(fan_out, "PROCESSES", 1)
    alone = estimate(mf, FakeDevice("640MiB", gpu=find_gpu("generic")), targets, min_blocks=5)
    assert side.plan == alone.plan and side.breakdown == alone.breakdown
    figures = lambda r: dataclasses.replace(r, seconds=0.0, build_seconds=0.0)  # noqa: E731
    assert [figures(r) for r in side.search.records] == [figures(r) for r in alone.search.records]
    assert "extrapolated" in {r.source for r in side.search.records}


@pytest.mark.parametrize(("budget", "copies", "taken"), [("12MiB", 3, 3), ("40MiB", 2, 1)])
def test_micro_batch_1_traced_ahead_in_a_copy_is_the_one_traced_after(started, monkeypatch, budget, copies, taken):
    """device: fake, no card. The tiny GPT: each rung's micro-batch 1 at the target's context (the search's next
    trial where the target does not fit) is traced in a copy while the target is traced here (trials of any length:
    SPECULATE 0). In 12 MiB no target fits and the three copies' results are taken; in 40 MiB the amp rung's target
    fits, and its copy is dropped. Records, plan and breakdown are those of the estimate in one process."""
    from oomtune.search import replayed_trials
    from oomtune.search.estimate import make_fake_device

    monkeypatch.setattr(replayed_trials, "SPECULATE", 0.0)
    results: list[bool] = []  # a copy's result taken (True), or the trial run here (False)
    result = fan_out.Ahead.result
    monkeypatch.setattr(fan_out.Ahead, "result", lambda self: (results.append(self.copy is not None), result(self))[1])
    mf = load_model_file(ROOT / "examples" / "tiny_gpt.py")
    targets = resolve_targets(mf, None, None, None)
    ahead = estimate(mf, make_fake_device(budget, None, "0"), targets)
    assert len(started) == copies and results == [True] * taken  # (the others dropped)
    monkeypatch.setattr(fan_out, "PROCESSES", 1)
    alone = estimate(mf, make_fake_device(budget, None, "0"), targets)
    assert ahead.plan == alone.plan and ahead.breakdown == alone.breakdown
    # (source: a copy's micro-batch 1 checks its second step itself, where the search would have made it after the
    # target had checked; both are the run figures where the check holds)
    figures = lambda r: dataclasses.replace(r, seconds=0.0, build_seconds=0.0, source="run")  # noqa: E731
    assert [figures(r) for r in ahead.search.records] == [figures(r) for r in alone.search.records]
    assert len(ahead.search.records) == len(alone.search.records) > copies


def test_a_copy_ahead_that_is_not_asked_for_is_dropped():
    """A speculated trial the search does not ask for next is stopped, its process waited for."""
    ahead = fan_out.Ahead(lambda: time.sleep(30))
    assert ahead.copy is not None
    pid = ahead.copy[0]
    ahead.drop()
    with pytest.raises(ChildProcessError):
        os.waitpid(pid, os.WNOHANG)


def test_no_process_left_runs_the_tasks_here(monkeypatch):
    """A fork that fails (no process left under the user's limit) is no error: the tasks run here."""
    def no_fork():
        raise BlockingIOError(11, "Resource temporarily unavailable")

    monkeypatch.setattr(os, "fork", no_fork)
    fanned = fan_out.Fanned([where(i) for i in range(3)])
    assert [fanned.result(i)[0] for i in range(3)] == [0, 1, 2]
    assert fan_out.Ahead(where(7)).result()[0] == 7


def test_oomtune_processes_caps_the_copies_and_a_bad_value_is_one_line_and_exit_2(monkeypatch, tmp_path):
    """OOMTUNE_PROCESSES (a machine shared with other work): 1 means no copies, whatever the cores; a value that is
    not a whole number of 1 or more stops an estimate before the model file loads, one line, exit 2."""
    from oomtune.errors import OomtuneError
    from tests.conftest import run_cli

    monkeypatch.setattr(fan_out, "PROCESSES", None)
    monkeypatch.setenv(fan_out.ENV, "1")
    assert fan_out.cores() == 1 and not fan_out.can_fan_out()
    monkeypatch.setenv(fan_out.ENV, " 3 ")
    assert fan_out.cores() == 3
    for bad in ("0", "two", "-1"):
        monkeypatch.setenv(fan_out.ENV, bad)
        with pytest.raises(OomtuneError, match="OOMTUNE_PROCESSES"):
            fan_out.cores()
        result = run_cli("estimate", "no_such_model.py", "--out", str(tmp_path / "x.yaml"))
        assert result.exit_code == 2 and "OOMTUNE_PROCESSES" in result.output, result.output
        assert not (tmp_path / "x.yaml").exists()
