"""A card (`--gpu NAME`) and a budget (`--budget`) together: check with --gpu and no --budget checks in the card's
memory (as estimate does), a budget over the card's memory is refused wherever the two meet, and the generic card,
which has no memory of its own, asks for --budget. Bad input is one line and exit 2."""

from __future__ import annotations

import dataclasses
import json

import pytest

import oomtune
from oomtune.config.loading import load_config
from oomtune.errors import OomtuneError
from oomtune.memory.cards import find_gpu

from ..conftest import EXAMPLES, one_line_error, run_cli

TINY_GPT = EXAMPLES / "tiny_gpt.py"
SMALL = ("--batch", "4", "--context", "32")  # a short search: these tests are about budgets and margins
H100 = find_gpu("h100")
OVER_T4 = "--budget 32.00 GiB is more than the Tesla T4's 15.00 GiB"
NO_SIZE = "--gpu generic has no memory size: give --budget too (e.g. --budget 24GiB)"


@pytest.fixture(scope="module")
def cpu_config(tmp_path_factory):
    """A config probed on the cpu device in 12 MiB (a few seconds)."""
    out = tmp_path_factory.mktemp("card_budget") / "tmp.yaml"
    r = run_cli("probe", TINY_GPT, "--device", "cpu", "--budget", "12MiB", *SMALL, "--out", out)
    assert r.exit_code == 0, r.output
    return out


# -- 1. check --gpu without --budget: the card's memory, not the budget of the device the config was found on ----

def test_check_with_a_card_and_no_budget_checks_in_the_cards_memory(cpu_config):
    r = run_cli("check", "--config", cpu_config, "--gpu", "h100", "--json")
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["budget_bytes"] == H100.memory_bytes
    text = run_cli("check", "--config", cpu_config, "--gpu", "h100")
    assert text.exit_code == 0, text.output
    assert "budget 79.65 GiB" in text.stdout and "still fits" in text.stdout


def test_check_without_a_card_or_budget_keeps_the_configs_budget(cpu_config):
    r = run_cli("check", "--config", cpu_config, "--json")
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["budget_bytes"] == 12 * 1024**2


def test_check_with_a_card_and_a_budget_takes_the_budget(cpu_config):
    for budget, expected in (("15GiB", 15 * 1024**3), ("90%", int(find_gpu("t4").memory_bytes * 0.9))):
        r = run_cli("check", "--config", cpu_config, "--gpu", "t4", "--budget", budget, "--json")
        assert r.exit_code == 0, r.output
        assert json.loads(r.stdout)["budget_bytes"] == expected


# -- 2. a budget over the card's memory is refused, wherever a card and an absolute budget meet ------------------

COMMANDS = {  # where a card and a budget meet, besides check
    "estimate": ("estimate", TINY_GPT),
    "what-if": ("estimate", TINY_GPT, "--micro-batch", "1", "--context", "32"),
    "probe-cpu": ("probe", TINY_GPT, "--device", "cpu"),
    "probe-fake": ("probe", TINY_GPT, "--device", "fake"),
}


