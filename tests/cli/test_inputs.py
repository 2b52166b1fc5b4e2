"""Bad input on the command line: one line on stderr naming the bad thing, exit 2, checked before anything runs,
and never a file of the user's overwritten. Plus what `--out` keeps of a config that is already there."""

from __future__ import annotations

import errno
import json
import math
import os
import re
import types
from pathlib import Path

import pytest

from oomtune.config.loading import load_config
from oomtune.config.schema import Config, Plan, TrainConfig
from oomtune.config.writing import save_config
from oomtune.errors import ConfigError, OomtuneError
from oomtune.files import NotAFileError

from ..conftest import EXAMPLES, TINY_MODEL, one_line_error, run_cli

ESTIMATE = ("--budget", "400KiB", "--margin", "0")  # the tiny model's ladder on the fake device: a second or two


@pytest.fixture
def no_search(monkeypatch):
    """Fail the test if a probe or an estimate starts searching."""

    def boom(*args, **kwargs):
        raise AssertionError("the search ran")

    import oomtune.search.estimate  # noqa: F401 - imported before the patch, else it would keep `boom` as its probe

    monkeypatch.setattr("oomtune.search.probe.probe", boom)
    monkeypatch.setattr("oomtune.search.estimate.estimate", boom)


# -- 1. --out never overwrites the model file or a file that is not an oomtune config -------------

@pytest.mark.parametrize("command", ["probe", "estimate"])
def test_out_that_is_the_model_file_is_refused(command, write_model, tmp_path, no_search):
    model = write_model()
    before = model.read_text()
    extra = ("--device", "cpu") if command == "probe" else ESTIMATE
    for out in (model, tmp_path / "sub" / ".." / model.name):
        one_line_error(run_cli(command, model, *extra, "-o", out), "--out", "is the model file")
    os.link(model, tmp_path / "hard.py")  # the same file under another name
    one_line_error(run_cli(command, model, *extra, "-o", tmp_path / "hard.py"), "is the model file")
    assert model.read_text() == before


def test_out_that_is_another_file_of_yours_is_refused(write_model, tmp_path, no_search):
    model = write_model()
    for name, text in (("notes.md", "# my notes\n\nnot: [yaml\n"), ("other.py", "import torch\n"),
                       ("data.yaml", "learning_rate: 3\n")):
        f = tmp_path / name
        f.write_text(text)
        one_line_error(run_cli("estimate", model, *ESTIMATE, "--out", f), f"--out {f}", "not an oomtune config",
                       "not overwriting it")
        assert f.read_text() == text
    binary = tmp_path / "weights.yaml"
    binary.write_bytes(b"\x80\x81\xff")
    one_line_error(run_cli("estimate", model, *ESTIMATE, "--out", binary), "not an oomtune config")
    assert binary.read_bytes() == b"\x80\x81\xff"
    theirs = tmp_path / "theirs.yaml"  # another model's config: its plan is not replaced by this model's
    theirs.write_text("model: convnet.py\nplan:\n  micro_batch_size: 4\n  context_length: 8\n")
    before = theirs.read_text()
    one_line_error(run_cli("estimate", model, *ESTIMATE, "--out", theirs),
                   f"--out {theirs} is the config of convnet.py, not model.py")
    assert theirs.read_text() == before
    missing = tmp_path / "nope.py"  # a model file that is not there is that, not a clash with the config's model
    one_line_error(run_cli("estimate", missing, *ESTIMATE, "--out", theirs), f"model file not found: {missing}")
    assert theirs.read_text() == before


# -- 2. an existing config's train: section is kept ----------------------------------------------

def test_rerunning_over_a_config_keeps_its_hand_edited_train_section(write_model, tmp_path):
    model, out = write_model(), tmp_path / "best.yaml"
    first = run_cli("estimate", model, *ESTIMATE, "--batch", "4", "--context", "8", "--out", out)
    assert first.exit_code == 0, first.output
    assert "kept the" not in first.stdout  # nothing was there
    out.write_text(out.read_text().replace("steps: 1000", "steps: 7  # mine: a short run")
                   .replace("seed: 1337", "seed: 5\n  # a comment of my own, kept word for word"))
    r = run_cli("estimate", model, *ESTIMATE, "--batch", "2", "--context", "8", "--out", out)
    assert r.exit_code == 0, r.output
    assert "kept the train: section" in r.stdout
    text = out.read_text()
    assert "steps: 7  # mine: a short run  # optimizer steps\n" in text  # the comments a person added are kept
    assert "\n  # a comment of my own, kept word for word\n" in text
    cfg = load_config(out)
    assert (cfg.train.steps, cfg.train.seed, cfg.train.lr) == (7, 5, TrainConfig().lr)
    assert cfg.plan.global_batch_size == 2 and cfg.found_by.target_batch == 2  # the plan and found_by are new
    j = run_cli("estimate", model, *ESTIMATE, "--batch", "2", "--context", "8", "--out", out, "--json")
    assert json.loads(j.stdout)["kept_train"] is True and load_config(out).train.steps == 7


