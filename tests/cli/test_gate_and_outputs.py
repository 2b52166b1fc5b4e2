"""The CI gate and what the commands write: --steps reads a peak beside the optimizer state, --out names a file,
check notes a config found with other releases, and a config's recorded peak is checked. Device: fake (estimate,
check), cpu (probe)."""

from __future__ import annotations

import json

import pytest

from ..conftest import one_line_error, run_cli

ESTIMATE = ("--budget", "400KiB", "--margin", "0", "--batch", "2", "--context", "4")


@pytest.fixture
def config(write_model, tmp_path):
    """An estimate's config of the tests' tiny model (fake device)."""
    out = tmp_path / "best.yaml"
    r = run_cli("estimate", write_model(), *ESTIMATE, "--out", out)
    assert r.exit_code == 0, r.output
    return out


def test_one_step_is_refused_it_reads_the_peak_without_the_optimizer_state(config, write_model, tmp_path):
    """A plan that fits with one step's peak and not with the second's passed `check --steps 1`."""
    from oomtune.config.loading import load_config
    from oomtune.memory.devices import CpuDevice
    from oomtune.model_file import load_model_file
    from oomtune.search.trial import run_trial

    plan = load_config(config).plan
    model = load_model_file(write_model())
    one, two = (run_trial(model, plan, CpuDevice("1GiB"), steps=s).peak_bytes for s in (1, 2))
    assert one < two  # (the AdamW state: two moments a weight)
    for args in (("check", "--config", config), ("estimate", write_model(), *ESTIMATE),
                 ("probe", write_model(), "--device", "cpu", "--budget", "64MiB")):
        one_line_error(run_cli(*args, "--steps", "1"), "--steps must be at least 2", "got 1")


