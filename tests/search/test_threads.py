"""torch's thread count on the simulated devices (memory/threads.py): one thread unless OMP_NUM_THREADS says
otherwise, said in the output and in found_by.threads, and `train` on a plan probed on the cpu device computes with
the count the probe measured its tokens/s with. The caller's count is put back after. Before, probe ran on torch's
one thread per core and the Makefile's demo trained with OMP_NUM_THREADS=1: on this 2-core machine the probe's
tokens/s were a third to a quarter of train's for the same plan.

device: cpu (each trial and step records the threads torch computes with); a tiny model, a few steps."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import yaml

import oomtune
from oomtune.config.loading import load_config
from oomtune.train.trainer import train

from ..conftest import TINY_MODEL

# Every forward on real tensors appends torch's thread count to `threads.txt` beside the model.
MODEL = TINY_MODEL.replace("    def forward(self, x, y):\n", '''    def forward(self, x, y):
        if not is_fake(x):  # (the checks before a trial or a run compute nothing)
            with open(Path(__file__).with_name("threads.txt"), "a") as f:
                f.write(f"{torch.get_num_threads()}\\n")
''') + "\nfrom pathlib import Path\nfrom torch._subclasses.fake_tensor import is_fake\n"


def seen(folder: Path) -> set[int]:
    counts = {int(n) for n in (folder / "threads.txt").read_text().split()}
    (folder / "threads.txt").unlink()
    return counts


@pytest.fixture
def two_threads(monkeypatch):
    """The caller's count is torch's default on this machine (2), OMP_NUM_THREADS unset."""
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    torch.set_num_threads(2)  # (conftest puts its own back after the test)


def test_probe_and_train_on_the_cpu_device_compute_on_one_thread_and_say_so(write_model, tmp_path, two_threads):
    model = write_model(MODEL)
    result = oomtune.probe(model, batch=4, context=8, device="cpu", budget="64MiB", out=tmp_path / "best.yaml")
    assert seen(tmp_path) == {1}  # every trial's forward
    assert torch.get_num_threads() == 2  # the caller's, back
    assert result.config.found_by.threads == 1 and load_config(tmp_path / "best.yaml").found_by.threads == 1
    assert ("threads: 1 (torch's, on the cpu device: oomtune's choice for small models on shared cores; "
            "OMP_NUM_THREADS sets another)") in result.notes

    notes = []
    train(tmp_path / "best.yaml", overrides={"steps": 2, "run_dir": str(tmp_path / "run")},
          on_event=lambda e: notes.append(getattr(e, "message", "")))
    assert seen(tmp_path) == {1} and torch.get_num_threads() == 2
    assert ("threads: 1 (torch's, on the cpu device: as the plan was probed, found_by.threads; OMP_NUM_THREADS sets "
            "another)") in notes


def test_omp_num_threads_is_the_users_word_and_train_keeps_the_probes_count(write_model, tmp_path, two_threads,
                                                                            monkeypatch):
    """Probed with OMP_NUM_THREADS=2 (torch read it when it started: 2 here); trained without it, the run keeps 2,
    found_by.threads, so its tokens/s mean what the probe's did. A config with no found_by trains on one."""
    model = write_model(MODEL)
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    result = oomtune.probe(model, batch=4, context=8, device="cpu", budget="64MiB", out=tmp_path / "best.yaml")
    assert seen(tmp_path) == {2} and result.config.found_by.threads == 2
    assert "threads: 2 (torch's, on the cpu device: OMP_NUM_THREADS)" in result.notes

    monkeypatch.delenv("OMP_NUM_THREADS")
    torch.set_num_threads(3)
    train(tmp_path / "best.yaml", overrides={"steps": 1, "run_dir": str(tmp_path / "run")})
    assert seen(tmp_path) == {2} and torch.get_num_threads() == 3

    bare = tmp_path / "bare.yaml"
    bare.write_text(yaml.safe_dump({"model": str(model), "plan": {"micro_batch_size": 4, "context_length": 8}}))
    train(bare, device="cpu", overrides={"steps": 1, "run_dir": str(tmp_path / "bare-run")})
    assert seen(tmp_path) == {1} and torch.get_num_threads() == 3