def test_probe_keeps_the_train_section_too(write_model, tmp_path):
    """device: cpu."""
    model, out = write_model(), tmp_path / "best.yaml"
    args = ("probe", model, "--device", "cpu", "--budget", "4MiB", "--batch", "2", "--context", "4", "--out", out)
    assert run_cli(*args).exit_code == 0
    out.write_text(out.read_text().replace("lr: 0.0003", "lr: 0.001"))
    r = run_cli(*args, "--json")
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["kept_train"] is True and load_config(out).train.lr == 0.001


# -- 3. --out is checked before the search; a failed write is one line ---------------------------

def test_a_bad_out_is_refused_before_anything_runs(write_model, tmp_path, no_search):
    model = write_model()
    (tmp_path / "file").write_text("x")
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    cases = [(tmp_path, "is a folder"), (fifo, "is a named pipe: oomtune writes no file through a link"),
             (tmp_path / "file" / "best.yaml", "is not a folder")]
    if Path("/proc/self").is_dir():
        cases.append((Path("/proc/oomtune-test.yaml"), "cannot write there"))
    for out, why in cases:
        for command, extra in (("probe", ("--device", "cpu")), ("estimate", ESTIMATE)):
            r = run_cli(command, model, *extra, "--out", out)
            one_line_error(r, f"--out {out}", why)
            assert "probing" not in r.stderr
    assert fifo.is_fifo()


def test_out_in_folders_that_do_not_exist_yet_is_fine(write_model, tmp_path):
    model = write_model()
    missing = tmp_path / "new" / "deeper" / "best.yaml"  # written with its folders made
    assert run_cli("estimate", model, *ESTIMATE, "--batch", "2", "--context", "4", "--out", missing).exit_code == 0
    assert load_config(missing).plan.global_batch_size == 2


def test_save_config_never_replaces_a_device_node_or_a_pipe(tmp_path):
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    with pytest.raises(NotAFileError, match="pipe is a named pipe: oomtune writes no file through a link"):
        save_config(Config(model="model.py", plan=Plan(2, 4)), fifo)
    assert fifo.is_fifo()


def test_a_write_that_fails_after_the_search_is_exit_2_one_line(write_model, tmp_path, monkeypatch):
    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr("oomtune.config.writing.atomic_write", full)
    out = tmp_path / "best.yaml"
    r = run_cli("estimate", write_model(), *ESTIMATE, "--batch", "2", "--context", "4", "--out", out, "--json")
    assert r.exit_code == 2 and "Traceback" not in r.output, r.output
    said = r.stderr.strip().splitlines()  # the search's header and trials (stderr, --json too), then one line
    assert [line for line in said if line.startswith("error:")] == said[-1:], r.stderr
    assert "cannot write the config" in said[-1] and "No space left on device" in said[-1]
    assert "No space left on device" in json.loads(r.stdout)["error"]
    assert not out.exists()


# -- 4-6. option checks: steps, plan mode, before anything is loaded -----------------------------

def test_steps_0_is_bad_input(write_model, tmp_path):
    model, config = write_model(), tmp_path / "best.yaml"
    assert run_cli("estimate", model, *ESTIMATE, "--batch", "2", "--context", "4", "--out", config).exit_code == 0
    one_line_error(run_cli("check", "--config", config, "--steps", "0"), "--steps must be at least 2")
    one_line_error(run_cli("estimate", EXAMPLES / "tiny_gpt.py", "--budget", "1GiB", "--micro-batch", "4",
                           "--context", "64", "--steps", "0"), "--steps must be at least 2")
    one_line_error(run_cli("estimate", model, *ESTIMATE, "--steps", "0"), "--steps must be at least 2")


