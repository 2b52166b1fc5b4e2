"""Hostile and broken input is one line and exit 2 (issue 39): YAML aliases and deep nesting, numbers no device or
shape can hold, a NUL byte in a path, an error that would echo megabytes, and --json's stdout holding the JSON alone
whatever the command line or the model file does. In-process CLI on the `fake` device, except where a real process
is the point (file descriptor 1, a thread left running): those run `python -m oomtune`."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest
import yaml

from ..conftest import TINY_MODEL, one_line_error, run_cli

HUGE = "9" * 401

ALIAS_BOMB = """\
model: model.py
plan: {micro_batch_size: 1, context_length: 1}
train:
  run_dir: &a [x, x, x, x, x, x, x, x, x]
  lr: &b [*a, *a, *a, *a, *a, *a, *a, *a, *a]
"""


@pytest.fixture
def config(tmp_path, write_model):
    """A config an estimate wrote (the fake device), next to its model file."""
    model = write_model()
    out = tmp_path / "best.yaml"
    r = run_cli("estimate", model, "--budget", "2GiB", "--batch", "2", "--context", "4", "--out", out)
    assert r.exit_code == 0, r.output
    return out


def _commands(cfg, model):
    return [("check", "--config", cfg), ("train", "--config", cfg, "--device", "cpu"),
            ("export", "--config", cfg, "--to", "hf"), ("estimate", model, "--budget", "2GiB", "--out", cfg)]


@pytest.mark.parametrize("kind", ["aliases", "nesting"])
def test_an_alias_bomb_or_deep_nesting_is_one_short_line_in_every_command_that_reads_a_config(config, tmp_path, kind):
    """A 482-byte file of nested aliases made a 351 MB error line (77 s, 2.6 GB RSS); 20,000 nested lists were a
    RecursionError (exit 1). Both are refused by the loader, before anything is built."""
    bad = tmp_path / "bad.yaml"
    bad.write_text(ALIAS_BOMB if kind == "aliases" else "model: model.py\nplan: " + "[" * 20000 + "]" * 20000 + "\n")
    before = bad.read_bytes()
    for args in _commands(bad, tmp_path / "model.py"):
        start = time.perf_counter()
        r = run_cli(*args)
        assert time.perf_counter() - start < 30, args  # (not a cost bound: a bomb would take minutes and GBs)
        want = ("an alias (*a) repeats another node" if kind == "aliases" else "collections nested more than 50 deep")
        if args[0] == "estimate":  # --out: an existing file that is no config it can read is not replaced
            one_line_error(r, f"--out {bad} exists and is not an oomtune config", want)
        else:
            one_line_error(r, f"{bad}: not valid YAML at line", want)
        assert len(r.stderr) < 400
    assert bad.read_bytes() == before


def test_numbers_no_device_or_shape_holds_are_one_line(config, tmp_path):
    """A 401-digit --budget was an OverflowError (exit 1); a 401-digit --steps ran for ever; a huge --batch failed
    inside torch, blamed on the model file. Each is refused with the value cut short."""
    model = tmp_path / "model.py"
    cut = "(a 401-digit number)"
    cases = [
        (("estimate", model, "--budget", HUGE), "more than any device holds (at most 1 EiB)"),
        (("probe", model, "--device", "cpu", "--budget", HUGE), "more than any device holds"),
        (("check", "--config", config, "--budget", HUGE), "more than any device holds"),
        (("estimate", model, "--budget", "1GiB", "--margin", HUGE), "--margin '999"),
        (("estimate", model, "--budget", "1GiB", "--batch", HUGE), "--batch must be at most 2,147,483,647, got 9"),
        (("estimate", model, "--budget", "1GiB", "--context", HUGE), "--context must be at most 2,147,483,647"),
        (("estimate", model, "--budget", "1GiB", "--steps", HUGE), "--steps must be at most 2,147,483,647"),
        (("estimate", model, "--budget", "1GiB", "--micro-batch", HUGE), "--micro-batch must be at most"),
        (("train", "--config", config, "--device", "cpu", "--steps", HUGE), "--steps must be at most 2,147,483,647"),
    ]
    for args, needle in cases:
        r = run_cli(*args)
        one_line_error(r, needle, cut if "must be at most" in needle else "(403 characters)")
        assert len(r.stderr) < 300, r.stderr


def test_a_nul_byte_or_a_huge_number_in_the_yaml_is_one_line(config, tmp_path):
    data = yaml.safe_load(config.read_text())
    for section, key, value, needle in (("train", "run_dir", "runs\0x", "train.run_dir must not hold a NUL byte"),
                                        ("plan", "micro_batch_size", int(HUGE), "plan.micro_batch_size: 999"),
                                        ("train", "steps", 2**40, "train.steps must be at most 2,147,483,647"),
                                        ("train", "lr", int(HUGE), "train.lr must be a finite number")):
        bad = tmp_path / f"{key}.yaml"
        bad.write_text(yaml.safe_dump({**data, section: {**data[section], key: value}}))
        one_line_error(run_cli("train", "--config", bad, "--device", "cpu"), needle)


def test_no_error_line_is_longer_than_the_cap(monkeypatch):
    """However long the message a check builds (a value echoed back), the line printed is cut, saying so."""
    from oomtune.cli.guard import user_errors
    from oomtune.errors import MAX_MESSAGE, OomtuneError

    printed = []
    monkeypatch.setattr("oomtune.cli.guard.err.print", lambda text, **k: printed.append(text))
    with pytest.raises(Exception, match="2"), user_errors(debug=False):
        raise OomtuneError("x" * 10_000_000)
    (line,) = printed
    assert len(line) < MAX_MESSAGE + 100 and line.endswith("... (9,998,000 more characters cut)")


def test_an_option_missing_its_value_under_json_is_json_naming_the_command(tmp_path, write_model):
    """`oomtune estimate m.py --json --budget` printed nothing on stdout: the error came before the command
    parsed, and the check for --json looked at the group's options."""
    r = run_cli("estimate", write_model(), "--json", "--budget")
    assert r.exit_code == 2
    assert json.loads(r.stdout) == {"error": "Option '--budget' requires an argument. (see `oomtune estimate "
                                             "--help`)", "exit_code": 2}


