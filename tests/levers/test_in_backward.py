"""The optimizer stepped in backward (plan.optimizer_in_backward, the `step-in-backward` rung): each trained
parameter updated from its post-accumulate-grad hook as backward makes its gradient, which is then freed. devices:
cpu (real compute, simulated memory) for the values and the trainer, fake for the estimate; their peaks equal to
the byte.

Predicted saving, from the mechanism (levers/in_backward.py): where the peak is the optimizer step (weights,
gradients, moments), every gradient but the one being applied is gone: eight 256x256 fp32 weights (256 KiB each)
save 7 of their 8 gradients, 1.75 MiB."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
import yaml

from oomtune.config.export import export
from oomtune.config.schema import Plan
from oomtune.errors import ConfigError, OomtuneError
from oomtune.memory.devices import CpuDevice, FakeDevice
from oomtune.memory.margin import Margin
from oomtune.model_file import load_model_file
from oomtune.search.trial import run_trial
from oomtune.step import build_training, train_step

from ..conftest import TINY_MODEL, run_cli, trained_with_and_without
from ..search.test_trial import WIDE_MODEL

GRAD = 256 * 256 * 4  # one of the wide model's eight weights (and its gradient)


def _trained(model_file, plan: Plan, steps: int = 3):
    """`steps` real steps on the cpu device from the same weights and batches: (losses, weights after)."""
    torch.manual_seed(0)
    device = CpuDevice("1GiB")
    with device.measure():
        t = build_training(model_file, plan, device, lr=1e-2)
        torch.manual_seed(1)
        losses = [float(train_step(t, [model_file.batch(plan.micro_batch_size, plan.context_length,
                                                        device.torch_device)], s)) for s in range(steps)]
    return losses, [p.detach().clone() for p in t.module.parameters()]


@pytest.mark.parametrize("levers", [{}, {"optimizer_8bit": True}], ids=["adamw", "8bit"])
def test_the_same_training_as_the_step_after_backward(write_model, levers):
    """Each parameter's update is the one the step after backward makes: the same losses, the same weights."""
    model_file = load_model_file(write_model(WIDE_MODEL if levers else TINY_MODEL))
    plan = Plan(4, 16, **levers)
    (before, w0), (after, w1) = _trained(model_file, plan), _trained(
        model_file, dataclasses.replace(plan, optimizer_in_backward=True))
    assert after == pytest.approx(before, rel=1e-6) and before[0] != before[-1]  # (the steps changed something)
    assert all(torch.allclose(a, b, rtol=1e-6, atol=1e-7) for a, b in zip(w0, w1, strict=True))


def test_seven_of_eight_gradients_saved_as_predicted_and_fake_equals_cpu(write_model):
    model_file = load_model_file(write_model(WIDE_MODEL))
    peaks = {}
    for on in (False, True):
        plan = Plan(1, 1, optimizer_in_backward=on)
        cpu = run_trial(model_file, plan, CpuDevice("1GiB"))
        fake = run_trial(model_file, plan, FakeDevice("1GiB", margin=Margin()))
        assert fake.peak_allocated_bytes == cpu.peak_allocated_bytes  # to the byte
        peaks[on] = cpu.peak_allocated_bytes
    saved = peaks[False] - peaks[True]
    print(f"peak {peaks[False]:,} -> {peaks[True]:,} B, saved {saved:,} B, predicted {7 * GRAD:,} B")
    assert saved == pytest.approx(7 * GRAD, rel=0.01)


@pytest.mark.parametrize("plan, says", [
    (Plan(2, 8, grad_accum_steps=2), "grad_accum_steps 2 (every micro-batch's backward would update the weights)"),
    (Plan(2, 8, world_size=2, sharding="ddp"), "2 ranks"),
    (Plan(2, 8, precision="fp16"), "precision fp16"),
    (Plan(2, 8, offload_optimizer=True), "offload_optimizer"),
])
def test_a_plan_it_cannot_run_with_is_refused(plan, says):
    with pytest.raises(ConfigError, match="plan.optimizer_in_backward cannot run with") as e:
        dataclasses.replace(plan, optimizer_in_backward=True)
    assert says in str(e.value)


def test_clipping_and_a_model_files_own_stepping_hooks_are_bad_input(write_model):
    plan = Plan(2, 8, optimizer_in_backward=True)
    with pytest.raises(OomtuneError, match="train.clip_grad_norm is set") as e:
        build_training(load_model_file(write_model()), plan, CpuDevice("1GiB"), lr=1e-3, clip_grad_norm=1.0)
    assert e.value.exit_code == 2
    own = TINY_MODEL.replace("def build_model():\n    return Net()", """def build_model():
    net = Net()
    for p in net.parameters():
        p.register_post_accumulate_grad_hook(lambda p: None)
    return net""")
    assert own != TINY_MODEL
    with pytest.raises(OomtuneError, match="steps 6 trained parameters in backward with its own"):
        build_training(load_model_file(write_model(own, "own.py")), plan, CpuDevice("1GiB"), lr=1e-3)