@pytest.mark.parametrize("args, needle", [
    (("--headroom", "-1"), "--headroom must be in [0, 1)"),
    (("--headroom", "1.5"), "--headroom must be in [0, 1)"),
    (("--headroom", "nan"), "--headroom must be in [0, 1)"),
    (("--grad-accum", "0"), "--grad-accum must be at least 1"),
    (("--micro-batch", "0"), "--micro-batch must be at least 1"),
    (("--amp", "fp8"), "--amp 'fp8'"),
    (("--objective", "throughput"), "--objective throughput"),
    (("--objective", "speed"), "--objective 'speed'"),
    (("--precision", "fp8"), "--precision 'fp8'"),
])
def test_plan_mode_checks_the_same_options_as_the_ladder(args, needle, write_model):
    r = run_cli("estimate", write_model(), "--budget", "1GiB", "--micro-batch", "2", "--context", "4", *args)
    one_line_error(r, needle)


@pytest.mark.parametrize("args, needle", [
    (("--headroom", "2"), "--headroom must be in [0, 1)"),
    (("--steps", "0"), "--steps must be at least 2"),
    (("--objective", "speed"), "--objective 'speed'"),
    (("--amp", "fp8"), "--amp 'fp8'"),
])
def test_probe_checks_its_options_before_loading_anything(args, needle, tmp_path, monkeypatch):
    def no_load(*a, **k):
        raise AssertionError("the model file was loaded")

    monkeypatch.setattr("oomtune.model_file.load_model_file", no_load)
    r = run_cli("probe", tmp_path / "model.py", "--device", "cpu", "--out", tmp_path / "best.yaml", *args)
    one_line_error(r, needle)
    assert "probing" not in r.stderr


def test_probe_on_the_fake_device_without_a_budget_names_options_that_exist(write_model, tmp_path):
    r = run_cli("probe", write_model(), "--device", "fake", "--out", tmp_path / "best.yaml")
    one_line_error(r, "--device fake has no memory of its own", "--budget", "--gpu NAME")
    assert not (tmp_path / "best.yaml").exists()
    # --gpu is the simulated devices' (a card to account like); the real GPU is a card already
    one_line_error(run_cli("probe", write_model(), "--device", "cuda", "--gpu", "a100-80", "--out",
                           tmp_path / "c.yaml"), "--gpu a100-80 is for the simulated devices")


def test_check_refuses_a_margin_its_device_would_ignore(write_model, tmp_path):
    model, config = write_model(), tmp_path / "best.yaml"
    assert run_cli("estimate", model, *ESTIMATE, "--batch", "2", "--context", "4", "--out", config).exit_code == 0
    one_line_error(run_cli("check", "--config", config, "--device", "cuda", "--margin", "1GiB"),
                   "--margin applies to the simulated devices (--device fake or cpu), not cuda")
    assert run_cli("check", "--config", config, "--device", "fake", "--margin", "0").exit_code == 0


# -- 7. a bad value is blamed on where it came from ----------------------------------------------

def test_a_config_value_is_not_blamed_on_a_flag(write_model, tmp_path):
    model, config = write_model(), tmp_path / "best.yaml"
    assert run_cli("estimate", model, *ESTIMATE, "--batch", "2", "--context", "4", "--out", config).exit_code == 0
    config.write_text(config.read_text().replace("headroom: 0.1", "headroom: 1.5"))
    r = run_cli("check", "--config", config)
    one_line_error(r, "found_by.headroom must be in [0, 1), got 1.5")
    assert "--headroom" not in r.stderr
    assert run_cli("check", "--config", config, "--headroom", "0.1").exit_code == 0  # the flag overrides it


def test_a_defaults_min_context_is_not_blamed_on_a_flag(write_model, no_search):
    from ..conftest import TINY_MODEL

    model = write_model(TINY_MODEL + '\nDEFAULTS = {"context": 32, "min_context": 16}\n')
    for command, extra in (("probe", ("--device", "cpu")), ("estimate", ESTIMATE)):
        r = run_cli(command, model, *extra, "--context", "8")
        one_line_error(r, "model.py DEFAULTS['min_context'] 16 is longer than --context 8",
                       "give --min-context 8 or less")
    one_line_error(run_cli("estimate", model, *ESTIMATE, "--min-context", "64"),
                   "--min-context 64 is longer than model.py DEFAULTS['context'] 32")


@pytest.mark.parametrize("key", ["lr", "min_lr", "weight_decay", "clip_grad_norm"])
@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf])
def test_train_numbers_must_be_finite(key, value):
    with pytest.raises(ConfigError, match=f"train.{key} must be a finite number"):
        TrainConfig(**{key: value})


