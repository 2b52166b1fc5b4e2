"""Nothing oomtune writes goes through a link, and nothing a person wrote is lost (issue 39, data safety): links,
pipes and folders planted where a run writes, a deleted lock file, and the OOM fallback's config rewrite after a hand
edit. The `cpu` device, tiny models (tests/train/cases.py, tests/train/models.py)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from oomtune.config.loading import load_config
from oomtune.config.schema import Config, Plan, TrainConfig
from oomtune.config.writing import dump_config
from oomtune.files import NotAFileError, append_line, atomic_write
from oomtune.train.checkpoint import list_checkpoints, prune
from oomtune.train.events import StepDone
from oomtune.train.trainer import train as train_api

from ..conftest import events, metrics
from .cases import error_line, train
from .models import GROWING_MODEL

SAID = "oomtune writes no file through a link, nor into a pipe, a device or a folder (nothing was written)"


@pytest.fixture
def outside(case_dir):
    """A file of the user's outside the run dir, which a planted link points at."""
    (case_dir / "outside").mkdir()
    victim = case_dir / "outside" / "victim"
    victim.write_bytes(b"the user's own bytes\n")
    return victim


def test_a_link_planted_in_a_live_run_dir_under_the_next_checkpoints_name_is_refused_and_its_target_kept(
        case_dir, outside):
    """A link named like a coming checkpoint (ckpt-00000003.pt -> ../outside/victim), planted while the run went on,
    had its target overwritten with the checkpoint, then the link was pruned. Now: one line naming the link, exit 2,
    the target and the link as they were, the run's earlier state kept."""
    run = case_dir / "run"

    def plant(event):
        if isinstance(event, StepDone) and event.step == 2:
            (run / "ckpt-00000003.pt").symlink_to("../outside/victim")

    with pytest.raises(NotAFileError) as said:
        train_api("best.yaml", overrides={"steps": 4}, device="cpu", budget="1GiB", on_event=plant)
    assert said.value.exit_code == 2
    assert str(said.value) == f"run/ckpt-00000003.pt is a symbolic link (to ../outside/victim): {SAID}; remove it, " \
                              "or choose another path"
    assert outside.read_bytes() == b"the user's own bytes\n"
    assert os.readlink(run / "ckpt-00000003.pt") == "../outside/victim"
    assert [r["step"] for r in metrics(run)] == [1, 2, 3]
    assert not [p.name for p in run.iterdir() if p.name.endswith(".tmp")]  # no temp file left either


@pytest.mark.parametrize("name", ["metrics.jsonl", "events.jsonl", ".oomtune.lock", "ckpt-00000003.pt"])
def test_a_link_where_a_run_writes_is_refused_before_anything_is_built_and_nothing_is_written(case_dir, outside, name):
    """The logs, the lock (as root, a link to a device file had the device replaced with the pid) and a checkpoint's
    name: refused at the start, one line, exit 2, nothing written anywhere."""
    run = case_dir / "run"
    run.mkdir()
    (run / name).symlink_to("../outside/victim")
    line = error_line(train("--steps", "4"))
    assert line == f"error: run/{name} is a symbolic link (to ../outside/victim): {SAID}; remove it, or choose " \
                   "another path"
    assert outside.read_bytes() == b"the user's own bytes\n"
    assert sorted(p.name for p in run.iterdir()) == [name]


@pytest.mark.parametrize("kind", ["fifo", "folder"])
def test_a_pipe_or_a_folder_named_like_the_lock_is_one_line_not_a_hang(case_dir, kind):
    """A FIFO named .oomtune.lock hung `train` forever (opening it waits for a writer); a folder there was a bare
    IsADirectoryError. Run in a child process with a timeout, so a hang fails the test instead of the suite."""
    run = case_dir / "run"
    run.mkdir()
    os.mkfifo(run / ".oomtune.lock") if kind == "fifo" else (run / ".oomtune.lock").mkdir()
    done = subprocess.run([sys.executable, "-m", "oomtune", "train", "--config", "best.yaml", "--device", "cpu",
                           "--budget", "1GiB", "--steps", "2"], capture_output=True, text=True, timeout=120)
    what = "a named pipe" if kind == "fifo" else "a folder"
    assert done.returncode == 2, done.stderr
    assert f"error: run/.oomtune.lock is {what}: {SAID}" in " ".join(done.stderr.split())
    assert sorted(p.name for p in run.iterdir()) == [".oomtune.lock"]


