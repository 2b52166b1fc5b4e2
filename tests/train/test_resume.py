"""oomtune train, the finer points of going on: a resume keeps the run's own train settings, an out-of-memory
error while the batches are drawn stops cleanly and resumes exactly, weight decay respects the model file's
no-decay groups (also across a resume), and the per-step state count leaves nothing behind.

Every run here is on the `cpu` device (simulated memory, real compute), tiny models, a few steps."""

from __future__ import annotations

import gc
import shutil
from pathlib import Path

import pytest
import yaml

from oomtune.config.schema import Plan
from oomtune.memory.devices import make_device
from oomtune.memory.tracker import MemoryTracker
from oomtune.model_file import load_model_file
from oomtune.step import build_training, state_bytes, train_step
from oomtune.train.checkpoint import load_checkpoint

from ..conftest import metrics, run_cli

# Dropout (the model's RNG) and a seeded data stream: the same seed and schedule give the same losses.
MODEL = '''
from pathlib import Path
import torch
from torch import nn

DRAWS = [0]

class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(16, 16) for _ in range(2))
        self.norm = nn.LayerNorm(16)
        self.out = nn.Linear(16, 4)
        self.drop = nn.Dropout(0.1)

    def forward(self, x, y):
        for b in self.blocks:
            x = self.drop(torch.relu(b(x)))
        return nn.functional.cross_entropy(self.out(self.norm(x)).mean(1), y)

def build_model():
    return Net()

def make_batch(batch_size, context_length, device):
    return (torch.randn(batch_size, context_length, 16, device=device),
            torch.randint(0, 4, (batch_size,), device=device))

def train_batches(batch_size, context_length, device):
    while True:
        DRAWS[0] += 1
        if DRAWS[0] == 9 and Path(__file__).with_name("oom-on-draw-9").exists():
            raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 MiB (pinned batch)")
        x = torch.randn(batch_size, context_length, 16, device=device)
        yield x, (x.sum((1, 2)) > 0).long()

def optimizer(params, lr):
    params = list(params)
    decay = [p for p in params if p.dim() >= 2]
    rest = [p for p in params if p.dim() < 2]
    return torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}],
                             lr=lr)
'''

PLAN = {"micro_batch_size": 2, "context_length": 8, "grad_accum_steps": 2}


@pytest.fixture
def model_dir(tmp_path, monkeypatch, write_model):
    monkeypatch.chdir(tmp_path)
    model = write_model(MODEL)
    (tmp_path / "best.yaml").write_text(yaml.safe_dump(
        {"model": str(model), "plan": PLAN, "train": {"steps": 40, "seed": 1, "warmup_steps": 10, "lr": 0.003,
                                                      "log_every_n_steps": 1, "run_dir": "run"}}, sort_keys=False))
    return tmp_path


def train(*args) -> object:
    return run_cli("train", "--config", "best.yaml", "--device", "cpu", "--budget", "1GiB", *args)


def losses(run_dir: Path) -> list[float]:
    """step, loss, lr of every logged step, one flat list (pytest.approx compares flat sequences)."""
    return [x for r in metrics(run_dir) for x in (r["step"], r["loss"], r["lr"])]


def test_a_resume_goes_on_with_the_settings_the_run_started_with_unless_a_flag_says_otherwise(model_dir):
    flags = ["--steps", "6", "--seed", "5", "--warmup-steps", "2", "--checkpoint-interval", "3"]
    assert train("--run-dir", "whole", *flags).exit_code == 0
    whole = losses(model_dir / "whole")
    assert whole[::3] == [1, 2, 3, 4, 5, 6]

    # a run stopped after step 3 (its checkpoint and metrics), resumed with the bare command oomtune prints
    (model_dir / "cut").mkdir()
    shutil.copy(model_dir / "whole" / "ckpt-00000003.pt", model_dir / "cut")
    shutil.copy(model_dir / "whole" / "metrics.jsonl", model_dir / "cut")
    result = train("--run-dir", "cut", "--resume")
    assert result.exit_code == 0, result.stderr
    assert losses(model_dir / "cut") == pytest.approx(whole, rel=1e-6)  # same seed, schedule, length
    said = " ".join(result.stderr.split())
    assert "resuming with the checkpoint's train settings" in said
    for unused in ("steps 6 (the config says 40)", "seed 5 (the config says 1)",
                   "warmup_steps 2 (the config says 10)"):
        assert unused in said

    assert "learning-rate schedule" not in said  # the same length: the same schedule

    # a flag given with --resume wins: train longer; the cosine schedule is stretched, and the jump is said
    result = train("--run-dir", "cut", "--resume", "--steps", "8")
    assert result.exit_code == 0, result.stderr
    longer = losses(model_dir / "cut")
    assert longer[::3] == list(range(1, 9))
    assert longer[:9] == pytest.approx(whole[:9], rel=1e-6)
    step7 = longer[3 * 6 + 2]
    assert f"the learning-rate schedule now decays to step 8 (the run began with 6): at step 7 the learning rate " \
           f"goes from 3e-05 to {step7:.3g}" in " ".join(result.stderr.split())  # (6 steps: min_lr there)