def test_the_ladder_climbs_it_where_only_the_gradients_are_over_then_trains_and_exports_it(write_model, tmp_path,
                                                                                          monkeypatch):
    """device: cpu. The wide model at batch 1: weights + gradients + AdamW's moments (8 MiB) do not fit in 8 MiB
    (7.2 allowed) on any usual rung; stepped in backward, 6.3 MiB does. The plan is written with no clipping, trains
    (the same losses as the plan without the lever, where that fits), and exports to torchtune's optimizer_in_bwd."""
    monkeypatch.chdir(tmp_path)
    model = write_model(WIDE_MODEL)
    r = run_cli("probe", model, "--device", "cpu", "--budget", "8MiB", "--batch", "1", "--context", "4", "--out",
                "ib.yaml", "--json")
    assert r.exit_code == 0, r.output
    report = json.loads(r.stdout)
    assert report["plan"]["optimizer_in_backward"] is True and report["plan"]["grad_accum_steps"] == 1
    assert [t["rung"] for t in report["trials"]] == ["step-in-backward"]
    config = yaml.safe_load((tmp_path / "ib.yaml").read_text())
    assert config["train"]["clip_grad_norm"] is None
    ib, plain = trained_with_and_without(tmp_path, config, "optimizer_in_backward", 4)
    assert len(ib) == 4 and [s for s, _ in ib] == [s for s, _ in plain]
    assert [x for _, x in ib] == pytest.approx([x for _, x in plain], rel=1e-5)
    tune = export(Plan(1, 4, optimizer_in_backward=True), "torchtune")
    assert tune.values["optimizer_in_bwd"] is True and tune.values["clip_grad_norm"] is None
    assert {"optimizer_in_bwd=true", "clip_grad_norm=null", "optimizer.fused=true"} <= set(tune.text().splitlines())
    assert any(line.startswith("optimizer_in_backward: ") for line in export(Plan(1, 4, optimizer_in_backward=True),
                                                                             "hf").unexpressed)


def test_a_later_plan_without_the_lever_gets_clipping_back(write_model, tmp_path, monkeypatch):
    """device: cpu. The in-backward plan's config is written with clip_grad_norm null (it cannot clip); a later probe
    into the same file whose plan steps after backward keeps the train: section, but not that null: clipping is set
    back to the default and a note says so (it trained unclipped, silently, before)."""
    monkeypatch.chdir(tmp_path)
    model = write_model(WIDE_MODEL)
    args = ("--device", "cpu", "--batch", "1", "--context", "4", "--out", "ib.yaml", "--json")
    assert run_cli("probe", model, "--budget", "8MiB", *args).exit_code == 0
    config = yaml.safe_load((tmp_path / "ib.yaml").read_text())
    assert config["train"]["clip_grad_norm"] is None
    config["train"]["lr"] = 0.002  # (the user's own edit: kept)
    (tmp_path / "ib.yaml").write_text(yaml.safe_dump(config))
    r = run_cli("probe", model, "--budget", "64MiB", *args)
    assert r.exit_code == 0, r.output
    report = json.loads(r.stdout)
    assert report["plan"]["optimizer_in_backward"] is False and report["kept_train"] is True
    assert any(n.startswith("train.clip_grad_norm set back to 1.0") for n in report["notes"])
    again = yaml.safe_load((tmp_path / "ib.yaml").read_text())
    assert again["train"]["clip_grad_norm"] == 1.0 and again["train"]["lr"] == 0.002


def test_a_nan_loss_stops_before_backward_applies_its_update(case_dir):
    """The trainer reads the loss before backward under this lever (its update is applied there): the last finished
    step is saved, its weights finite, as without the lever."""
    from oomtune.train.checkpoint import load_checkpoint

    from ..train.cases import error_line, steps_saved, train

    config = yaml.safe_load((case_dir / "best.yaml").read_text())
    config["plan"] = {"micro_batch_size": 2, "context_length": 8, "optimizer_in_backward": True}
    config["train"]["clip_grad_norm"] = None
    (case_dir / "best.yaml").write_text(yaml.safe_dump(config))
    (case_dir / "nan-at").write_text("5")  # step 5's batch
    result = train()
    assert result.exit_code == 1, result.stderr
    assert "the training loss is nan at step 5" in error_line(result)
    assert steps_saved(case_dir / "run") == [3, 4]
    state = load_checkpoint(case_dir / "run" / "ckpt-00000004.pt")
    assert all(torch.isfinite(p).all() for p in state["model"].values())