def test_out_dash_and_a_what_ifs_out_are_refused_and_write_nothing(write_model, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    for args in (("estimate", write_model(), *ESTIMATE), ("probe", write_model(), "--device", "cpu", "--budget",
                                                           "64MiB", "--batch", "2", "--context", "4")):
        one_line_error(run_cli(*args, "--out", "-"), "--out -: the config is written to a file")
    r = run_cli("estimate", write_model(), "--budget", "400KiB", "--micro-batch", "2", "--context", "4", "--out",
                "what.yaml")
    one_line_error(r, "--out what.yaml: with --micro-batch, estimate writes no config")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.py"]
    plain = run_cli("estimate", write_model(), "--budget", "400KiB", "--margin", "0", "--micro-batch", "2",
                    "--context", "4")
    assert plain.exit_code == 0 and not (tmp_path / "best.yaml").exists(), plain.output


@pytest.mark.parametrize("recorded, noted", [("2.5.1+cu124", True), (None, False)])
def test_check_notes_a_config_found_with_another_torch_release(recorded, noted, config):
    """Only the release counts: a config probed with the CUDA build of this torch, checked with the CPU build, is
    the same torch."""
    import torch

    text = config.read_text()
    ours = str(torch.__version__)
    same_release = ours.split("+")[0] + "+cu128"
    assert f"torch_version: {ours}" in text
    config.write_text(text.replace(f"torch_version: {ours}", f"torch_version: {recorded or same_release}"))
    r = run_cli("check", "--config", config, "--json")
    assert r.exit_code == 0, r.output
    notes = json.loads(r.stdout)["notes"]
    said = [n for n in notes if n.startswith("the config was found with torch")]
    assert bool(said) is noted, notes
    if noted:
        assert said == [f"the config was found with torch 2.5.1+cu124 (now {ours}): where the peak moved, the "
                        "versions may have moved it, not the model"]


def test_a_negative_recorded_peak_is_bad_input(config):
    text = config.read_text()
    peak = next(line for line in text.splitlines() if line.startswith("  peak_bytes: "))
    config.write_text(text.replace(peak, "  peak_bytes: -5"))
    one_line_error(run_cli("check", "--config", config), "found_by.peak_bytes must be 0 or more, got -5")


def test_real_tensors_stop_at_the_machines_ram_not_at_a_larger_budget(write_model, tmp_path, monkeypatch):
    """device: cpu, its budget (1 GiB) more than the RAM free (made 40 MiB here): the trial that reaches 90% of
    that stops the command with one line, instead of swapping or being killed; it is not the card's OOM."""
    import oomtune.memory.tracker as tracker

    monkeypatch.setattr(tracker, "system_memory", lambda: (64 << 20, 40 << 20))
    model = write_model(TINY_WIDE)
    r = run_cli("probe", model, "--device", "cpu", "--budget", "1GiB", "--batch", "64", "--context", "256",
                "--out", tmp_path / "best.yaml")
    assert r.exit_code == 2 and "Traceback" not in r.output, r.output
    assert r.stderr.strip().splitlines()[-1] == (
        "error: the cpu device's tensors are real and in this machine's RAM: they reached 64.00 MiB, most of the RAM "
        "that was free, before the budget (1.00 GiB): give a --budget of at most 36.00 MiB, or run `oomtune probe` "
        "on the GPU")
    assert not (tmp_path / "best.yaml").exists()
    monkeypatch.setattr(tracker, "system_memory", lambda: (64 << 30, 40 << 30))  # the RAM is there: it runs
    assert run_cli("probe", model, "--device", "cpu", "--budget", "1GiB", "--batch", "64", "--context", "256",
                   "--out", tmp_path / "best.yaml").exit_code == 0


TINY_WIDE = """
import torch
from torch import nn

def build_model():
    return nn.Linear(1024, 1)

def make_batch(batch_size, context_length, device):
    return torch.randn(batch_size, context_length, 1024, device=device)  # 1 MiB a sequence of 256

def loss(model, batch):
    return model(batch).square().mean()
"""


def test_an_error_in_the_model_names_the_trial_that_met_it(write_model, tmp_path):
    """device: cpu. A context past the model's 32 positions: the error says which sizes broke it."""
    model = write_model(TINY_WIDE.replace("def make_batch", "POSITIONS = 32\n\ndef make_batch").replace(
        "return model(batch).square().mean()",
        "assert batch.shape[1] <= POSITIONS, 'past the position table'\n    return model(batch).square().mean()"))
    r = run_cli("probe", model, "--device", "cpu", "--budget", "64MiB", "--batch", "2", "--context", "64",
                "--min-context", "16", "--out", tmp_path / "best.yaml")
    assert r.exit_code == 2 and "Traceback" not in r.output, r.output  # (after the probe's header)
    assert r.stderr.strip().splitlines()[-1] == ("error: model.py: loss() raised AssertionError: past the position "
                                                 "table (in the trial of micro-batch 2, context 64, fp32)")


def test_a_model_file_given_as_the_config_is_named_as_such(write_model):
    for command in ("check", "train", "export"):
        args = ("--to", "hf") if command == "export" else ()
        one_line_error(run_cli(command, "--config", write_model(), *args),
                       "model.py is a Python file (a model file?), not a config")



def test_check_says_why_a_probed_config_has_no_old_breakdown(write_model, tmp_path):
    """device: cpu (probe), fake (check). An estimate's config has the column; a probe's records the peak alone."""
    said = "no old column: the config records the peak alone"
    for args in (("probe", write_model(), "--device", "cpu", "--budget", "64MiB"), ("estimate", write_model(),
                                                                                   "--budget", "400KiB", "--margin",
                                                                                   "0")):
        out = tmp_path / f"{args[0]}.yaml"  # (an estimate does not replace a probe's plan)
        assert run_cli(*args, "--batch", "2", "--context", "4", "--out", out).exit_code == 0
        r = run_cli("check", "--config", out)
        assert r.exit_code == 0 and (said in " ".join(r.stdout.split())) is (args[0] == "probe"), r.output


def test_a_config_behind_a_symlink_is_refused_before_the_search_and_read_through_by_check(config, write_model,
                                                                                          tmp_path):
    """--out a symlink: oomtune writes no file through a link (issue 39: a link planted where oomtune writes had its
    target overwritten). One line naming the link and the file it points to, exit 2, before any trial: the link and
    its target as they were. Reading a config through a link (check, train) is fine."""
    elsewhere = tmp_path / "links"
    elsewhere.mkdir()
    link = elsewhere / "best.yaml"
    link.symlink_to(config)
    before = config.read_text()
    for command in ("estimate", "probe"):
        device = ("--device", "cpu") if command == "probe" else ()
        r = run_cli(command, write_model(), *ESTIMATE[:-4], *device, "--batch", "4", "--context", "4", "--out", link)
        assert r.exit_code == 2, r.output
        assert r.output.strip().splitlines() == [
            f"error: --out {link} is a symbolic link (to {config}): oomtune writes no file through a link, nor into "
            f"a pipe or a device; pass --out {config.resolve()} (where it points), or remove it"]
    assert link.is_symlink() and config.read_text() == before
    assert run_cli("check", "--config", link).exit_code == 0


def test_torchs_warning_about_nested_tensors_is_not_in_a_commands_output():
    """nn.TransformerEncoder's fast path (enable_nested_tensor, in eval) warns on every run; --debug shows it."""
    import warnings

    from oomtune.cli.guard import user_errors

    text = "The PyTorch API of nested tensors is in prototype stage and will change in the near future."
    for debug in (False, True):
        with warnings.catch_warnings(record=True) as shown:
            warnings.simplefilter("always")
            with user_errors(debug):
                warnings.warn(text, UserWarning, stacklevel=1)
        assert bool(shown) is debug


def test_a_flat_margin_that_leaves_out_the_allocator_models_reserve_says_so(write_model):
    """device: fake. --margin 0 on a 400 KiB budget: the tensors fit, while the caching allocator would reserve a
    whole 2 MiB segment; the breakdown's allocator row says the plan may run out on a card (it printed +400% with
    the usual help, under a 'fits')."""
    r = run_cli("estimate", write_model(), "--budget", "400KiB", "--margin", "0", "--micro-batch", "2",
                "--context", "4")
    assert r.exit_code == 0 and "fits" in r.stdout, r.output
    text = " ".join(r.stdout.split())
    assert "allocator model 2.00 MiB" in text and "past what is allowed: on a card this plan may run out" in text
    with_room = run_cli("estimate", write_model(), "--budget", "4MiB", "--margin", "0", "--micro-batch", "2",
                        "--context", "4")
    assert with_room.exit_code == 0 and "past what is allowed" not in " ".join(with_room.stdout.split())


def test_check_shows_an_offload_plans_host_memory_as_estimate_does(write_model, tmp_path):
    """device: fake. An offloaded optimizer's state is in host memory: check's breakdown had no row for it (the
    estimate's had one), so its old and new columns said nothing of it."""
    model = write_model()
    plan = {"micro_batch_size": 2, "context_length": 4, "offload_optimizer": True}
    (tmp_path / "off.yaml").write_text(json.dumps({"model": str(model), "plan": plan}))
    r = run_cli("check", "--config", tmp_path / "off.yaml", "--budget", "64MiB")
    assert r.exit_code == 0, r.output
    (row,) = [line for line in r.stdout.splitlines() if line.strip().startswith("host memory")]
    assert "KiB" in row, row