NOISY = TINY_MODEL + '''
import logging, os, subprocess, sys
os.write(1, b"fd 1 at import\\n")
sys.__stdout__.write("sys.__stdout__ at import\\n")
sys.__stdout__.flush()
subprocess.run([sys.executable, "-c", "print('a child process')"])
logging.basicConfig(stream=sys.__stdout__, level=logging.INFO, force=True)
logging.getLogger("noisy").info("a log line")
_build = build_model

def build_model():
    os.write(1, b"fd 1 in build_model\\n")
    print("print in build_model")
    return _build()
'''


def _oomtune(*args, cwd, timeout=300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "oomtune", *map(str, args)], cwd=cwd, capture_output=True,
                          text=True, timeout=timeout)


def test_json_stdout_holds_the_json_alone_whatever_the_model_file_writes_to_descriptor_1(tmp_path, write_model):
    """os.write(1), sys.__stdout__, a child process and a logging handler on sys.__stdout__ went to stdout around
    the JSON (only sys.stdout was redirected): file descriptor 1 itself points at stderr while the command runs."""
    model = write_model(NOISY)
    done = _oomtune("estimate", model, "--budget", "2GiB", "--batch", "2", "--context", "4", "--json",
                    "--out", tmp_path / "best.yaml", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["fits"] is True
    for said in ("fd 1 at import", "sys.__stdout__ at import", "a child process", "a log line", "fd 1 in build_model",
                 "print in build_model"):
        assert said in done.stderr


def test_a_thread_the_model_file_left_running_does_not_keep_the_command_alive(tmp_path, write_model):
    """A non-daemon thread started at import: probe wrote its config, then Python waited for the thread at exit,
    for ever (a CI job hung). The command ends with its own exit code and names the thread."""
    model = write_model(TINY_MODEL + "\nimport threading, time\nthreading.Thread(target=time.sleep, args=(3600,), "
                                     "name='poller').start()\n")
    done = _oomtune("estimate", model, "--budget", "2GiB", "--batch", "2", "--context", "4", "--out",
                    tmp_path / "best.yaml", cwd=tmp_path, timeout=120)
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "best.yaml").is_file()
    assert "the model file left 1 thread(s) running ('poller')" in " ".join(done.stderr.split())


