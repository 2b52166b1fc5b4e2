"""oomtune train: it learns, it survives an OOM mid-run, and bad input is one line + exit 2 with no file of the
user's touched (the exact resume after SIGINT / SIGKILL: test_signals.py).

Every run here is on the `cpu` device with torch at one thread (a 2-core CI box shared with other jobs is
many times slower with two spinning OpenMP threads), tiny models and few steps."""

from __future__ import annotations

import dataclasses
import json
import math
import textwrap
from pathlib import Path

import pytest
import torch

from oomtune.config.loading import load_config
from oomtune.config.schema import Config, Plan, TrainConfig
from oomtune.config.writing import dump_config
from oomtune.errors import ModelFileError
from oomtune.model_file import load_model_file
from oomtune.search.trial import run_trial
from oomtune.train.checkpoint import list_checkpoints, load_checkpoint
from oomtune.train.data import split_batch
from oomtune.train.recovery import smaller_plan
from oomtune.train.schedule import lr_at
from oomtune.train.trainer import train

from ..conftest import EXAMPLES, events, metrics, run_cli
from .models import GROWING_MODEL, RESUME_PLAN, error_lines, resume_config, write_config

# -- pure pieces ---------------------------------------------------------------------------------------------

def test_smaller_plan_halves_the_micro_batch_and_keeps_the_global_batch():
    seq, plan = [], Plan(8, 64, grad_accum_steps=2)
    while plan is not None:
        seq.append((plan.micro_batch_size, plan.grad_accum_steps, plan.global_batch_size))
        plan = smaller_plan(plan)
    assert seq == [(8, 2, 16), (4, 4, 16), (2, 8, 16), (1, 16, 16)]
    assert smaller_plan(Plan(6, 8)).micro_batch_size == 3  # the largest divisor at most half: exact global batch
    assert (smaller_plan(Plan(5, 8)).micro_batch_size, smaller_plan(Plan(5, 8)).grad_accum_steps) == (1, 5)


def test_split_batch_cuts_every_batch_tensor_and_shares_the_rest():
    batch = {"x": torch.arange(24).view(8, 3), "y": torch.arange(8), "scale": torch.tensor(2.0)}
    parts = split_batch(batch, 8, 4)
    assert [p["y"].tolist() for p in parts] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert torch.equal(torch.cat([p["x"] for p in parts]), batch["x"])
    assert all(p["scale"] is batch["scale"] for p in parts)
    with pytest.raises(ModelFileError, match="no tensor whose first dimension is its batch size 8"):
        split_batch((torch.zeros(3, 8),), 8, 2)


PER_EXAMPLE = """
import torch
from torch import nn

def build_model():
    torch.manual_seed(0)
    return nn.Linear(16, 1)

def make_batch(batch_size, context_length, device):
    return torch.randn(batch_size, 16, device=device)

def loss(model, batch):
    return model(batch).square().mean()  # a mean over the batch's examples
"""