def test_an_oom_while_the_batches_are_drawn_stops_with_a_checkpoint_and_resumes_exactly(model_dir):
    assert train("--run-dir", "ref", "--steps", "6").exit_code == 0
    marker = model_dir / "oom-on-draw-9"  # 2 draws a step: the 9th is step 5's first
    marker.touch()
    before = (model_dir / "best.yaml").read_bytes()
    result = train("--run-dir", "run", "--steps", "6")
    assert result.exit_code == 1
    (line,) = [" ".join(x.split()) for x in result.stderr.split("\n\n") if x.startswith("error:")]
    assert line.startswith("error: out of memory while drawing the batches of step 5"), line
    assert "ckpt-00000004.pt (step 4)" in line
    assert load_checkpoint(model_dir / "run" / "ckpt-00000004.pt")["step"] == 4
    assert (model_dir / "best.yaml").read_bytes() == before  # no plan was changed: a smaller one cannot help

    marker.unlink()
    assert train("--run-dir", "run", "--resume").exit_code == 0
    assert losses(model_dir / "run") == pytest.approx(losses(model_dir / "ref"), rel=1e-6)


def test_weight_decay_is_set_on_the_decaying_groups_only_and_a_flag_changes_it_on_resume(model_dir):
    def decays(step: int) -> list[float]:
        state = load_checkpoint(model_dir / "run" / f"ckpt-{step:08d}.pt")
        return [g["weight_decay"] for g in state["optimizer"]["param_groups"]]

    assert train("--run-dir", "run", "--steps", "2", "--weight-decay", "0.05").exit_code == 0
    assert decays(2) == [0.05, 0.0]  # norms and biases: the model file built them without decay
    assert train("--run-dir", "run", "--resume", "--steps", "3", "--weight-decay", "0.2").exit_code == 0
    assert decays(3) == [0.2, 0.0]  # the loaded optimizer state brought 0.05: the flag is applied after it


def test_a_resume_on_a_simulated_device_runs_the_optimizer_as_cuda_does_whatever_the_checkpoint_says(model_dir):
    """The cpu device runs AdamW as foreach (CUDA's choice, with its temporaries). A checkpoint written where torch
    chose for itself (a GPU run: foreach None) brings None back with its param groups; the resume sets it again."""
    import torch

    def foreach(step: int) -> list:
        state = load_checkpoint(model_dir / "run" / f"ckpt-{step:08d}.pt")
        return [g["foreach"] for g in state["optimizer"]["param_groups"]]

    assert train("--run-dir", "run", "--steps", "2").exit_code == 0
    assert foreach(2) == [True, True]
    path = model_dir / "run" / "ckpt-00000002.pt"
    state = torch.load(path, weights_only=True)
    for group in state["optimizer"]["param_groups"]:
        group["foreach"] = None
    torch.save(state, path)
    assert train("--run-dir", "run", "--resume", "--steps", "3").exit_code == 0
    assert foreach(3) == [True, True]


def test_counting_the_state_each_step_leaves_no_tracker_alive(write_model):
    model_file = load_model_file(write_model(MODEL))
    t = build_training(model_file, Plan(2, 8), make_device("cpu", "1GiB"), lr=1e-3)
    device = t.device
    batch = model_file.batch(2, 8, device.torch_device)
    with device.measure():
        train_step(t, [batch])

    def trackers() -> int:
        gc.collect()
        return sum(type(o) is MemoryTracker for o in gc.get_objects())  # type(): no proxy object is asked

    counts = [state_bytes(t) for _ in range(3)]
    alive = trackers()
    counts += [state_bytes(t) for _ in range(3)]
    assert trackers() == alive  # each count's tracker is gone with it
    params = sum(p.numel() * p.element_size() for p in t.model.parameters())
    assert len(set(counts)) == 1 and counts[0] >= 4 * params  # weights, gradients, AdamW's two moments


def test_sys_exit_inside_train_batches_is_one_line_and_exit_2(model_dir):
    model = model_dir / "model.py"
    model.write_text(model.read_text().replace("        DRAWS[0] += 1\n", "        DRAWS[0] += 1\n"
                                               "        if DRAWS[0] == 3:\n            raise SystemExit(3)\n"))
    result = train("--run-dir", "run", "--steps", "4")
    assert result.exit_code == 2, result.stderr
    (line,) = [" ".join(x.split()) for x in result.stderr.split("\n\n") if x.startswith("error:")]
    assert "train_batches() called sys.exit(3)" in line