HOLDER = """
import sys, time
from pathlib import Path
from oomtune.train.rundir import RunLog
log = RunLog(Path(sys.argv[1]))
log.open(clean=False)
print("held", flush=True)
time.sleep(120)
"""


def test_deleting_a_live_runs_lock_file_does_not_let_a_second_run_in(case_dir):
    """The lock was only a file: deleting a live run's .oomtune.lock let a second `train --resume` run beside it.
    The run now holds a flock on the run dir itself, which no file deletion undoes."""
    assert train("--steps", "3").exit_code == 0
    run = case_dir / "run"
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(run)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        assert (run / ".oomtune.lock").read_text() == f"{holder.pid}\n"
        (run / ".oomtune.lock").unlink()
        before = {p.name: p.read_bytes() for p in run.iterdir()}
        line = error_line(train("--resume", "--steps", "6"))
        assert line == ("error: run dir run is in use by another oomtune train: two runs would interleave their logs "
                        "and checkpoints; wait for it to end, or pass --run-dir for a new run")
        assert {p.name: p.read_bytes() for p in run.iterdir()} == before
    finally:
        holder.kill()
        holder.wait()
    assert train("--resume", "--steps", "4").exit_code == 0


def test_pruning_and_listing_pass_over_a_link_named_like_a_checkpoint(tmp_path):
    """Only what oomtune wrote is a checkpoint, or removed: a link named ckpt-* is neither listed nor pruned."""
    (tmp_path / "victim").write_text("mine")
    run = tmp_path / "run"
    run.mkdir()
    (run / "ckpt-00000001.pt").symlink_to(tmp_path / "victim")
    for step in (2, 3, 4):
        (run / f"ckpt-{step:08d}.pt").write_bytes(b"x")
    assert [s for s, _ in list_checkpoints(run)] == [2, 3, 4]
    prune(run, keep=1)
    assert sorted(p.name for p in run.iterdir()) == ["ckpt-00000001.pt", "ckpt-00000004.pt"]
    assert (tmp_path / "victim").read_text() == "mine"


def test_the_writers_refuse_a_link_swapped_in_and_never_follow_one(tmp_path):
    """files.atomic_write (checkpoints, configs, snapshots, the lock's pid) and files.append_line (the logs): a link,
    whatever it points at (an existing file, nothing), is refused and left as it was."""
    target = tmp_path / "target"
    target.write_text("kept")
    for name, points_at in (("a", target), ("b", tmp_path / "missing")):
        link = tmp_path / name
        link.symlink_to(points_at)
        for write in (lambda p: atomic_write(p, "new"), lambda p: append_line(p, "new\n")):
            with pytest.raises(NotAFileError, match=f"{link} is a symbolic link"):
                write(link)
        assert link.is_symlink() and not (tmp_path / "missing").exists()
    assert target.read_text() == "kept"
    atomic_write(tmp_path / "plain", "one")  # and a plain file is written as before, keeping its permissions
    (tmp_path / "plain").chmod(0o640)
    atomic_write(tmp_path / "plain", "two")
    append_line(tmp_path / "plain", "\nthree")
    assert (tmp_path / "plain").read_text() == "two\nthree" and (tmp_path / "plain").stat().st_mode & 0o777 == 0o640


# -- the OOM fallback's rewrite: from the file as it is now -----------------------------------------------------