@pytest.mark.parametrize("name", list(COMMANDS))
def test_a_budget_over_the_cards_memory_is_refused(name, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # (the config they would write: best.yaml)
    one_line_error(run_cli(*COMMANDS[name], "--gpu", "t4", "--budget", "32GiB"), OVER_T4)
    assert not (tmp_path / "best.yaml").exists()


def test_check_refuses_a_budget_over_the_cards_memory(cpu_config):
    one_line_error(run_cli("check", "--config", cpu_config, "--gpu", "t4", "--budget", "32GiB"), OVER_T4)


def test_a_budget_up_to_the_cards_memory_is_accepted():
    for budget in ("15GiB", "100%", "90%"):
        r = run_cli("estimate", TINY_GPT, "--gpu", "t4", "--budget", budget, "--micro-batch", "1", "--context", "32")
        assert r.exit_code == 0, (budget, r.output)


def test_check_refuses_a_configs_budget_over_its_cards_memory(cpu_config):
    """A config that says it was found as a T4 in 32 GiB (written before budgets were checked) names the config's
    budget, not a --budget nobody gave."""
    config = load_config(cpu_config)
    bad = dataclasses.replace(config, found_by=dataclasses.replace(config.found_by, card="t4",
                                                                   budget_bytes=32 * 1024**3))
    with pytest.raises(OomtuneError, match=r"the config's budget 32.00 GiB \(found_by.budget_bytes\) is more than "
                                           r"the Tesla T4's 15.00 GiB"):
        oomtune.check(bad, model=TINY_GPT)


# -- 3. the generic card has no memory of its own: --budget, said as such ------------------------------------------

@pytest.mark.parametrize("name", ["estimate", "what-if"])
def test_the_generic_card_without_a_budget_asks_for_one(name, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    one_line_error(run_cli(*COMMANDS[name], "--gpu", "generic"), NO_SIZE)


def test_probe_on_the_fake_device_with_the_generic_card_and_no_budget_says_the_card_has_none(tmp_path):
    """(probe's fake device takes the generic card without --gpu too: the line holds for both)"""
    one_line_error(run_cli(*COMMANDS["probe-fake"], "--gpu", "generic", "--out", tmp_path / "best.yaml"),
                   "--device fake has no memory of its own (nor has the generic card): give --budget")


def test_check_with_the_generic_card_and_no_budget_asks_for_one(cpu_config):
    one_line_error(run_cli("check", "--config", cpu_config, "--gpu", "generic"), NO_SIZE)


def test_probe_takes_a_margin_on_the_simulated_devices(tmp_path):
    """device: fake. probe --device fake counts a card's margin (512 MiB of assumed CUDA context): a small budget
    needs --margin 0 to probe the tensors alone, as estimate and check allow (probe had no --margin); the error
    says so. On cuda what a GPU needs beyond tensors is measured: --margin there is bad input."""
    args = ("probe", TINY_GPT, "--device", "fake", "--budget", "12MiB", *SMALL, "--out", tmp_path / "f.yaml")
    without = run_cli(*args)
    assert without.exit_code == 2 and without.stderr.strip().endswith("or --margin 0 to count tensors alone")
    r = run_cli(*args, "--margin", "0", "--json")
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["fits"] and load_config(tmp_path / "f.yaml").found_by.device == "fake"
    cuda = run_cli("probe", EXAMPLES / "tiny_gpt.py", "--device", "cuda", "--margin", "0", "--out", tmp_path / "c.yaml")
    assert cuda.exit_code == 2 and "--margin is for the simulated devices" in cuda.stderr, cuda.output


@pytest.mark.parametrize("device", ["cpu", "fake"])
def test_check_and_train_take_the_margin_the_probe_used_beside_its_card(tmp_path, device):
    """devices: cpu and fake. A probe with --gpu and --margin 0 in 12 MiB wrote a plan that check and train then
    refused (exit 2: 12 MiB is not more than the card's 512 MiB of context): they took the card's own margin. The
    config now records the flat margin (found_by.margin) and both take it."""
    out = tmp_path / "m.yaml"
    r = run_cli("probe", TINY_GPT, "--device", device, "--gpu", "generic", "--margin", "0", "--budget", "12MiB",
                *SMALL, "--out", out)
    assert r.exit_code == 0, r.output
    assert load_config(out).found_by.margin == "0"
    assert run_cli("check", "--config", out).exit_code == 0
    trained = run_cli("train", "--config", out, "--steps", "1", "--device", "cpu", "--run-dir", tmp_path / "run")
    assert trained.exit_code == 0, trained.output


@pytest.mark.parametrize(("card", "gpu_name", "expected"), [
    ("nvidiartxa4000", "NVIDIA RTX A4000", "a generic sm80 card"),  # not in the table: named after the driver
    ("h200", "NVIDIA H200", "H200"),
])
def test_check_of_a_config_probed_on_a_gpu_uses_its_cards_rules_without_a_context(cpu_config, tmp_path, card,
                                                                                     gpu_name, expected):
    """device: fake. A config probed on cuda records its card (the table's alias, or one made from the driver's
    name where the table has none) and a budget from which its own CUDA context was already gone: check on fake
    takes that card's rules (else the generic ones) with no context (it failed with "--gpu 'nvidiartxa4000': not in
    the table", and a table card's assumed 512 MiB context was counted twice)."""
    from oomtune.config.writing import save_config
    from oomtune.search.check import card_of

    config = load_config(cpu_config)
    found = dataclasses.replace(config.found_by, device="cuda", estimated=False, gpu_name=gpu_name, card=card,
                                budget_bytes=256 * 1024**2)
    path = tmp_path / "cuda.yaml"
    save_config(dataclasses.replace(config, found_by=found), path)
    spec = card_of(load_config(path), None)
    assert (spec.name, spec.context_bytes) == (expected, 0)
    r = run_cli("check", "--config", path, "--json")
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["budget_bytes"] == 256 * 1024**2


# -- 3. a budget the user gives that the weights alone exceed is bad input, as for probe and estimate ------------

@pytest.mark.parametrize("device", ["fake", "cpu"])
def test_check_with_a_budget_under_the_weights_is_bad_input_and_the_config_stays(cpu_config, device):
    before = cpu_config.read_bytes()
    one_line_error(run_cli("check", "--config", cpu_config, "--device", device, "--budget", "2MiB"),
                   "budget 2.00 MiB", "too small for the plan's weights alone", "weights 1.02 MiB")
    assert cpu_config.read_bytes() == before
    r = run_cli("check", "--config", cpu_config, "--device", device, "--budget", "6MiB")  # over the floor: a check
    assert r.exit_code == 1 and "no longer fits" in r.output, r.output
    # a bf16 plan on a card without native bf16: the memory holds, the speed does not (as estimate says)
    r = run_cli("check", "--config", cpu_config, "--device", device, "--gpu", "t4", "--json")
    bf16 = json.loads(r.stdout)["plan"]["precision"] in ("bf16", "bf16-true")
    assert any("has no native bf16" in n for n in json.loads(r.stdout)["notes"]) == bf16, r.stdout
    # with a card, the floor is checked against what its context and workspaces leave (exit 1 before, where
    # estimate and train said exit 2): what a T4's 512 MiB context and its workspaces leave of 535 MiB
    one_line_error(run_cli("check", "--config", cpu_config, "--device", device, "--gpu", "t4", "--budget", "535MiB",
                           "--headroom", "0"),
                   "budget 535.00 MiB (3.00 MiB for tensors, after the margin", "too small for the plan's weights")


@pytest.mark.parametrize("name", list(COMMANDS))
@pytest.mark.parametrize("card", [(), ("--gpu", "t4")])
def test_an_empty_budget_is_refused_as_a_size(name, card, cpu_config, tmp_path, monkeypatch):
    """`--budget ""` (an unset $BUDGET in a CI script) is bad input wherever a budget is taken, as check said
    already: estimate crashed (TypeError, exit 1) and probe --device cpu searched in all of the machine's RAM."""
    monkeypatch.chdir(tmp_path)
    one_line_error(run_cli(*COMMANDS[name], *card, "--budget", ""), "budget '': expected a size")
    assert not (tmp_path / "best.yaml").exists()
    one_line_error(run_cli("check", "--config", cpu_config, *card, "--budget", ""), "budget '': expected a size")