@pytest.mark.parametrize("values, needle", [
    ({"clip_grad_norm": -1.0}, "train.clip_grad_norm must be > 0, or null"),  # would flip every gradient
    ({"clip_grad_norm": 0.0}, "train.clip_grad_norm must be > 0, or null"),  # would zero them
    ({"weight_decay": -0.1}, "train.weight_decay must be 0 or more"),
    ({"lr": 1e-3, "min_lr": 1e-2}, "train.min_lr (0.01) must not be above train.lr (0.001)"),
    ({"run_dir": " "}, "train.run_dir must not be empty"),
])
def test_train_values_that_would_wreck_a_run_are_refused(values, needle):
    with pytest.raises(ConfigError, match=re.escape(needle)):
        TrainConfig(**values)


def test_a_bad_train_flag_is_one_line_naming_the_flag(write_model, tmp_path):
    model, config = write_model(), tmp_path / "best.yaml"
    assert run_cli("estimate", model, *ESTIMATE, "--batch", "2", "--context", "4", "--out", config).exit_code == 0
    r = run_cli("train", "--config", config, "--clip-grad-norm=-1", "--run-dir", tmp_path / "run")
    one_line_error(r, "--clip-grad-norm must be > 0")
    assert not (tmp_path / "run").exists()
    assert TrainConfig(clip_grad_norm=None).clip_grad_norm is None and TrainConfig(weight_decay=0).weight_decay == 0
    # a rule between a flag and a setting not given names the setting where its value came from (the config), not
    # as a flag the user never passed ("--min-lr (3e-05) must not be above --lr (1e-05)")
    r = run_cli("train", "--config", config, "--lr", "1e-5", "--run-dir", tmp_path / "run")
    one_line_error(r, "train.min_lr (3e-05) must not be above --lr (1e-05)")


def test_a_nan_in_the_yaml_is_one_line(write_model, tmp_path):
    model, config = write_model(), tmp_path / "best.yaml"
    assert run_cli("estimate", model, *ESTIMATE, "--batch", "2", "--context", "4", "--out", config).exit_code == 0
    config.write_text(config.read_text().replace("lr: 0.0003", "lr: .nan"))
    one_line_error(run_cli("check", "--config", config), "train.lr must be a finite number")


# -- 8. check --device cuda: the config's budget, lowered to what is free now --------------------

class StubGpu:
    """Stands in for CudaDevice: its budget is what is free unless one is given (more than free is refused)."""

    kind = "cuda"
    computes = True

    def __init__(self, free: int, budget: str | None):
        self.free_bytes = free
        self.budget_bytes = int(budget) if budget else free
        if self.budget_bytes > free:
            raise OomtuneError(f"--budget {self.budget_bytes} is more than the {free} free")

    def lower_budget(self, budget_bytes: int) -> None:
        self.budget_bytes = min(self.budget_bytes, budget_bytes)


@pytest.mark.parametrize("free_delta, clamped", [(-(1 << 20), True), (1 << 20, False)])
def test_check_on_cuda_uses_at_most_the_memory_free_now(free_delta, clamped, write_model, tmp_path, monkeypatch):
    model, config = write_model(), tmp_path / "best.yaml"
    assert run_cli("estimate", model, "--budget", "64MiB", "--margin", "0", "--batch", "2", "--context", "4",
                   "--out", config).exit_code == 0
    old_budget = load_config(config).found_by.budget_bytes
    free = old_budget + free_delta
    monkeypatch.setattr("oomtune.search.check.make_device", lambda kind, budget=None: StubGpu(free, budget))
    monkeypatch.setattr("oomtune.search.check.run_trial", lambda *a, **k: types.SimpleNamespace(
        oom=False, peak_bytes=1 << 20, oom_message=None))
    r = run_cli("check", "--config", config, "--device", "cuda", "--json")
    assert r.exit_code == 0, r.output
    data = json.loads(r.stdout)
    assert data["device"] == "cuda"
    assert data["budget_bytes"] == min(free, old_budget)
    assert data["limit_bytes"] == int(min(free, old_budget) * 0.9)
    assert data["budget_clamped_from_bytes"] == (old_budget if clamped else None)
    text = run_cli("check", "--config", config, "--device", "cuda")
    assert ("budget lowered" in text.stdout) is clamped
    if clamped:  # a --budget given is the user's: more than is free stays an error
        one_line_error(run_cli("check", "--config", config, "--device", "cuda", "--budget", str(old_budget)),
                       "more than")