def test_the_eval_loss_is_the_mean_over_examples_whatever_the_micro_batch(write_model):
    """device: cpu. eval_batches may end on a short batch: cut into the plan's micro-batches, each counts as many
    examples as it holds. Before, each micro-batch's mean counted once: batches of 4 and 3 gave another eval loss
    at micro-batch 4 (2 means) than at 2 (4 means, one of a single example), so an OOM fallback moved it."""
    from oomtune.dist.group import LOCAL
    from oomtune.memory.devices import CpuDevice
    from oomtune.step import build_training, eval_loss
    from oomtune.train.data import Shares

    model_file = load_model_file(write_model(PER_EXAMPLE))
    batches = [torch.randn(4, 16, generator=torch.Generator().manual_seed(n)) for n in (4, 3)]
    batches[1] = batches[1][:3]  # the last one short
    every = torch.cat(batches)
    losses = []
    for micro in (4, 2, 1):
        t = build_training(model_file, Plan(micro, 1, grad_accum_steps=4 // micro), CpuDevice("1GiB"), lr=1e-3,
                           clip_grad_norm=1.0)
        mine, examples = Shares(LOCAL, 4, 4, "eval_batches()").eval_share(batches, micro)
        assert sum(examples) == 7 and [len(m) for m in mine] == examples
        losses.append(float(eval_loss(t, mine, examples)))
        with torch.no_grad():
            assert losses[-1] == pytest.approx(float(t.model(every).square().mean()), rel=1e-6)
    assert max(losses) - min(losses) < 1e-6 * max(losses)


def test_an_evaluation_takes_a_held_out_set_shorter_than_eval_steps_once(write_model):
    """device: cpu. eval_batches yielding 3 batches with eval_steps 20: the stream was restarted and the 3 counted
    7, 7 and 6 times; now each once. An endless hook still gives eval_steps."""
    from oomtune.memory.devices import CpuDevice
    from oomtune.train.data import DataStream

    model_file = load_model_file(write_model(PER_EXAMPLE + """
def eval_batches(batch_size, context_length, device):
    for i in range(3):
        yield torch.full((batch_size, 16), float(i), device=device)
"""))
    device = CpuDevice("1GiB")
    held_out = DataStream(model_file, "eval_batches", 4, 1, device, 0).take_once(20)
    assert [float(b[0, 0]) for b in held_out] == [0.0, 1.0, 2.0]
    assert len(DataStream(model_file, "make_batch", 4, 1, device, 0).take_once(20)) == 20


def test_lr_warms_up_linearly_then_decays_along_a_cosine_to_min_lr():
    from oomtune.config.schema import TrainConfig

    cfg = TrainConfig(steps=110, lr=1.0, min_lr=0.1, warmup_steps=10)
    assert lr_at(0, cfg) == pytest.approx(1 / 11)
    assert lr_at(9, cfg) == pytest.approx(10 / 11)
    assert lr_at(10, cfg) == pytest.approx(1.0)
    assert lr_at(60, cfg) == pytest.approx(0.55)  # half way down the cosine: (lr + min_lr) / 2
    assert lr_at(110, cfg) == pytest.approx(0.1)
    assert all(lr_at(s, cfg) > lr_at(s + 1, cfg) for s in range(10, 109))


# -- it learns -------------------------------------------------------------------------------------------

def test_tiny_gpt_learns_its_real_data_well_below_the_uniform_guess(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cfg = write_config(tmp_path / "best.yaml", EXAMPLES / "tiny_gpt.py", {"micro_batch_size": 8, "context_length": 32},
                       {"steps": 200, "lr": 0.01, "min_lr": 0.001, "warmup_steps": 20, "eval_interval": 50,
                        "eval_steps": 8, "log_every_n_steps": 10, "checkpoint_interval": 200, "run_dir": "run"})
    notes = []
    result = train(cfg, device="cpu", on_event=notes.append)
    rows = metrics(tmp_path / "run")
    evals = [r["eval_loss"] for r in rows if "eval_loss" in r]
    uniform = math.log(256)
    print(f"tiny_gpt eval loss {evals} vs ln(256) = {uniform:.3f}")
    assert [r["step"] for r in rows if "eval_loss" in r] == [50, 100, 150, 200]
    assert evals[-1] < 0.6 * uniform  # well below guessing a byte uniformly
    assert evals[-1] < evals[0]
    assert result.step == 200 and result.eval_loss == evals[-1]
    assert not any(getattr(n, "warning", False) and "synthetic" in n.message for n in notes)  # real data
    assert [r["step"] for r in rows[:3]] == [1, 10, 20]  # the first step, then every log_every_n_steps
    assert rows[0]["loss"] == pytest.approx(uniform, rel=0.05)  # a fresh model guesses bytes about uniformly
    assert rows[0]["lr"] == pytest.approx(0.01 / 21) and rows[1]["lr"] == pytest.approx(0.01 * 10 / 21)
    assert rows[-1]["lr"] == pytest.approx(0.001, rel=0.05)
    assert all(set(r) >= {"step", "loss", "lr", "tokens_per_s", "peak_bytes"} for r in rows)


def test_a_model_file_without_train_batches_trains_on_synthetic_data_with_a_warning(tmp_path, write_model,
                                                                                  monkeypatch):
    monkeypatch.chdir(tmp_path)
    cfg = write_config(tmp_path / "c.yaml", write_model(), {"micro_batch_size": 2, "context_length": 4},
                       {"steps": 3, "run_dir": "run"})
    result = run_cli("train", "--config", cfg, "--device", "cpu")
    assert result.exit_code == 0, result.stderr
    assert "no train_batches(): training on make_batch(), random synthetic data" in result.stderr
    assert [r["step"] for r in metrics(tmp_path / "run")] == [1, 3]


# -- OOM mid-run -----------------------------------------------------------------------------------------------

GROW_PLAN = Plan(micro_batch_size=4, context_length=128, grad_accum_steps=2)


def peak(model: Path, plan: Plan) -> int:
    from oomtune.memory.devices import make_device

    result = run_trial(load_model_file(model), plan, make_device("cpu", "1GiB"), steps=2)
    assert not result.oom
    return result.peak_bytes


@pytest.fixture
def growing(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    model = tmp_path / "growing.py"
    model.write_text(textwrap.dedent(GROWING_MODEL))
    train_cfg = {"steps": 8, "lr": 0.01, "warmup_steps": 0, "log_every_n_steps": 1, "checkpoint_interval": 100,
                 "run_dir": "run"}
    cfg = tmp_path / "best.yaml"  # the block layout `oomtune probe` writes, plus a person's own comment
    text = dump_config(Config(model=str(model), plan=GROW_PLAN, train=TrainConfig(**train_cfg)))
    cfg.write_text(text.replace("train:\n", "train:\n  # a note of mine: keep lr high\n"))
    return model, cfg


def test_an_oom_mid_run_halves_the_micro_batch_keeps_the_global_batch_and_updates_the_config(growing, tmp_path):
    model, cfg = growing
    full, half = peak(model, GROW_PLAN), peak(model, smaller_plan(GROW_PLAN))
    short = peak(model, dataclasses.replace(GROW_PLAN, context_length=GROW_PLAN.context_length // 8))
    assert short < half < full  # the calibration this test relies on
    budget = (half + full) // 2  # the short batches fit at micro-batch 4, the full-length ones only at 2
    before, text_before = load_config(cfg), cfg.read_text()
    cfg.chmod(0o640)

    result = run_cli("train", "--config", cfg, "--device", "cpu", "--budget", str(budget))
    assert result.exit_code == 0, result.stderr
    rows = metrics(tmp_path / "run")
    assert [r["step"] for r in rows] == list(range(1, 9))  # the same number of optimizer steps
    assert [(r["micro_batch_size"], r["grad_accum_steps"]) for r in rows] == [(4, 2)] * 4 + [(2, 4)] * 4
    assert all(r["peak_bytes"] <= budget for r in rows)
    (fallback,) = events(tmp_path / "run", "oom_fallback")
    assert (fallback["step"], fallback["old_plan"]["micro_batch_size"], fallback["new_plan"]["micro_batch_size"]) \
        == (5, 4, 2)
    assert "out of memory" in result.stderr and "retrying the same batch" in result.stderr

    after = load_config(cfg)  # the next run starts from what worked
    assert (after.plan.micro_batch_size, after.plan.grad_accum_steps, after.plan.global_batch_size) == (2, 4, 8)
    assert (after.plan.context_length, after.train, after.model) == (before.plan.context_length, before.train,
                                                                     before.model)
    changed = set(cfg.read_text().splitlines()) ^ set(text_before.splitlines())
    assert "  # a note of mine: keep lr high" in cfg.read_text()  # edited in place: the person's comment stays
    assert cfg.stat().st_mode & 0o777 == 0o640  # and its permissions
    assert sorted(line.split(":")[0].strip() for line in changed) == [  # old and new of each, and a header
        "# plan updated by `oomtune train` at step 5", "grad_accum_steps", "grad_accum_steps", "micro_batch_size",
        "micro_batch_size"]
    state = load_checkpoint(list_checkpoints(tmp_path / "run")[-1][1])
    assert state["step"] == 8
    assert {int(s["step"]) for s in state["optimizer"]["state"].values()} == {8}  # AdamW stepped 8 times, no more

    # the retried step trained on the same batch: the run matches one that never ran out of memory
    ref_cfg = write_config(tmp_path / "ref.yaml", model, {"micro_batch_size": 4, "context_length": 128,
                                                          "grad_accum_steps": 2},
                           {**dataclasses.asdict(after.train), "run_dir": "ref"})
    assert run_cli("train", "--config", ref_cfg, "--device", "cpu", "--budget", "1GiB").exit_code == 0
    ref = metrics(tmp_path / "ref")
    assert [r["micro_batch_size"] for r in ref] == [4] * 8
    worst = max(abs(r["loss"] - q["loss"]) / q["loss"] for r, q in zip(rows, ref, strict=True))
    print(f"OOM fallback run vs a run that never ran out: largest relative loss difference {worst:.2g}")
    assert worst < 1e-5


def test_an_oom_at_micro_batch_1_stops_with_one_line_and_a_checkpoint(growing, tmp_path):
    model, cfg = growing
    short = peak(model, dataclasses.replace(GROW_PLAN, context_length=GROW_PLAN.context_length // 8))
    one = peak(model, Plan(1, GROW_PLAN.context_length, grad_accum_steps=8))
    assert short < one
    before = cfg.read_bytes()

    result = run_cli("train", "--config", cfg, "--device", "cpu", "--budget", str((short + one) // 2))
    assert result.exit_code == 1
    (line,) = [x for x in error_lines(result) if x.startswith("error:")]
    assert "out of memory at micro-batch 1 (step 5" in line and "ckpt-00000004.pt" in line
    state = load_checkpoint(tmp_path / "run" / "ckpt-00000004.pt")
    assert state["step"] == 4 and Plan(**state["plan"]) == GROW_PLAN  # the last plan that ran, to resume from
    assert [e["new_plan"]["micro_batch_size"] for e in events(tmp_path / "run", "oom_fallback")] == [2, 1]
    assert cfg.read_bytes() == before  # no plan worked, so none was written


# -- bad input: one line, exit 2, nothing of the user's overwritten ------------------------------------------

def assert_one_line_exit_2(result, *needles: str) -> None:
    assert result.exit_code == 2, result.stderr
    lines = error_lines(result)
    assert len(lines) == 1 and lines[0].startswith("error:"), lines
    for needle in needles:
        assert needle in lines[0]


def test_a_config_whose_model_file_is_gone(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cfg = write_config(tmp_path / "best.yaml", tmp_path / "gone.py", {"micro_batch_size": 2, "context_length": 4},
                       {"run_dir": "run"})
    before = cfg.read_bytes()
    assert_one_line_exit_2(run_cli("train", "--config", cfg), "model file not found", "gone.py")
    assert cfg.read_bytes() == before and not (tmp_path / "run").exists()


def test_a_train_key_with_a_wrong_type(tmp_path, write_model, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cfg = write_config(tmp_path / "best.yaml", write_model(), {"micro_batch_size": 2, "context_length": 4},
                       {"steps": "ten", "run_dir": "run"})
    before = cfg.read_bytes()
    assert_one_line_exit_2(run_cli("train", "--config", cfg), "train.steps", "'ten'")
    assert cfg.read_bytes() == before and not (tmp_path / "run").exists()


def test_a_corrupt_or_foreign_checkpoint_on_resume_and_a_fresh_run_into_a_used_run_dir(tmp_path, write_model,
                                                                                      monkeypatch):
    monkeypatch.chdir(tmp_path)
    cfg = resume_config(tmp_path, checkpoint_interval=3)
    assert run_cli("train", "--config", cfg, "--device", "cpu", "--steps", "3", "--run-dir", "run").exit_code == 0
    run_files = {p.name: p.read_bytes() for p in (tmp_path / "run").iterdir()}
    other = write_config(tmp_path / "other.yaml", write_model(), RESUME_PLAN, {"run_dir": "run"})  # another model
    assert_one_line_exit_2(run_cli("train", "--config", other, "--device", "cpu", "--resume"),
                           "ckpt-00000003.pt", "does not match")
    assert {p.name: p.read_bytes() for p in (tmp_path / "run").iterdir()} == run_files

    ckpt = tmp_path / "run" / "ckpt-00000003.pt"
    data = ckpt.read_bytes()
    ckpt.write_bytes(data[: len(data) // 3])  # a torn copy
    snapshot = {p.name: p.read_bytes() for p in [cfg, *(tmp_path / "run").iterdir()]}

    assert_one_line_exit_2(run_cli("train", "--config", cfg, "--device", "cpu", "--run-dir", "run", "--resume"),
                           "ckpt-00000003.pt", "truncated")
    assert_one_line_exit_2(run_cli("train", "--config", cfg, "--device", "cpu", "--run-dir", "run"),
                           "already holds a run", "--resume")
    assert {p.name: p.read_bytes() for p in [cfg, *(tmp_path / "run").iterdir()]} == snapshot


def test_resume_needs_a_checkpoint(tmp_path, write_model, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cfg = write_config(tmp_path / "best.yaml", write_model(), {"micro_batch_size": 2, "context_length": 4},
                       {"run_dir": "run"})
    assert_one_line_exit_2(run_cli("train", "--config", cfg, "--resume"), "no checkpoint")



def test_train_runs_where_the_plan_was_probed_unless_told_otherwise(tmp_path, write_model, monkeypatch):
    from oomtune.config.schema import FoundBy
    from oomtune.train.trainer import Trainer

    monkeypatch.chdir(tmp_path)
    found = FoundBy(command="probe", estimated=False, device="cpu", gpu_name="cpu", budget_bytes=12 * 2**20,
                    headroom=0.1, objective="fit", target_batch=2, target_context=4, min_context=4, peak_bytes=1,
                    tokens_per_s=None, torch_version="x", cuda_version=None, oomtune_version="x", date="x")
    cfg = tmp_path / "best.yaml"
    cfg.write_text(dump_config(Config(model=str(write_model()), plan=Plan(2, 4), train=TrainConfig(run_dir="run"),
                                      found_by=found)))
    assert Trainer(cfg).device.budget_bytes == 12 * 2**20  # the simulated card the plan was found for
    assert Trainer(cfg, budget="1GiB").device.budget_bytes == 2**30
    assert_one_line_exit_2(run_cli("train", "--config", cfg, "--device", "fake", "--budget", "1GiB"),
                           "needs a device that computes")
    assert not (tmp_path / "run").exists()


def test_training_peaks_where_the_trial_of_its_plan_did_with_accumulation(tmp_path, write_model, monkeypatch):
    """device: cpu. The trainer kept a tensor per micro-batch's loss (its check for a NaN): each step of an
    accumulating plan peaked a 512-byte block per micro-batch but the last over the probe's trial (its peak in
    backward), past the headroom of a tight plan. The step now keeps them in one tensor, in training and in the
    trial alike. (On make_batch's data, as the trial: a train_batches() may draw batches of other sizes.)"""
    monkeypatch.chdir(tmp_path)
    model, plan = write_model(), Plan(2, 64, grad_accum_steps=8)
    cfg = write_config(tmp_path / "best.yaml", model, {"micro_batch_size": 2, "context_length": 64,
                                                       "grad_accum_steps": 8},
                       {"steps": 3, "log_every_n_steps": 1, "run_dir": "run"})
    train(cfg, device="cpu", budget="1GiB")
    peaks = [r["peak_bytes"] for r in metrics(tmp_path / "run")]
    assert peaks[1:] == [peak(model, plan)] * 2, peaks


def test_an_estimate_with_margin_0_trains_on_the_cpu_device_in_its_budget_and_margin(tmp_path, write_model,
                                                                                   monkeypatch):
    """device: fake (estimate), then cpu (train). `estimate --margin 0` counts tensors alone on the generic card;
    training it on the cpu device took the card's own margin (a 512 MiB context) and refused the 400 KiB budget."""
    monkeypatch.chdir(tmp_path)
    est = run_cli("estimate", write_model(), "--budget", "400KiB", "--margin", "0", "--batch", "4", "--context", "8",
                  "--out", "est.yaml", "--json")
    assert est.exit_code == 0, est.output
    r = run_cli("train", "--config", "est.yaml", "--device", "cpu", "--steps", "2", "--log-every-n-steps", "1",
                "--run-dir", "run")
    assert r.exit_code == 0, r.output
    assert "budget 400.00 KiB, accounting as a generic sm80 card" in r.stderr, r.stderr
    assert [m["peak_bytes"] for m in metrics(tmp_path / "run")][-1] == json.loads(est.stdout)["peak_bytes"]
