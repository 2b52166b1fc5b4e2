"""The 8-bit and offload levers over a model file's own optimizer() (levers/own_optimizer.py): nanoGPT's
configure_optimizers returns a plain AdamW with two param groups, and both levers were left out ("defines its own
optimizer"). They keep its groups and hyper-parameters now; a class they cannot rebuild keeps them out, named.
Devices: cpu (probe, training steps), fake (static memory)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml

from oomtune.config.schema import Plan
from oomtune.levers.adamw8bit import BlockwiseAdamW8bit
from oomtune.levers.offload import HostOffloadOptimizer
from oomtune.memory.devices import CpuDevice
from oomtune.model_file import load_model_file
from oomtune.step import build_training, train_step
from tests.conftest import run_cli

GROUPED = Path(__file__).parent / "models" / "grouped_adamw.py"
HYPER = ("lr", "betas", "eps", "weight_decay")


def _groups(optimizer: torch.optim.Optimizer) -> list[tuple[dict, list[tuple[int, ...]]]]:
    """Each group's hyper-parameters and its parameters' shapes."""
    return [({k: g[k] for k in HYPER}, [tuple(p.shape) for p in g["params"]]) for g in optimizer.param_groups]


def test_the_8bit_and_offload_rungs_are_climbed_over_an_own_adamw(tmp_path):
    """device: cpu. 300 KiB fits nothing short of 8-bit state and the optimizer offloaded; both rungs were left out
    for a model file with an optimizer() and nothing fitted. They are climbed, and the plan uses both."""
    r = run_cli("probe", GROUPED, "--device", "cpu", "--budget", "300KiB", "--margin", "0", "--out",
                tmp_path / "p.yaml", "--json")
    assert r.exit_code == 0, r.output
    report = json.loads(r.stdout)
    assert [x["rung"] for x in report["rungs"]][-2:] == ["bf16-true+8bit", "bf16-true+8bit+offload"]
    assert set(report["levers_not_used"]) == {"chunked-loss", "nf4"}  # (not a Hugging Face causal LM)
    plan = yaml.safe_load((tmp_path / "p.yaml").read_text())["plan"]
    assert plan["optimizer_8bit"] and plan["offload_optimizer"] and plan["micro_batch_size"] == 8


@pytest.mark.parametrize("keys, kind", [({"optimizer_8bit": True}, BlockwiseAdamW8bit),
                                        ({"offload_optimizer": True}, torch.optim.AdamW),
                                        ({"optimizer_8bit": True, "offload_optimizer": True}, BlockwiseAdamW8bit)])
def test_the_levers_keep_the_files_param_groups_and_hyper_parameters(keys, kind):
    """device: cpu. The lever's optimizer has the file's two groups (the three matrices decaying at 0.05, the seven
    biases and norm weights not), with its betas (0.9, 0.95) and eps 1e-6, where it had torch's defaults over one
    group; offloaded, over host copies of the same parameters."""
    mf = load_model_file(GROUPED)
    model = mf.build()
    theirs = _groups(mf.optimizer([p for p in model.parameters()], 1e-3, model))
    t = build_training(mf, Plan(2, 4, **keys), CpuDevice("64MiB"), lr=1e-3)
    inner = t.optimizer.inner if keys.get("offload_optimizer") else t.optimizer
    assert isinstance(t.optimizer, HostOffloadOptimizer) == bool(keys.get("offload_optimizer"))
    assert type(inner) is kind and _groups(inner) == theirs
    assert [len(s) for _, s in theirs] == [3, 7] and theirs[0][0] == {"lr": 1e-3, "betas": (0.9, 0.95), "eps": 1e-6,
                                                                        "weight_decay": 0.05}
    if keys.get("offload_optimizer"):
        hosted = {id(h) for h in t.optimizer._host.values()}
        assert all(id(p) in hosted for g in inner.param_groups for p in g["params"])


def _losses(plan: Plan, steps: int = 12) -> list[float]:
    mf = load_model_file(GROUPED)
    torch.manual_seed(0)
    t = build_training(mf, plan, CpuDevice("64MiB"), lr=3e-3)
    torch.manual_seed(1)
    batch = mf.batch(plan.micro_batch_size, plan.context_length, torch.device("cpu"))  # the same one: it is learnt
    return [float(train_step(t, [batch], step=i)) for i in range(steps)]


def test_training_with_8bit_state_over_the_files_groups_follows_its_plain_adamw():
    """device: cpu. Twelve steps on one batch from the same weights: the 8-bit run's losses stay within 5% of the
    file's own AdamW's (the moments' quantization noise), and both fall."""
    plain, eight = _losses(Plan(8, 8)), _losses(Plan(8, 8, optimizer_8bit=True))
    assert eight == pytest.approx(plain, rel=0.05)
    assert plain[-1] < plain[0] and eight[-1] < eight[0]


SUBCLASS = GROUPED.read_text().replace("def optimizer(params, lr, model):", """\
class Tuned(torch.optim.AdamW):  # a step of its own may differ: the levers cannot rebuild it
    pass


def optimizer(params, lr, model):""").replace("return torch.optim.AdamW(", "return Tuned(")


def test_an_optimizer_class_the_levers_cannot_rebuild_keeps_them_out_with_a_note_naming_it(write_model, tmp_path):
    """device: cpu. A subclass of AdamW (its step may be its own) and SGD for 8-bit (no moments): the levers stay
    out, the note names the class; a config asking for one is one line, exit 2, and no run dir is made."""
    path = write_model(SUBCLASS)
    r = run_cli("probe", path, "--device", "cpu", "--budget", "400KiB", "--margin", "0", "--out",
                tmp_path / "p.yaml", "--json")  # (nothing fits without them)
    report = json.loads(r.stdout)
    why = report["levers_not_used"]
    assert why["8bit"] == why["offload"] == ("model.py's optimizer() returns Tuned, which this lever cannot rebuild "
                                             "(it keeps the param groups of torch's AdamW, Adam and SGD)")
    assert f"no offload rung: {why['offload']}" in report["notes"]
    assert not {"8bit", "offload"} & {lever for x in report["rungs"] for lever in x["rung"].split("+")}
    cfg = tmp_path / "c.yaml"
    cfg.write_text(f"model: {path}\nplan:\n  micro_batch_size: 2\n  context_length: 4\n  offload_optimizer: true\n")
    t = run_cli("train", "--config", cfg, "--device", "cpu", "--steps", "2", "--run-dir", tmp_path / "run")
    assert t.exit_code == 2 and t.stderr.strip().splitlines()[-1] == (
        "error: plan.offload_optimizer: model.py's optimizer() returns Tuned, which this lever cannot rebuild (it "
        "keeps the param groups of torch's AdamW, Adam and SGD) (remove the key)"), t.output
    assert not (tmp_path / "run").exists()


def _one(cls, **kwargs) -> torch.optim.Optimizer:
    return cls([torch.nn.Parameter(torch.zeros(4))], lr=1e-3, **kwargs)


@pytest.mark.parametrize("optimizer, eight_bit", [
    (_one(torch.optim.AdamW), None),
    (_one(torch.optim.Adam), None),  # no decay: the same update as AdamW's
    (_one(torch.optim.Adam, weight_decay=0.1, decoupled_weight_decay=True), None),
    (_one(torch.optim.Adam, weight_decay=0.1), "returns torch.optim.Adam with weight_decay, which Adam adds to the "
     "gradient (L2) and 8-bit AdamW decouples from it: use torch.optim.AdamW"),
    (_one(torch.optim.AdamW, amsgrad=True), "returns torch.optim.AdamW with amsgrad or maximize, which 8-bit AdamW "
     "does not do"),
    (_one(torch.optim.SGD, momentum=0.9), "returns torch.optim.SGD, which keeps no moments for 8-bit AdamW to store"),
])
def test_which_optimizers_8bit_rebuilds_and_offload_rebuilds_them_all(optimizer, eight_bit):
    """device: none (construction only). 8-bit AdamW stands in only for an update it does (AdamW's, or Adam's without
    L2 decay); offload runs torch's own class on the host, so every one of AdamW, Adam and SGD takes it."""
    from oomtune.levers.own_optimizer import blocked

    assert blocked(optimizer, "optimizer_8bit") == eight_bit
    assert blocked(optimizer, "offload_optimizer") is None


SGD_GROUPS = GROUPED.read_text().replace(
    "    return torch.optim.AdamW([{\"params\": decay, \"weight_decay\": DECAY}, {\"params\": no_decay, "
    "\"weight_decay\": 0.0}],\n                             lr=lr, betas=BETAS, eps=EPS)",
    "    return torch.optim.SGD([{\"params\": decay, \"momentum\": 0.9}, {\"params\": no_decay, \"lr\": lr / 10}],\n"
    "                           lr=lr, nesterov=False)")


def test_an_offloaded_sgd_keeps_its_groups_on_the_host(write_model):
    """device: cpu. SGD with a momentum group and a slower group, offloaded: the host optimizer is torch's SGD over
    the same two groups (momentum 0.9 and 0; lr 0.01 and 0.001), and a step moves the weights."""
    assert "torch.optim.SGD" in SGD_GROUPS
    mf = load_model_file(write_model(SGD_GROUPS))
    t = build_training(mf, Plan(2, 4, offload_optimizer=True), CpuDevice("64MiB"), lr=1e-2)
    inner = t.optimizer.inner
    assert type(inner) is torch.optim.SGD
    assert [(g["lr"], g["momentum"], len(g["params"])) for g in inner.param_groups] == [(1e-2, 0.9, 3), (1e-3, 0, 7)]
    before = [p.detach().clone() for p in t.module.parameters()]
    train_step(t, [mf.batch(2, 4, torch.device("cpu"))])
    assert all(not torch.equal(a, p) for a, p in zip(before, t.module.parameters(), strict=True))
