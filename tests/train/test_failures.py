"""oomtune train when something goes wrong mid-run or around it: a model-file hook that fails after some steps, a
run dir that cannot be used, a full disk, a broken checkpoint, and the small cases (nothing left to do, a budget
smaller than the weights, a hook returning the wrong thing). Each is one line, an exit code, and a run dir that
`--resume` (or a fresh run) can go on from. The `cpu` device, a tiny model, a few steps (tests/train/cases.py)."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest
import yaml

from oomtune.train.checkpoint import load_checkpoint, stale_temp_files

from ..conftest import events, metrics, run_cli
from .cases import MODEL, PLAN, error_line, losses, steps_saved, train

# -- a model-file hook failing mid-run ---------------------------------------------------------------------------

def test_a_train_batches_error_mid_run_saves_the_last_finished_step_and_resume_goes_on(case_dir):
    assert train("--run-dir", "ref").exit_code == 0
    (case_dir / "fail-at").write_text("11")  # step 6's first draw; the interval checkpoint is at 3
    result = train("--checkpoint-interval", "100", "--run-dir", "run")
    assert result.exit_code == 2, result.stderr
    line = error_line(result)
    assert "train_batches() raised ValueError: the data server went away (at step 6)" in line
    assert "ckpt-00000005.pt (step 5" in line and "--resume" in line
    run = case_dir / "run"
    assert steps_saved(run) == [5]
    (error,) = events(run, "error")
    assert (error["step"], error["phase"], error["checkpoint"]) == (6, "data", "ckpt-00000005.pt")

    (case_dir / "fail-at").unlink()
    resumed = train("--run-dir", "run", "--resume", "--checkpoint-interval", "3")
    assert resumed.exit_code == 0
    assert "trained 10/10 steps (5 this run, from step 5)" in resumed.stdout and " -> " in resumed.stdout
    assert losses(run) == pytest.approx(losses(case_dir / "ref"), rel=1e-6)


def test_a_train_batches_batch_of_another_size_is_named_and_the_last_step_saved(case_dir):
    """A batch shorter than the batch_size the hook was given trained silently: another plan than the one measured,
    and another global batch. Only the last batch of a pass may be short (tests/train/test_short_batch.py): a short
    one followed by another is named when that one comes (step 4's second draw)."""
    (case_dir / "short-at").write_text("7")  # step 4's first draw
    result = train("--checkpoint-interval", "100", "--run-dir", "run")
    assert result.exit_code == 2, result.stderr
    assert ("model.py: train_batches() yielded a batch of 1 example (of batch_size 2) that was not the last of its "
            "pass: yield batches of batch_size examples (only a pass's last may be shorter, as a DataLoader's is) "
            "(at step 4)") in error_line(result)
    assert steps_saved(case_dir / "run") == [3]


def test_a_train_batches_batch_longer_than_make_batchs_worst_case_is_named_and_the_last_step_saved(case_dir):
    """Sequences longer than the plan's context took memory no trial measured: the OOM fallback shrank the plan
    for good and wrote it to the config, with no word of why (from a new user's pass)."""
    (case_dir / "long-at").write_text("7")  # step 4's first draw
    result = train("--checkpoint-interval", "100", "--run-dir", "run")
    assert result.exit_code == 2, result.stderr
    assert ("model.py: train_batches() yielded a tensor of shape (2, 12, 16) where make_batch(2, 8) makes (2, 8, 16), "
            "the worst case the plan was measured at: a larger batch takes memory no trial measured. Yield at most "
            "context_length 8 (cut or pack the sequences), or probe again at the real size (at step 4)"
            ) in error_line(result)
    assert steps_saved(case_dir / "run") == [3]


def test_a_second_ctrl_c_that_python_swallowed_stops_as_an_interruption(case_dir):
    """A second Ctrl-C stops at once; where its KeyboardInterrupt landed in a finalizer (Python prints and drops
    it) the state it left half-done raised an error later, blamed on the model file (exit 2). It is an interruption:
    exit 130, and the last checkpoint stays as it was."""
    (case_dir / "ctrl-c-twice-at").write_text("9")  # step 5's first draw; the interval checkpoint is at 3
    result = train("--run-dir", "run")
    assert result.exit_code == 130, result.output
    assert "interrupted" in result.stderr and "KeyError" not in result.output
    assert steps_saved(case_dir / "run") == [3]


def test_a_ctrl_c_while_a_resume_replays_the_data_stops_there_with_nothing_new_written(case_dir):
    """Replaying the data can take minutes on a long run; a Ctrl-C during it went unheard until the replay had
    ended and one more step had trained and been saved."""
    assert train("--steps", "4").exit_code == 0
    before = (case_dir / "run" / "metrics.jsonl").read_text()
    (case_dir / "ctrl-c-at").write_text("2")  # the resume's second draw: 8 are replayed (4 steps x 2)
    result = train("--resume", "--steps", "10")
    assert result.exit_code == 130, result.output
    assert steps_saved(case_dir / "run") == [3, 4]
    assert (case_dir / "run" / "metrics.jsonl").read_text() == before
    assert "stopped after step 4" in result.output


def test_a_resume_with_one_step_left_reports_that_steps_loss_alone(case_dir):
    (case_dir / "fail-at").write_text("11")  # fails at step 6: the checkpoint is step 5's
    assert train("--checkpoint-interval", "100", "--steps", "6").exit_code == 2
    (case_dir / "fail-at").unlink()
    one = train("--resume")
    assert one.exit_code == 0, one.output
    summary = " ".join(one.stdout.split())
    assert "trained 6/6 steps (1 this run, from step 5)" in summary and "->" not in summary, summary


def test_a_resume_without_flags_trains_on_the_device_and_in_the_budget_the_run_started_with(case_dir):
    (case_dir / "fail-at").write_text("11")
    first = run_cli("train", "--config", "best.yaml", "--device", "cpu", "--budget", "900MiB")
    assert first.exit_code == 2
    (case_dir / "fail-at").unlink()
    resumed = run_cli("train", "--config", "best.yaml", "--resume")
    assert resumed.exit_code == 0, resumed.output
    said = " ".join(resumed.stderr.split())
    assert "resuming with --device cpu --budget 900MiB, as the run started" in said, said
    assert "cpu device, 900.00 MiB" in said or "900.00 MiB" in said, said
    again = run_cli("train", "--config", "best.yaml", "--resume", "--budget", "800MiB", "--steps", "11")
    said = " ".join(again.stderr.split())
    assert again.exit_code == 0 and "--budget 800MiB" not in said and "800.00 MiB" in said, said


def test_a_resume_keeps_the_budget_the_config_gave_when_a_new_probe_changed_it(write_model, tmp_path, monkeypatch):
    """device: cpu, from the config's found_by (no flags): a probe in 64 MiB, a run, then a new probe's budget in
    the config; the resume trains in the 64 MiB the run started in, and says so."""
    from ..conftest import TINY_MODEL

    monkeypatch.chdir(tmp_path)
    write_model(TINY_MODEL)
    assert run_cli("probe", "model.py", "--device", "cpu", "--budget", "64MiB", "--batch", "2", "--context", "4",
                   "--out", "best.yaml").exit_code == 0
    first = run_cli("train", "--config", "best.yaml", "--steps", "4", "--checkpoint-interval", "2")
    assert first.exit_code == 0, first.output
    text = Path("best.yaml").read_text()
    assert f"budget_bytes: {64 << 20}" in text
    Path("best.yaml").write_text(text.replace(f"budget_bytes: {64 << 20}", f"budget_bytes: {128 << 20}"))
    again = run_cli("train", "--config", "best.yaml", "--resume", "--steps", "6")
    said = " ".join(again.stderr.split())
    assert again.exit_code == 0 and "resuming with --device cpu --budget 64.00MiB, as the run started" in said, said
    assert "budget 64.00 MiB" in said and "128.00 MiB" not in said, said


def test_an_empty_eval_batches_at_the_first_evaluation_saves_that_step(case_dir):
    model = case_dir / "model.py"
    model.write_text(model.read_text() + "\ndef eval_batches(batch_size, context_length, device):\n    return []\n")
    result = train("--eval-interval", "2", "--checkpoint-interval", "100")
    assert result.exit_code == 2
    line = error_line(result)
    assert "eval_batches() yielded no batches" in line and "ckpt-00000002.pt (step 2" in line
    assert steps_saved(case_dir / "run") == [2]


def test_a_ctrl_c_during_an_evaluation_stops_after_that_step_not_the_next(case_dir):
    """Ctrl-C "finishes the step in flight, saves a checkpoint" (docs/training.md): one during step 2's evaluation
    went unheard until step 3 had trained too."""
    model = case_dir / "model.py"
    model.write_text(model.read_text() + '''
def eval_batches(batch_size, context_length, device):
    os.kill(os.getpid(), signal.SIGINT)
    x = torch.randn(batch_size, context_length, 16, device=device)
    yield x, (x.sum((1, 2)) > 0).long()
''')
    result = train("--eval-interval", "2", "--eval-steps", "1", "--checkpoint-interval", "100")
    assert result.exit_code == 130, result.output
    assert steps_saved(case_dir / "run") == [2]
    rows = metrics(case_dir / "run")
    assert rows[-1]["step"] == 2 and rows[-1]["eval_loss"] is not None


EVAL_THAT_FAILS = '''
def eval_batches(batch_size, context_length, device):
    if (HERE / "eval-fail").exists():
        raise ValueError("the eval server went away")
    g = torch.Generator().manual_seed(0)
    for _ in range(4):
        x = torch.randn(batch_size, context_length, 16, generator=g)
        yield x, (x.sum((1, 2)) > 0).long()
'''


def test_an_eval_draw_error_is_after_its_step_and_the_resume_is_exact(case_dir):
    model = case_dir / "model.py"
    model.write_text(model.read_text() + EVAL_THAT_FAILS)
    assert train("--run-dir", "ref", "--eval-interval", "2").exit_code == 0
    (case_dir / "eval-fail").write_text("1")
    result = train("--eval-interval", "2", "--checkpoint-interval", "100")
    assert result.exit_code == 2, result.stderr
    assert "(at step 2)" in error_line(result)  # step 2 had finished: its evaluation failed
    (error,) = events(case_dir / "run", "error")
    assert (error["step"], error["phase"]) == (2, "eval-data")
    assert steps_saved(case_dir / "run") == [2]
    rows = metrics(case_dir / "run")  # step 2 trained: its row is kept, without the evaluation that failed (it was
    assert [r["step"] for r in rows] == [1, 2] and "eval_loss" not in rows[-1]  # lost, and a resume starts at 3)
    (case_dir / "eval-fail").unlink()
    assert train("--resume", "--eval-interval", "2", "--checkpoint-interval", "3").exit_code == 0
    after, ref = metrics(case_dir / "run"), metrics(case_dir / "ref")
    assert [r["step"] for r in after] == [r["step"] for r in ref] == list(range(1, 11))
    assert [r["loss"] for r in after] == pytest.approx([r["loss"] for r in ref], rel=1e-6)
    assert [r["step"] for r in after if "eval_loss" in r] == [4, 6, 8, 10]  # (ref's: 2 too)


def test_a_run_dir_without_a_checkpoint_says_how_to_start_over(case_dir):
    run = case_dir / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text('{"step": 1, "loss": 1.0}\n')  # a run killed before its first checkpoint
    line = error_line(train())
    assert "has no checkpoint to resume" in line and f"delete {Path('run') / 'metrics.jsonl'}" in line
    line = error_line(train("--resume"))
    assert "logged steps up to 1 but holds no checkpoint (ckpt-*): they were deleted, or it stopped before its " \
        "first one" in line and "without --resume" in line
    (run / "metrics.jsonl").write_text("")  # nothing logged
    assert "stopped before its first checkpoint (ckpt-*)" in error_line(train("--resume"))
    assert error_line(train("--resume", "--run-dir", "nowhere")).endswith(
        "no checkpoint (ckpt-*) in run dir nowhere, which does not exist; start a run without --resume, or pass the "
        "--run-dir of one")
    (run / "metrics.jsonl").unlink()
    assert train("--steps", "2").exit_code == 0


# -- the run dir and the disk ------------------------------------------------------------------------------------

def test_a_run_dir_that_is_a_file_empty_or_unwritable_is_one_line_and_exit_2(case_dir, monkeypatch):
    (case_dir / "notes.txt").write_text("mine")
    for run_dir, needle in [("notes.txt", "run dir notes.txt is a file, not a folder"),
                            ("notes.txt/run", "run dir notes.txt/run cannot be created: notes.txt is a file"),
                            ("", "--run-dir must not be empty")]:
        result = train("--run-dir", run_dir)
        assert result.exit_code == 2, result.stderr
        assert needle in error_line(result)
    assert (case_dir / "notes.txt").read_text() == "mine"

    def read_only(*args, **kwargs):
        raise OSError(errno.EROFS, os.strerror(errno.EROFS))

    built = []
    monkeypatch.setattr("oomtune.files.os.open", read_only)
    monkeypatch.setattr("oomtune.train.trainer.build_training", lambda *a, **k: built.append(1))
    result = train("--run-dir", "sub/run")
    assert result.exit_code == 2
    assert error_line(result) == ("error: run dir sub/run cannot be written (in .): read-only file system; pass "
                                  "--run-dir with a folder you can write")
    assert built == [] and not (case_dir / "sub").exists()  # checked before the model is built


@pytest.mark.parametrize("failure", ["torch", "enospc"])
def test_a_full_disk_while_writing_a_checkpoint_is_one_line_and_the_earlier_checkpoints_stay(case_dir, monkeypatch,
                                                                                            failure):
    import oomtune.train.checkpoint as ckpt

    real_save, real_replace, calls = ckpt.torch.save, ckpt.os.replace, []

    def save(obj, f, *args, **kwargs):  # the second checkpoint: torch's own error for a write that fell short
        calls.append(1)
        if len(calls) == 2 and failure == "torch":
            f.write(b"PK\x03\x04 partial")
            raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 4416 vs 4310")
        return real_save(obj, f, *args, **kwargs)

    def replace(src, dst, **dir_fds):
        if len(calls) == 2 and failure == "enospc":
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real_replace(src, dst, **dir_fds)

    monkeypatch.setattr(ckpt.torch, "save", save)
    monkeypatch.setattr(ckpt.os, "replace", replace)
    result = train()
    assert result.exit_code == 1, result.stderr
    line = error_line(result)
    assert line.startswith(f"error: could not write checkpoint {Path('run') / 'ckpt-00000006.pt'}: ")
    assert ("the disk is full" if failure == "enospc" else "unexpected pos") in line
    assert line.endswith("the earlier checkpoints are intact: ckpt-00000003.pt")
    run = case_dir / "run"
    assert steps_saved(run) == [3] and stale_temp_files(run) == []
    assert load_checkpoint(run / "ckpt-00000003.pt")["step"] == 3
    monkeypatch.setattr(ckpt.torch, "save", real_save)
    monkeypatch.setattr(ckpt.os, "replace", real_replace)
    assert train("--resume").exit_code == 0  # once there is room again


# -- broken checkpoints on --resume ------------------------------------------------------------------------------

def test_a_broken_latest_checkpoint_is_named_in_plain_words_and_the_older_intact_one_offered(case_dir, write_model):
    assert train("--steps", "6").exit_code == 0
    run = case_dir / "run"
    latest = run / "ckpt-00000006.pt"
    good = latest.read_bytes()
    flipped = bytearray(good)  # bytes inside a tensor's part: torch.load reads them without checking its CRC
    middle = len(good) // 2
    flipped[middle:middle + 64] = bytes(b ^ 0xC8 for b in flipped[middle:middle + 64])
    for data, needle in [(bytes(flipped), "is damaged: its part "),
                         (good[: len(good) // 3], "is truncated or damaged"),
                         (b"not a checkpoint at all\n", "is not a checkpoint: 24 bytes"),
                         (b"", "is empty (0 bytes)")]:
        latest.write_bytes(data)
        result = train("--resume")
        assert result.exit_code == 2
        line = error_line(result)
        assert line.startswith(f"error: checkpoint {latest.relative_to(case_dir)} {needle}"), line
        assert line.endswith(f"An older checkpoint is intact, ckpt-00000003.pt: move ckpt-00000006.pt out of "
                             f"{Path('run')} and rerun with --resume to continue from it")
        assert latest.read_bytes() == data  # never touched
    latest.write_bytes(good)

    other = write_model(MODEL.replace("nn.Linear(16, 4)", "nn.Linear(16, 5)").replace("range(2)", "range(3)"),
                        name="other.py")
    (case_dir / "other.yaml").write_text(yaml.safe_dump({"model": str(other), "plan": PLAN,
                                                          "train": {"run_dir": "run"}}))
    result = run_cli("train", "--config", "other.yaml", "--device", "cpu", "--resume")
    assert result.exit_code == 2
    assert error_line(result).endswith("does not match other.py's model: 2 of the model's keys are not in it (first: "
                                       "blocks.2.weight); 2 shape(s) differ (first: out.weight is (4, 16) in the "
                                       "checkpoint, (5, 16) in the model)")
    # its plan has other levers (the checkpoint's plan is what a resume builds): the checkpoint is named, not the
    # config (an NF4 checkpoint of a Llama resumed with a T5's config blamed the T5's plan.nf4_frozen_weights)
    (case_dir / "other.yaml").write_text(yaml.safe_dump({"model": str(other), "plan": {**PLAN, "precision": "bf16"},
                                                          "train": {"run_dir": "run"}}))
    result = run_cli("train", "--config", "other.yaml", "--device", "cpu", "--resume")
    assert result.exit_code == 2
    assert error_line(result) == (f"error: checkpoint {Path('run') / 'ckpt-00000006.pt'} was written by a run of "
                                  "model.py (micro-batch 2, context 8, fp32, x2 accumulation (global batch 4)), "
                                  "not of this config's other.py: resume with that run's config, or pass another "
                                  "--run-dir")


# -- the small cases ---------------------------------------------------------------------------------------------

def test_a_resume_already_past_steps_says_there_is_nothing_to_do(case_dir):
    assert train("--steps", "6").exit_code == 0
    result = train("--resume", "--steps", "3")
    assert result.exit_code == 0
    said = " ".join(result.stdout.split())
    assert "nothing to do: the run in run is at step 6, already at or past --steps 3" in said
    assert "trained" not in said


@pytest.mark.parametrize("budget", ["1KiB", "12KiB"])  # under the weights; over them, under + gradients + AdamW's
def test_a_budget_smaller_than_the_weights_is_bad_input(case_dir, budget):
    """Before anything is written (it once trained, fell back to micro-batch 1 and left a run dir and exit 1)."""
    result = train("--budget", budget, "--run-dir", "fresh")
    assert result.exit_code == 2
    assert f"budget {budget[:-3]}.00 KiB is too small for the plan's weights alone: weights " in error_line(result)
    assert not (case_dir / "fresh").exists()


def test_a_train_batches_that_returns_no_iterable_is_named(case_dir):
    model = case_dir / "model.py"
    model.write_text(model.read_text() + "\ndef train_batches(batch_size, context_length, device):\n    return 42\n")
    result = train()
    assert result.exit_code == 2
    assert error_line(result) == ("error: model.py: train_batches() returned 42 (int); expected an iterable of "
                                  "batches (a generator that yields them, or a list)")
