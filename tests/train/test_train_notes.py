"""What `oomtune train` says before its first step: a warmup as long as the run (the learning rate never reaches
its peak), and a plan made for a GPU trained on the simulated cpu device because there is no GPU here.

The notes are built with the Trainer (no model is built before run()); one CLI run each shows the line on stderr
before the first step. `cpu` device, torch at one thread, 2 steps."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest
import torch

from oomtune.config.schema import Config, FoundBy, Plan, TrainConfig
from oomtune.config.writing import dump_config
from oomtune.train.trainer import Trainer

from ..conftest import EXAMPLES, run_cli

T4_BYTES = 16106127360  # a Tesla T4's memory, the budget `estimate --gpu t4` plans in
FOUND = FoundBy(command="estimate", estimated=True, device="fake", gpu_name="Tesla T4 (estimated)",
                budget_bytes=T4_BYTES, headroom=0.1, objective="fit", target_batch=2, target_context=16,
                min_context=16, peak_bytes=1, tokens_per_s=None, torch_version="x", cuda_version=None,
                oomtune_version="x", date="x", card="t4")


@pytest.fixture
def config(tmp_path, monkeypatch):
    """config(found_by=FOUND, **train) -> a tiny_gpt config in tmp_path (the working folder), run dir `run`; no GPU
    here."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    torch.set_num_threads(1)

    def write(found_by: FoundBy | None = FOUND, **train) -> str:
        train = {"steps": 2, "eval_steps": 1, "run_dir": "run", **train}
        (tmp_path / "best.yaml").write_text(dump_config(Config(str(EXAMPLES / "tiny_gpt.py"), Plan(2, 16),
                                                               TrainConfig(**train), found_by)))
        return "best.yaml"

    return write


def notes(config_path: str, **kwargs) -> list[str]:
    return [n.message for n in Trainer(config_path, **kwargs).notes]


def stderr_before_first_step(result) -> list[str]:
    assert result.exit_code == 0, result.output
    lines = [" ".join(line.split()) for line in result.stderr.splitlines()]
    return lines[:next(i for i, line in enumerate(lines) if line.startswith("step 1 "))]


# -- the warmup ------------------------------------------------------------------------------------------------

def test_a_warmup_as_long_as_the_run_is_said_before_training(config):
    cfg = config(found_by=None)  # the default warmup: 100 steps
    before = stderr_before_first_step(run_cli("train", "--config", cfg, "--device", "cpu", "--budget", "1GiB"))
    warned = [line for line in before if "warmup" in line]
    assert warned == ["warning: warmup (100 steps) is as long as the run (2 steps): the learning rate never "
                      "reaches 0.0003; pass --warmup-steps (fewer than 2)"], before
    assert before[0].startswith("training from scratch on cpu")  # after the header, before step 1


def test_a_warmup_shorter_than_the_run_says_nothing(config):
    cfg = config(found_by=None, warmup_steps=2)
    assert [n for n in notes(cfg, device="cpu") if "warmup" in n]  # 2 steps: as long as the run
    assert not [n for n in notes(cfg, device="cpu", overrides={"warmup_steps": 1}) if "warmup" in n]
    assert not [n for n in notes(cfg, device="cpu", overrides={"steps": 3}) if "warmup" in n]
    before = stderr_before_first_step(run_cli("train", "--config", cfg, "--device", "cpu", "--budget", "1GiB",
                                              "--warmup-steps", "1"))
    assert not [line for line in before if "warmup" in line], before


# -- a plan made for a GPU, no GPU here --------------------------------------------------------------------------

