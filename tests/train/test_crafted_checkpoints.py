"""A checkpoint made or edited by hand is one line naming the file and the field, exit 2, and the file is left as it
was; a full disk during a run is one line naming the file it could not write (issue 39). The `cpu` device, the
tiny model of tests/train/cases.py."""

from __future__ import annotations

import errno
import os

import pytest
import torch

from .cases import error_line, train

CRAFTED = {  # field edit -> what the line says
    "a data batch of 0": (lambda s: s["data"].update(batch_size=0),
                          "its data position's batch_size is not a whole number of 1 or more: 0"),
    "an empty RNG state": (lambda s: s.update(rng={}), "its RNG state has no 'torch' entry"),
    "a torch RNG state that is text": (lambda s: s["rng"].update(torch="abc"),
                                       "its RNG state's 'torch' entry is not a uint8 tensor"),
    "a Python RNG state that is a number": (lambda s: s["rng"].update(python=5),
                                            "its RNG state's 'python' entry is not [version, 625 numbers, gauss]"),
    "a negative step": (lambda s: s.update(step=-3), "its step is not a whole number of 0 or more: -3"),
    "a step that is text": (lambda s: s.update(step="x"), "its step is not a whole number of 0 or more: 'x'"),
    "a plan that is a list": (lambda s: s.update(plan=[1]), "its plan is list, not a mapping"),
    "no data position": (lambda s: s.update(data=None), "its data position is NoneType, not a mapping"),
    "a negative data position": (lambda s: s["data"].update(batches=-1),
                                 "its data position's batches is not a whole number of 0 or more: -1"),
    "an optimizer state that is none": (lambda s: s.update(optimizer={"state": 1}),
                                        "its optimizer state is not an optimizer's state_dict"),
    "a scaler state that is a number": (lambda s: s.update(scaler=7), "its scaler state is int, not a mapping"),
}


@pytest.mark.parametrize("what", list(CRAFTED))
def test_a_crafted_checkpoint_is_one_line_naming_it_and_is_left_as_it_was(case_dir, what):
    """Today's bare ZeroDivisionError, KeyError and TypeError (exit 1) from deep in the resume, or a resume that went
    on from a negative data position: refused when the checkpoint is read, before the model is built."""
    assert train("--steps", "3").exit_code == 0
    path = case_dir / "run" / "ckpt-00000003.pt"
    state = torch.load(path, weights_only=True)
    edit, said = CRAFTED[what]
    edit(state)
    torch.save(state, path)
    before = {p.name: p.read_bytes() for p in (case_dir / "run").iterdir()}
    result = train("--resume", "--steps", "4")
    assert result.exit_code == 2, result.stderr
    assert error_line(result).startswith(f"error: checkpoint run/ckpt-00000003.pt is not one oomtune wrote: {said}")
    assert {p.name: p.read_bytes() for p in (case_dir / "run").iterdir()} == before


class _Full:
    """A file whose writes meet a full disk."""

    def __init__(self, f):
        self.f = f

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.f.close()

    def write(self, data):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    def flush(self):
        pass

    def fileno(self):
        return self.f.fileno()


@pytest.mark.parametrize("resume", [False, True])
def test_a_full_disk_is_one_line_naming_the_file_and_the_checkpoints_stay(case_dir, monkeypatch, resume):
    """Every file a run writes goes through files.atomic_write and files.append_line: with the disk full from the
    start, the first write (the start event; on a resume, the metrics cut back to the checkpoint) is one line naming
    it. A resume's bare OSError came from rewriting metrics.jsonl."""
    if resume:
        assert train("--steps", "3").exit_code == 0
    run = case_dir / "run"
    before = {p.name: p.read_bytes() for p in run.iterdir()} if resume else {}
    real = os.fdopen
    monkeypatch.setattr("oomtune.files.os.fdopen", lambda fd, *a, **k: _Full(real(fd, *a, **k)))
    result = train("--resume", "--steps", "5") if resume else train("--steps", "2")
    assert result.exit_code == 1, result.stderr
    name = "metrics.jsonl" if resume else "events.jsonl"
    assert error_line(result) == f"error: could not write run/{name}: no space left on device"
    if resume:
        assert {p.name: p.read_bytes() for p in run.iterdir()} == before
