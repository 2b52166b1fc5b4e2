"""Shared test helpers. Tests say which device they use; `cpu` and `fake` simulate memory, `cuda` is real."""

from __future__ import annotations

import gc
import json
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples"

# A minimal valid model file; tests write variants of it to tmp_path.
TINY_MODEL = '''
import torch
from torch import nn

class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(16, 16) for _ in range(2))
        self.out = nn.Linear(16, 4)

    def forward(self, x, y):
        for b in self.blocks:
            x = torch.relu(b(x))
        return nn.functional.cross_entropy(self.out(x).mean(1), y)

def build_model():
    return Net()

def make_batch(batch_size, context_length, device):
    return (torch.randn(batch_size, context_length, 16, device=device),
            torch.randint(0, 4, (batch_size,), device=device))
'''


@pytest.fixture(autouse=True, scope="session")
def settled_session():
    """The whole session inside oomtune.search.trial.settled_objects, so a probe run by a test does not unfreeze
    what the tests froze (below) when it ends."""
    from oomtune.search.trial import settled_objects

    with settled_objects():
        yield


@pytest.fixture(autouse=True)
def settled(settled_session):
    """What lives before a test (the libraries, earlier tests' objects) is left out of the garbage collections
    after each of its trials, as a search does for itself: with transformers imported, a full collection costs
    ~0.3 s, and the suite runs hundreds of trials. Garbage is collected first, so none is frozen; a cycle through
    a frozen object is only collected when the session ends (test processes only: a search unfreezes on exit)."""
    gc.collect()
    gc.freeze()


@pytest.fixture(autouse=True)
def own_working_folder(tmp_path_factory, monkeypatch):
    """Every test runs in a folder of its own: a command's default --out (best.yaml) and run dir land there, not
    in the checkout, where the README's quickstart leaves a best.yaml of its own (32 tests failed beside one)."""
    monkeypatch.chdir(tmp_path_factory.mktemp("cwd"))


@pytest.fixture(autouse=True)
def traces_in_one_process(request, monkeypatch):
    """The suite runs three workers on two cores: no core is free for the estimate's forked copies (search/
    fan_out.py), which would only add forks and page copies (a fresh clone's suite took 13:41 with them and 13:31
    without: little either way). Every test traces in one process, except tests/search/test_fan_out.py, which holds
    the copies' results to the one process's."""
    from oomtune.search import fan_out

    if not request.module.__name__.endswith("test_fan_out"):
        monkeypatch.setattr(fan_out, "PROCESSES", 1)


@pytest.fixture(autouse=True)
def one_thread():
    """torch on one thread in every test (a 2-core machine shared by two pytest workers; OMP_NUM_THREADS=1 in
    `make test` does the same for the processes the tests start)."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture
def write_model(tmp_path):
    """write_model(source, name='model.py') -> Path of a model file in tmp_path."""

    def write(source: str = TINY_MODEL, name: str = "model.py") -> Path:
        path = tmp_path / name
        path.write_text(textwrap.dedent(source))
        return path

    return write


def one_line_error(r, *needles: str) -> None:
    """A CLI result that is bad input: exit 2, one line on stderr ("error: ..."), no traceback, naming `needles`."""
    assert r.exit_code == 2, r.output
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:"), r.stderr
    assert "Traceback" not in r.output
    for needle in needles:
        assert needle in lines[0], lines[0]


def run_cli(*args: str):
    """Run the CLI in-process; returns typer's Result (exit_code, stdout, stderr)."""
    from typer.testing import CliRunner

    from oomtune.cli import app

    return CliRunner().invoke(app, [str(a) for a in args])


def _not_json(token: str):
    raise ValueError(f"{token} is not JSON")  # a bare NaN / Infinity: oomtune writes strict JSON (null)


def metrics(run_dir: Path) -> list[dict]:
    """The rows of a run's metrics.jsonl, read as strict JSON."""
    return [json.loads(line, parse_constant=_not_json)
            for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def trained_with_and_without(folder: Path, config: dict, key: str, steps: int) -> tuple[list, list]:
    """`oomtune train` (device cpu, 1GiB) of `config` with plan[key] true, then false, each written to `folder` and
    run in a run dir of its own there: each run's (step, loss) rows."""
    import yaml

    config["train"]["log_every_n_steps"] = 1
    for name, on in (("on", True), ("off", False)):
        config["plan"][key] = on
        (folder / f"{name}.yaml").write_text(yaml.safe_dump(config))
        t = run_cli("train", "--config", folder / f"{name}.yaml", "--device", "cpu", "--budget", "1GiB", "--steps",
                    str(steps), "--run-dir", folder / name)
        assert t.exit_code == 0, t.output
    on, off = ([(m["step"], m["loss"]) for m in metrics(folder / n)] for n in ("on", "off"))
    return on, off


def events(run_dir: Path, kind: str) -> list[dict]:
    """The events of one kind in a run's events.jsonl."""
    lines = (run_dir / "events.jsonl").read_text().splitlines()
    return [e for line in lines if (e := json.loads(line))["event"] == kind]


@pytest.fixture
def case_dir(tmp_path, monkeypatch, write_model):
    """tests/train/cases.py's model and config in tmp_path, the working folder; torch on one thread."""
    import torch

    from .train.cases import make_case

    monkeypatch.chdir(tmp_path)
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield make_case(tmp_path, write_model)
    torch.set_num_threads(before)