def test_an_estimate_for_a_t4_says_it_trains_on_the_cpu_device_and_in_which_budget(config):
    cfg = config(warmup_steps=1)
    ram = lambda lines: [re.sub(r"budget of [0-9.]+ \w+", "budget of RAM", n) for n in lines]  # noqa: E731
    assert ram(notes(cfg, device="auto")) == ram(notes(cfg))  # --device auto: the same (the free RAM moves)
    assert notes(cfg, budget="15GiB") == ["this plan was estimated for a Tesla T4 (fake device, budget 15.00 GiB); "
                                          "no GPU here, so it trains on the cpu device, simulating that budget and "
                                          "card"]
    before = stderr_before_first_step(run_cli("train", "--config", cfg))
    said = [line for line in before if "no GPU here" in line]
    assert said == ["warning: this plan was estimated for a Tesla T4 (fake device, budget 15.00 GiB); no GPU here, so "
                    "it trains on the cpu device, simulating that budget and card"], before
    # it accounts like the card the estimate was for (its context, workspaces and allocator are in that budget), as
    # `probe --device cpu --gpu t4` does: it counted tensors alone, and a 556 MiB T4 plan of a 10 MiB model could
    # never run out
    assert "budget 15.00 GiB, accounting as Tesla T4 (sm75)" in before[0], before
    other = stderr_before_first_step(run_cli("train", "--config", cfg, "--budget", "1GiB", "--run-dir", "run2"))
    assert [line for line in other if "no GPU here" in line][0].endswith(
        "in a simulated budget of 1.00 GiB, not the plan's (--budget 15.00GiB simulates it)"), other
    half = config(dataclasses.replace(FOUND, budget_bytes=T4_BYTES // 2), warmup_steps=1)  # `--budget 7.5GiB`'s
    said = stderr_before_first_step(run_cli("train", "--config", half, "--run-dir", "run3"))
    assert "budget 7.50 GiB, accounting as Tesla T4 (sm75)" in said[0], said  # the plan's, not the card's memory


def test_a_budget_the_cards_context_and_workspaces_leave_too_little_of_is_bad_input(config):
    """The weights' floor is checked against what the budget leaves for tensors: the T4's 512 MiB context and its
    cuBLAS workspaces out of 534 MiB leave 2 MiB, less than tiny_gpt's weights, gradients and AdamW state."""
    r = run_cli("train", "--config", config(warmup_steps=1), "--budget", "534MiB")
    assert r.exit_code == 2, r.output
    said = " ".join(r.stderr.split())
    assert ("budget 534.00 MiB (2.00 MiB for tensors, after the margin (a card's context and workspaces)) is too "
            "small for the plan's weights alone") in said, said
    assert not (Path("run")).exists()


def test_a_plan_probed_on_a_gpu_or_for_a_card_says_so_where_auto_finds_no_gpu(config):
    cuda = dataclasses.replace(FOUND, command="probe", estimated=False, device="cuda", gpu_name="NVIDIA A100-SXM4-80GB",
                               card=None)
    assert notes(config(cuda, warmup_steps=1), device="auto", budget="1GiB") == [
        "this plan was probed on NVIDIA A100-SXM4-80GB (cuda, budget 15.00 GiB); no GPU here, so it trains on the cpu "
        "device in a simulated budget of 1.00 GiB, not the plan's (--budget 15.00GiB simulates it)"]
    like_t4 = dataclasses.replace(FOUND, command="probe", estimated=False, device="cpu",
                                  gpu_name="cpu (simulated memory, budget 15.00 GiB, accounting as Tesla T4 (sm75))")
    assert notes(config(like_t4, warmup_steps=1), device="auto") == [
        "this plan was probed for a Tesla T4 (cpu device, budget 15.00 GiB); no GPU here, so it trains on the cpu "
        "device, simulating that budget and card"]


def test_no_gpu_note_where_cpu_is_what_was_asked_for_or_the_plan_is_not_a_gpus(config):
    assert len(notes(config(warmup_steps=1))) == 1  # auto, no GPU: said
    assert notes(config(warmup_steps=1), device="cpu") == []  # --device cpu: the user's choice
    plain_cpu = dataclasses.replace(FOUND, command="probe", estimated=False, device="cpu", gpu_name="cpu", card=None)
    assert notes(config(plain_cpu, warmup_steps=1), device="auto") == []  # found on the cpu with CPU semantics
    like_t4 = dataclasses.replace(plain_cpu, card="t4")
    assert notes(config(like_t4, warmup_steps=1)) == []  # trains where it was probed, as the config says
    assert notes(config(None, warmup_steps=1), device="auto") == []  # no found_by


def test_no_gpu_note_where_there_is_a_gpu(config, monkeypatch):
    from oomtune.memory import devices
    from oomtune.train.notes import run_notes

    cfg = config(warmup_steps=1)
    trainer = Trainer(cfg, device="cpu")
    assert [n.message for n in run_notes(trainer.inputs, 0, None, trainer.device)]  # no GPU: said
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert isinstance(trainer.device, devices.CpuDevice)
    assert run_notes(trainer.inputs, 0, None, trainer.device) == []  # a GPU here: auto does not fall back


def test_a_plan_found_for_two_ranks_trained_on_one_drops_ddp_and_says_no_trial_measured_it(config, tmp_path):
    """A 2-rank plan trained with no --nproc-per-node ran as "ddp x1 rank" (a one-process DDP's buckets), 6 x 2 where
    the probe measured 6 x 1 per rank, past the limit with no word (from a new user's pass)."""
    cfg = config(found_by=None, warmup_steps=1)
    path = tmp_path / cfg
    path.write_text(path.read_text().replace("micro_batch_size: 2", "micro_batch_size: 1")
                    .replace("world_size: 1", "world_size: 2").replace("sharding: none", "sharding: ddp"))
    trainer = Trainer(cfg, device="cpu")
    assert trainer.inputs.plan == Plan(1, 16, grad_accum_steps=2)  # sharding none: no DDP on one process
    assert [n.message for n in trainer.notes] == [
        "the plan was found for 2 rank(s) (micro-batch 1, context 16, fp32, ddp x2 ranks (global batch 2)); on 1 it "
        "runs as micro-batch 1, context 16, fp32, x2 accumulation (global batch 2), a shape no trial measured: "
        "probe it on 1 (--nproc-per-node) to know it fits"]