LEAKY = TINY_MODEL + '''
KEPT = []
_make = make_batch

def make_batch(batch_size, context_length, device):
    batch = _make(batch_size, context_length, device)
    KEPT.append(batch)  # kept "for later": every trial's batches stay alive
    return batch
'''


def test_a_model_file_that_keeps_tensors_from_trial_to_trial_is_named(tmp_path, write_model):
    """Each trial's peak counted every batch the trials before it kept, and the probe planned accumulation for a
    model that fits whole ("needs gradient accumulation ... lower --batch"). The leftovers are measured after each
    trial: growing past 1% of the limit, one line and exit 2. The cpu device."""
    r = run_cli("probe", write_model(LEAKY), "--device", "cpu", "--budget", "4MiB", "--batch", "64", "--context",
                "256", "--out", tmp_path / "best.yaml")
    assert r.exit_code == 2, r.output
    line = r.stderr.strip().splitlines()[-1]
    assert line.startswith("error: model.py keeps tensors alive from one trial to the next: trial 1 left 1.00 MiB")
    assert "(a module-level list the step or make_batch appends to?)" in line
    assert not (tmp_path / "best.yaml").exists()
    clean = run_cli("probe", write_model(), "--device", "cpu", "--budget", "4MiB", "--batch", "64", "--context",
                    "256", "--out", tmp_path / "best.yaml")
    assert clean.exit_code == 0 and "keeps tensors" not in clean.output


def test_what_the_model_file_prints_in_every_trial_is_shown_once(tmp_path, write_model):
    """A print in build_model came out once a trial (17 times in one probe): each distinct line once now, and a
    line saying how many were left out."""
    model = write_model(TINY_MODEL + "\n_build = build_model\n\ndef build_model():\n    print('building the net')\n"
                                     "    return _build()\n")
    r = run_cli("probe", model, "--device", "cpu", "--budget", "1MiB", "--batch", "64", "--context", "64",
                "--out", tmp_path / "best.yaml")
    assert r.exit_code == 0, r.output
    assert r.stdout.count("building the net") == 1
    trials = len(yaml.safe_load((tmp_path / "best.yaml").read_text())["found_by"]["trials"])
    assert trials > 3 and "line(s) again, one trial after another: each is shown once" in " ".join(r.stderr.split())


def test_the_leak_watch_counts_growth_not_torchs_bookkeeping_nor_a_one_time_cache():
    """On 2 ranks of the cpu device, FSDP's probe was refused: trials 2-5 left 512 B each (torch's, around the
    collectives) and trial 6, FSDP's first, 256 KiB once. A batch kept every trial is still named. No device."""
    from oomtune.errors import ModelFileError
    from oomtune.search.leaks import LeakWatch

    ranks = LeakWatch("wide.py", 4 << 20)
    for left in (0, 512, 512, 512, 512, 256 << 10, 0, 0):
        ranks.after(left)
    assert ranks.note() is None
    leaky = LeakWatch("model.py", 4 << 20)
    leaky.after(1 << 20)
    with pytest.raises(ModelFileError, match="trial 1 left 1.00 MiB, trial 2 left 1.00 MiB"):
        leaky.after(1 << 20)