@pytest.mark.parametrize("other", ["torch.optim.SGD(params, lr=lr, momentum=0.9)", "torch.optim.Adam(params, lr=lr)"])
def test_a_resume_whose_model_file_now_builds_another_optimizer_is_bad_input_before_training(model_dir, other):
    """The model file's optimizer() changed since the run started: torch's load_state_dict copies AdamW's groups
    and state into the new optimizer without a word; SGD then failed in its first update (KeyError: 'momentum',
    exit 1, "continue with --resume", which failed again), Adam silently trained without decoupled decay."""
    assert train("--run-dir", "run", "--steps", "2").exit_code == 0
    model = Path(yaml.safe_load((model_dir / "best.yaml").read_text())["model"])
    source = model.read_text()
    start = source.index("def optimizer(")
    model.write_text(source[:start] + f"def optimizer(params, lr):\n    return {other}\n")
    metrics_before = (model_dir / "run" / "metrics.jsonl").read_text()
    result = train("--run-dir", "run", "--resume", "--steps", "4")
    assert result.exit_code == 2, result.output
    (line,) = [x for x in result.stderr.splitlines() if x.startswith("error:")]
    assert "ckpt-00000002.pt holds the state of another optimizer" in line, line
    assert "Traceback" not in result.output
    assert sorted(p.name for p in (model_dir / "run").glob("ckpt-*")) == ["ckpt-00000002.pt"]
    assert (model_dir / "run" / "metrics.jsonl").read_text() == metrics_before  # nothing of the run written


def test_a_short_last_eval_batch_is_evaluated_after_the_micro_batch_shrank(tmp_path, monkeypatch, write_model):
    """eval_batches may end on a short batch (docs/training.md). Once the micro-batch is smaller than the batches
    are drawn at (an out-of-memory fallback, or a resume from a config the fallback rewrote), a short batch of 3
    found no tensor of the drawn size 4 to split: the run stopped at its first evaluation, blaming train_batches."""
    monkeypatch.chdir(tmp_path)
    model = write_model(MODEL + '''
def eval_batches(batch_size, context_length, device):
    g = torch.Generator().manual_seed(0)
    for n in (batch_size, 3):  # the last one short
        x = torch.randn(n, context_length, 16, generator=g).to(device)
        yield x, (x.sum((1, 2)) > 0).long()
''')

    def config(micro: int, accum: int) -> None:
        plan = {"micro_batch_size": micro, "context_length": 8, "grad_accum_steps": accum}
        (tmp_path / "best.yaml").write_text(yaml.safe_dump(
            {"model": str(model), "plan": plan, "train": {"steps": 4, "seed": 1, "warmup_steps": 1, "lr": 0.003,
                                                          "eval_interval": 2, "eval_steps": 2,
                                                          "checkpoint_interval": 2, "run_dir": "run"}},
            sort_keys=False))

    config(4, 1)
    assert train("--steps", "2").exit_code == 0
    config(2, 2)  # as the fallback writes it: micro-batch halved, accumulation doubled, batches still drawn at 4
    result = train("--resume", "--steps", "4")
    assert result.exit_code == 0, result.output
    rows = [r for r in metrics(tmp_path / "run") if "eval_loss" in r]
    assert [(r["step"], r["micro_batch_size"]) for r in rows] == [(2, 4), (4, 2)]
    assert all(r["eval_loss"] is not None for r in rows)


def test_the_configs_weight_decay_replacing_the_model_files_own_is_said(model_dir):
    """The model file's optimizer() builds its decaying group with 0.1; a config whose train.weight_decay is another
    (the default a probe writes, where the file's is nanoGPT's own) replaced it with no word (from a new user's
    pass). A --weight-decay given now is the user's word: nothing to say."""
    config = model_dir / "best.yaml"
    config.write_text(config.read_text().replace("  run_dir: run\n", "  run_dir: run\n  weight_decay: 0.02\n"))
    said = " ".join(train("--run-dir", "run", "--steps", "1").stderr.split())
    assert ("warning: model.py's optimizer() builds its decaying param groups with weight_decay 0.1; "
            "train.weight_decay 0.02 replaces it (pass --weight-decay 0.1, or set train.weight_decay, to keep it)"
            ) in said, said
    flagged = " ".join(train("--run-dir", "run2", "--steps", "1", "--weight-decay", "0.05").stderr.split())
    assert "replaces it" not in flagged, flagged
