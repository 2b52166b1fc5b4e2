"""oomtune train on data whose pass ends on a short batch (a DataLoader's default drop_last=False): the step that
holds it takes the mean gradient over the examples it saw, the next pass is a new epoch (events.jsonl, the
console), and a resume on either side of the boundary is bit-identical to a run that was not interrupted. Tuples,
dicts and a plain generator; a batch of 0 examples is skipped with a note.

Every run here is on the `cpu` device (simulated memory, real compute), a tiny model, a few dozen steps."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import yaml

from oomtune.config.schema import Plan
from oomtune.dist.group import LOCAL
from oomtune.memory.devices import CpuDevice
from oomtune.model_file import load_model_file
from oomtune.step import build_training, train_step
from oomtune.train.checkpoint import load_checkpoint
from oomtune.train.data import Shares

from ..conftest import events, metrics, run_cli

# Per-example features (N, 16) and labels; dropout (the model's RNG) and a shuffling DataLoader (the data stream's
# RNG). A file `form` next to the model picks how the batches come: tuples from a DataLoader, dicts from one, or a
# plain generator (whose every pass starts with a batch of 0 examples); `examples` how many there are; `fail-at`
# (tuples) makes that draw raise, which stops the run with the last finished step saved.
MODEL = '''
from pathlib import Path
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

HERE = Path(__file__).parent
FORM = (HERE / "form").read_text() if (HERE / "form").exists() else "tuples"
N = int((HERE / "examples").read_text()) if (HERE / "examples").exists() else 203

class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.hidden = nn.Linear(16, 32)
        self.drop = nn.Dropout(0.1)
        self.out = nn.Linear(32, 4)

    def forward(self, x, y):
        return nn.functional.cross_entropy(self.out(self.drop(torch.relu(self.hidden(x)))), y)

def build_model():
    return Net()

def make_batch(batch_size, context_length, device):
    return torch.randn(batch_size, 16, device=device), torch.randint(0, 4, (batch_size,), device=device)

def data(n, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 16, generator=g)
    return x, (x[:, :4].argmax(1) + (x[:, 4] > 1).long()) % 4

X, Y = data(N, 0)
DRAWS = [0]

class Pairs(torch.utils.data.Dataset):
    def __len__(self):
        return N

    def __getitem__(self, i):
        return {"x": X[i], "y": Y[i]}

def train_batches(batch_size, context_length, device):
    if FORM == "generator":
        yield torch.empty(0, 16, device=device), torch.empty(0, dtype=torch.long, device=device)
        order = torch.randperm(N)
        for i in range(0, N, batch_size):
            yield X[order[i:i + batch_size]].to(device), Y[order[i:i + batch_size]].to(device)
    elif FORM == "dicts":
        for b in DataLoader(Pairs(), batch_size=batch_size, shuffle=True):
            yield {k: v.to(device) for k, v in b.items()}
    else:
        for x, y in DataLoader(TensorDataset(X, Y), batch_size=batch_size, shuffle=True):
            DRAWS[0] += 1
            if (HERE / "fail-at").exists() and DRAWS[0] == int((HERE / "fail-at").read_text()):
                raise ValueError("the data server went away")
            yield x.to(device), y.to(device)

def eval_batches(batch_size, context_length, device):
    x, y = data(21, 1)
    for i in range(0, 21, batch_size):
        yield x[i:i + batch_size].to(device), y[i:i + batch_size].to(device)
'''


@pytest.fixture
def model_dir(tmp_path, monkeypatch, write_model):
    monkeypatch.chdir(tmp_path)
    write_model(MODEL)
    return tmp_path


def configure(folder: Path, micro: int, accum: int, steps: int) -> None:
    plan = {"micro_batch_size": micro, "context_length": 1, "grad_accum_steps": accum}
    (folder / "best.yaml").write_text(yaml.safe_dump(
        {"model": "model.py", "plan": plan,
         "train": {"steps": steps, "seed": 3, "warmup_steps": 2, "lr": 0.01, "log_every_n_steps": 1,
                   "eval_interval": 5, "eval_steps": 10, "checkpoint_interval": 7, "run_dir": "run"}},
        sort_keys=False))


def train(*args: str):
    return run_cli("train", "--config", "best.yaml", "--device", "cpu", "--budget", "1GiB", *args)


def logged(run_dir: Path) -> list[tuple]:
    return [(r["step"], r["loss"], r["lr"], r.get("eval_loss")) for r in metrics(run_dir)]


def weights(path: Path) -> dict[str, torch.Tensor]:
    return load_checkpoint(path)["model"]


def test_a_step_with_a_short_batch_takes_the_mean_gradient_over_the_examples_it_saw(model_dir):
    """device: cpu. Batches of 8, 8 and 3 (a pass's end) in one step: each micro-batch's mean loss weighs its
    examples over the step's 19, so the update is the one a single batch of the 19 gives; after an out-of-memory
    fallback to micro-batch 2 the short batch is cut into 2 + 1 and the update is still the same."""
    model_file = load_model_file(model_dir / "model.py")
    x, y = torch.randn(19, 16, generator=torch.Generator().manual_seed(5)), torch.arange(19) % 4
    batches = [(x[:8], y[:8]), (x[8:16], y[8:16]), (x[16:], y[16:])]

    def stepped(plan: Plan, micro: list, parts: list[float] | None) -> tuple[float, list[torch.Tensor]]:
        torch.manual_seed(0)
        t = build_training(model_file, plan, CpuDevice("1GiB"), lr=0.1)
        t.optimizer = torch.optim.SGD(t.model.parameters(), lr=0.1)
        t.model.eval()  # (no dropout: the same function of the examples however they are cut)
        loss = train_step(t, micro, 0, parts)
        return float(loss), [p.detach().clone() for p in t.model.parameters()]

    whole_loss, whole = stepped(Plan(19, 1), [(x, y)], None)
    for micro in (8, 2):
        cut, parts = Shares(LOCAL, 8, 8, "train_batches()").train_cut(batches, micro)
        sizes = [len(m[0]) for m in cut]
        assert sizes == ([8, 8, 3] if micro == 8 else [2] * 8 + [2, 1])
        assert parts == [n / 19 for n in sizes]
        loss, params = stepped(Plan(micro, 1, grad_accum_steps=16 // micro), cut, parts)
        assert loss == pytest.approx(whole_loss, rel=1e-6)  # the logged loss: the mean over the 19
        for p, q in zip(params, whole, strict=True):
            torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)
    assert Shares(LOCAL, 8, 8, "train_batches()").train_cut(batches[:2], 4)[1] is None  # whole: equal parts


def test_a_dataloader_ending_on_a_short_batch_trains_on_and_resumes_bit_identically(model_dir):
    """203 examples at micro-batch 8 with 2 accumulated: step 13 holds batch 25 and the short 26th (3 examples),
    step 14 begins epoch 2. It stopped the run with exit 2. A run resumed from step 7 (the boundary ahead) or
    from step 14 (behind it) logs the very same losses and ends on the very same weights as one not interrupted."""
    configure(model_dir, 8, 2, 16)
    result = train("--run-dir", "whole")
    assert result.exit_code == 0, result.output
    said = " ".join(result.stderr.split())
    assert "epoch 2 begins: train_batches() ended after 26 batches, the last of 3 examples (of 8) (step 14)" in said
    (epoch,) = events(model_dir / "whole", "epoch")
    assert {k: epoch[k] for k in ("step", "epoch", "batches", "last_batch_examples")} == \
        {"step": 14, "epoch": 2, "batches": 26, "last_batch_examples": 3}
    whole = logged(model_dir / "whole")
    assert [r[0] for r in whole] == list(range(1, 17)) and [r[0] for r in whole if r[3] is not None] == [5, 10, 15, 16]
    final = weights(model_dir / "whole" / "ckpt-00000016.pt")

    for step in (7, 14):  # stopped by a failing draw (step + 1's first), resumed with the bare command
        (model_dir / "fail-at").write_text(str(2 * step + 1))
        run = f"stopped-after-{step}"
        assert train("--run-dir", run).exit_code == 2
        assert sorted(p.name for p in (model_dir / run).glob("ckpt-*"))[-1] == f"ckpt-{step:08d}.pt"
        (model_dir / "fail-at").unlink()
        resumed = train("--run-dir", run, "--resume")
        assert resumed.exit_code == 0, resumed.output
        assert logged(model_dir / run) == whole  # bit for bit
        assert [e["step"] for e in events(model_dir / run, "epoch")] == [14]  # said once, when it was drawn
        again = weights(model_dir / run / "ckpt-00000016.pt")
        assert all(torch.equal(again[k], final[k]) for k in final)


@pytest.mark.parametrize("form", ["dicts", "generator"])
def test_dicts_and_a_plain_generator_end_their_passes_on_a_short_batch(model_dir, form):
    """device: cpu. 21 examples at micro-batch 8: passes of 8, 8, 5. The generator starts every pass with a batch
    of 0 examples (a forward on it gave a NaN loss): skipped, said once, not counted in the data position."""
    (model_dir / "form").write_text(form)
    (model_dir / "examples").write_text("21")
    configure(model_dir, 8, 1, 7)
    result = train("--run-dir", "run")
    assert result.exit_code == 0, result.output
    said = " ".join(result.stderr.split())
    assert [(e["step"], e["epoch"]) for e in events(model_dir / "run", "epoch")] == [(4, 2), (7, 3)]
    assert "epoch 3 begins: train_batches() ended after 3 batches, the last of 5 examples (of 8) (step 7)" in said
    empty = "model.py: train_batches() yielded a batch of 0 examples: skipped (and any more like it) (step 1)"
    assert (empty in said) == (form == "generator")
    rows = metrics(model_dir / "run")
    assert all(r["loss"] == r["loss"] for r in rows) and rows[-1]["eval_loss"] is not None  # no NaN
    assert load_checkpoint(model_dir / "run" / "ckpt-00000007.pt")["data"]["batches"] == 7


def test_a_short_batch_on_several_ranks_is_one_line(model_dir):
    """device: none (the sharing alone). The ranks' gradients are averaged with equal weights, which a short batch's
    are not: refused with one line, exit 2, rather than trained with the wrong weights."""
    from oomtune.errors import ModelFileError

    class TwoRanks:
        world_size, rank = 2, 0

    full, short = (torch.zeros(8, 16), torch.zeros(8)), (torch.zeros(3, 16), torch.zeros(3))
    shares = Shares(TwoRanks(), 8, 8, "model.py: train_batches()")
    assert len(shares.share([full, full])) == 1
    line = (r"^model\.py: train_batches\(\) yielded a batch of 3 examples \(of 8\): on 2 ranks every batch must be "
            r"whole \(a DataLoader's drop_last=True\)$")
    with pytest.raises(ModelFileError, match=line):
        shares.share([full, short])