# -- 9. a Ctrl-C Python dropped (it landed in a finalizer) still stops the search, and nothing is written ------

@pytest.mark.parametrize("command", ["estimate", "probe"])
@pytest.mark.parametrize("as_json", [False, True])
def test_a_swallowed_ctrl_c_stops_the_search_and_writes_no_config(command, as_json, write_model, tmp_path,
                                                                 monkeypatch, request):
    import signal

    import oomtune.search.estimate
    import oomtune.search.probe

    real = {"estimate": oomtune.search.estimate.estimate, "probe": oomtune.search.probe.probe}[command]

    def swallowed_then_search(*args, **kwargs):
        try:  # what Python does to a KeyboardInterrupt raised inside a __del__: print it, carry on
            signal.getsignal(signal.SIGINT)(signal.SIGINT, None)
        except KeyboardInterrupt:
            pass
        return real(*args, **kwargs)

    monkeypatch.setattr(f"oomtune.search.{command}.{command}", swallowed_then_search)
    # a terminal's Ctrl-C handler: a suite started in the background (`make test &`) inherits SIGINT ignored
    ignored = signal.signal(signal.SIGINT, signal.default_int_handler)
    request.addfinalizer(lambda: signal.signal(signal.SIGINT, ignored))
    out = tmp_path / "best.yaml"
    extra = ESTIMATE if command == "estimate" else ("--device", "cpu", "--budget", "64MiB")
    r = run_cli(command, write_model(), *extra, "--batch", "2", "--context", "4", "--out", out,
                *(["--json"] if as_json else []))
    assert r.exit_code == 130, r.output
    assert "interrupted" in r.stderr and "Traceback" not in r.output
    assert not out.exists()
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # the command put Python's back


def test_debug_adds_the_traceback_and_keeps_the_exit_code(tmp_path, write_model):
    """--debug shows where an error came from, and exits as without it: 2 for bad input (a CI script with --debug
    on must not read a missing config as "does not fit"), 1 for anything else."""
    missing = run_cli("check", "--config", tmp_path / "nope.yaml", "--debug")
    assert missing.exit_code == 2 and "Traceback" in missing.stderr, missing.output
    assert missing.stderr.strip().splitlines()[-1] == f"error: config file not found: {tmp_path / 'nope.yaml'}"
    broken = write_model(TINY_MODEL.replace("    return Net()", "    raise ValueError('no')"))
    r = run_cli("probe", broken, "--device", "cpu", "--budget", "8MiB", "--out", tmp_path / "b.yaml", "--debug")
    assert r.exit_code == 2 and "Traceback" in r.stderr and "ValueError: no" in r.stderr, r.output


def test_version_and_a_reader_that_leaves_early():
    """`oomtune --version` prints the version; `oomtune estimate ... | head -1` (the reader gone before the tables
    are written) stops quietly with the code a program SIGPIPE ended gets, 141 (it was 1: "does not fit")."""
    import subprocess
    import sys

    from oomtune import __version__

    r = run_cli("--version")
    assert r.exit_code == 0 and r.stdout.strip() == f"oomtune {__version__}", r.output
    p = subprocess.Popen([sys.executable, "-m", "oomtune", "estimate", str(EXAMPLES / "tiny_gpt.py"), *ESTIMATE],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, env={**os.environ, "OMP_NUM_THREADS": "1"})
    p.stdout.close()  # before the first table: its write meets a closed pipe
    _, stderr = p.communicate(timeout=120)
    assert p.returncode == 141 and b"Error" not in stderr and b"error" not in stderr, stderr.decode()[-2000:]


def test_json_output_names_the_error_on_stdout(tmp_path, write_model):
    """With --json a script parses stdout: bad input puts {"error", "exit_code"} there too (it left stdout empty),
    and the one line on stderr as always."""
    broken = write_model("def build_model(:\n")
    r = run_cli("probe", broken, "--device", "cpu", "--budget", "8MiB", "--out", tmp_path / "x.yaml", "--json")
    assert r.exit_code == 2, r.output
    assert json.loads(r.stdout) == {"error": "model.py: syntax error at line 1: invalid syntax", "exit_code": 2}
    assert r.stderr.strip() == "error: model.py: syntax error at line 1: invalid syntax"