PLAN = Plan(micro_batch_size=4, context_length=128, grad_accum_steps=2)


@pytest.fixture
def growing(tmp_path, monkeypatch):
    """GROWING_MODEL: short batches for 9 draws, then full-length ones that fit only at a smaller micro-batch under
    `budget` (measured by test_trainer.py's OOM test): a fallback at step 5."""
    import torch

    monkeypatch.chdir(tmp_path)
    torch.set_num_threads(1)
    model = tmp_path / "growing.py"
    model.write_text(textwrap.dedent(GROWING_MODEL))
    train_cfg = TrainConfig(steps=8, lr=0.01, warmup_steps=0, log_every_n_steps=1, checkpoint_interval=100,
                            run_dir="run")
    cfg = tmp_path / "best.yaml"
    cfg.write_text(dump_config(Config(model=str(model), plan=PLAN, train=train_cfg)))
    return cfg


def _budget(cfg) -> int:
    from oomtune.memory.devices import make_device
    from oomtune.model_file import load_model_file
    from oomtune.search.trial import run_trial

    model = load_model_file(load_config(cfg).model_path(cfg))
    full, half = (run_trial(model, p, make_device("cpu", "1GiB"), steps=2).peak_bytes
                  for p in (PLAN, Plan(2, 128, grad_accum_steps=4)))
    return (half + full) // 2


def _edit_during_the_run(cfg, old: str, new: str):
    def edit(event):
        if isinstance(event, StepDone) and event.step == 2:
            text = cfg.read_text()
            assert old in text
            cfg.write_text(text.replace(old, new))
    return edit


def test_the_fallback_keeps_a_hand_edit_made_during_the_run(growing):
    """The fallback wrote the config it read at the start over the file: an `lr:` edited during the run was lost.
    It now edits the file as it is on disk, changing only the plan's numbers."""
    cfg = growing
    result = train_api(cfg, device="cpu", budget=str(_budget(cfg)),
                       on_event=_edit_during_the_run(cfg, "lr: 0.01", "lr: 0.005  # lowered while it ran"))
    assert result.config_updated and [e["step"] for e in events(cfg.parent / "run", "oom_fallback")] == [5]
    after = load_config(cfg)
    assert (after.plan.micro_batch_size, after.plan.grad_accum_steps) == (2, 4)
    assert after.train.lr == 0.005 and "lr: 0.005  # lowered while it ran" in cfg.read_text()


def test_the_fallback_writes_nothing_where_the_plan_on_disk_is_no_longer_the_runs(growing):
    """A newer probe's plan (or a hand edit of the plan) written during the run: the fallback's plan is not written
    over it; a warning says so and the file is left as it is."""
    cfg = growing
    notes = []
    edit = _edit_during_the_run(cfg, "context_length: 128", "context_length: 96")

    def on_event(event):
        edit(event)
        if type(event).__name__ == "Note":
            notes.append(event.message)

    result = train_api(cfg, device="cpu", budget=str(_budget(cfg)), on_event=on_event)
    assert not result.config_updated and result.plan.micro_batch_size == 2
    assert load_config(cfg).plan == Plan(4, 96, grad_accum_steps=2)
    assert f"could not update {cfg} with the new plan: {cfg} was not updated: its plan is no longer the one this run " \
           "started from (a newer probe's, or edited during the run), so it is left as it is" in notes
    assert not events(cfg.parent / "run", "config_updated")


def test_a_fallback_config_behind_a_link_is_not_written_through(growing):
    """--config a link: read through (it is the user's own path), but the fallback's rewrite is refused with a
    warning, and the run goes on."""
    cfg = growing
    link = cfg.parent / "link.yaml"
    link.symlink_to(cfg)
    before = cfg.read_text()
    result = train_api(link, device="cpu", budget=str(_budget(cfg)))
    assert result.step == 8 and not result.config_updated
    assert cfg.read_text() == before and link.is_symlink()

