"""--device auto without a GPU says what budget it took; --json keeps stdout for the JSON alone."""

from __future__ import annotations

import json

import pytest

from ..conftest import EXAMPLES, TINY_MODEL, run_cli

ESTIMATE = ("--budget", "400KiB", "--margin", "0")  # the tiny model's ladder on the fake device: a second or two


# -- 1. --device auto on a machine without a GPU says the budget is its RAM, and how to get a GPU's plan ------------

@pytest.mark.parametrize("extra", [(), ("--device", "cpu"), ("--budget", "64MiB"), ("--gpu", "t4")])
def test_auto_without_a_gpu_says_the_budget_is_the_machines_ram(extra, write_model, tmp_path, monkeypatch):
    """device: cpu (what auto picks here; torch.cuda.is_available made False where the tests run on a GPU)."""
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    r = run_cli("probe", write_model(), "--batch", "2", "--context", "4", "--out", tmp_path / "best.yaml", *extra)
    assert r.exit_code == 0, r.output
    said = " ".join(r.stderr.split())
    assert ("no GPU found: probing the CPU in this machine's free RAM" in said) is (extra == ()), said
    if extra == ():
        assert "--gpu NAME" in said and "oomtune estimate --gpu NAME" in said


# -- 2. --json: what the model file prints goes to stderr, so stdout parses -----------------------------------

def test_a_model_file_that_prints_leaves_json_stdout_parseable(write_model, tmp_path):
    model = write_model("print('building the model...')\n" + TINY_MODEL.replace(
        "    return Net()", "    print('layers: 2')\n    return Net()"))
    out = tmp_path / "best.yaml"
    for args in (("estimate", model, *ESTIMATE, "--batch", "2", "--context", "4", "--out", out),
                 ("probe", model, "--device", "cpu", "--budget", "64MiB", "--batch", "2", "--context", "4",
                  "--out", out),
                 ("check", "--config", out)):
        r = run_cli(*args, "--json")
        assert r.exit_code == 0, r.output
        assert "fits" in json.loads(r.stdout) and "layers: 2" in r.stderr


@pytest.mark.parametrize("args, message", [
    (("check", "--config", "best.yaml", "--json", "--bugdet", "1GiB"), "No such option: --bugdet"),
    (("check", "--json"), "Missing option '--config'"),
    (("probe", str(EXAMPLES / "tiny_gpt.py"), "--batch", "abc", "--json"), "Invalid value for '--batch'"),
])
def test_a_command_line_that_does_not_parse_is_one_line_and_json_under_json(args, message):
    """A typo in an option or a value of the wrong type is bad input like any other: one line naming it and the
    command's --help, exit 2, and under --json the error on stdout (a boxed usage screen and an empty stdout broke
    the CI recipe `check --json > memory.json`)."""
    r = run_cli(*args)
    assert r.exit_code == 2, r.output
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: {message}") and "--help`)" in lines[0], r.stderr
    report = json.loads(r.stdout)
    assert report["exit_code"] == 2 and report["error"].startswith(message)


def test_json_given_to_a_command_without_it_is_the_one_error_and_no_json():
    """train has no --json: its usage error names --json itself, on stderr alone (no JSON a script would read)."""
    r = run_cli("train", "--config", "best.yaml", "--json")
    assert r.exit_code == 2 and r.stdout == "", r.output
    assert r.stderr.strip().startswith("error: No such option: --json")