def test_a_kept_model_trained_by_the_lever_trains_another_plan_as_a_fresh_one(write_model):
    """A probe's trials on one rung share a model (trial.ModelCache), and the rung beside the chain has the same
    model as the one before it: its hooks are taken off for the next plan (else counted as the model file's own,
    and an accumulated plan refused), which then measures what a freshly built model does."""
    from oomtune.search import trial

    model_file = load_model_file(write_model())
    cache, device = trial.ModelCache(), CpuDevice("1GiB")
    plans = [Plan(2, 8, optimizer_in_backward=True), Plan(2, 8, grad_accum_steps=2), Plan(4, 8)]
    kept = [run_trial(model_file, plan, device, models=cache).peak_allocated_bytes for plan in plans]
    assert cache.model is not None  # (one model, kept through all three)
    assert kept == [run_trial(model_file, plan, CpuDevice("1GiB")).peak_allocated_bytes for plan in plans]


SHARED = TINY_MODEL.replace("import torch\n", "import torch\nfrom torch.utils.checkpoint import checkpoint\n", 1)


def test_a_gradient_made_twice_is_an_error_not_a_second_step(write_model):
    """A reentrant checkpoint of two segments that share a layer: backward accumulates its gradient once a segment,
    so its hook fires twice, the first time on a partial gradient. The second is an error naming why."""
    model = SHARED.replace("        for b in self.blocks:\n            x = torch.relu(b(x))",
                           "        x = self.blocks[1](x)  # (an input that requires grad: reentrant needs one)\n"
                           "        for _ in range(2):\n"
                           "            x = checkpoint(lambda h: torch.relu(self.blocks[0](h)), x, use_reentrant=True)")
    assert model != SHARED
    model_file = load_model_file(write_model(model))
    device = CpuDevice("1GiB")
    with device.measure():
        t = build_training(model_file, Plan(2, 8, optimizer_in_backward=True), device, lr=1e-3)
        with pytest.raises(Exception, match="raised StepTwice: .*backward made the gradient of a .* parameter twice"):
            train_step(t, [model_file.batch(2, 8, device.torch_device)])


def test_an_optimizer_it_does_not_know_is_refused_and_the_ladder_leaves_the_rung_out(write_model, tmp_path):
    own = write_model(TINY_MODEL + "\ndef optimizer(params, lr):\n    return torch.optim.RMSprop(params, lr=lr)\n")
    with pytest.raises(OomtuneError, match="returns RMSprop, which may not step one parameter at a time"):
        build_training(load_model_file(own), Plan(2, 8, optimizer_in_backward=True), CpuDevice("1GiB"), lr=1e-3)
    r = run_cli("estimate", own, "--budget", "8KiB", "--margin", "0", "--batch", "2", "--context", "8", "--json",
                "--out", tmp_path / "x.yaml")
    assert "may not step one parameter at a time" in json.loads(r.stdout)["levers_not_used"]["step-in-backward"]


def test_the_default_adamw_is_fused_only_where_torch_has_the_kernel():
    from oomtune.model_file import default_adamw

    real = [torch.nn.Parameter(torch.randn(3))]
    assert default_adamw(real, 1e-3).param_groups[0]["fused"] is True
    odd = [torch.nn.Parameter(torch.randn(3)), torch.nn.Parameter(torch.randn(3, dtype=torch.complex64))]
    opt = default_adamw(odd, 1e-3)  # (torch builds a fused one over these, then refuses at the first step)
    for p in odd:
        p.grad = torch.ones_like(p)
    opt.step()
    assert not opt.param_groups[0]["fused"]


def test_the_floor_checked_is_the_lowest_of_the_chain_and_the_rung_beside_it(tmp_path):
    """device: cpu. Without its gradients the tiny GPT's fp32 state fits in 4 MiB at batch 1; the last rung of the
    chain (offload-activations, fp32 gradients held) alone would say the budget is too small for the weights."""
    from ..conftest import EXAMPLES

    r = run_cli("probe", EXAMPLES / "tiny_gpt.py", "--device", "cpu", "--budget", "4MiB", "--batch", "1", "--context",
                "8", "--levers", "step-in-backward,offload-activations", "--out", tmp_path / "f.yaml", "--json")
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["plan"]["optimizer_in_backward"] is True
