"""`oomtune export`: a plan as Hugging Face, Lightning, Accelerate and torchtune take it, loaded into the real
classes where they are installed (device: cpu, for the Trainer run)."""

from __future__ import annotations

import json
from importlib.util import find_spec

import pytest

from oomtune.config.export import defines, export
from oomtune.config.loading import load_config
from oomtune.config.output import write_config
from oomtune.config.schema import Config, Plan

from ..conftest import ROOT, run_cli


@pytest.fixture(autouse=True)
def fresh_accelerate_state():
    """TrainingArguments and Trainer set Accelerate's process-wide state (bf16 here); leave none behind for the next
    test in this worker (the bench's Accelerate peer makes its own Accelerator, which refuses a changed one)."""
    yield
    if find_spec("accelerate") is not None:
        from accelerate.state import AcceleratorState

        AcceleratorState._reset_state(reset_partial_state=True)

PLANS = {
    "fp32": Plan(4, 64, "fp32", False, 2),
    "bf16+ckpt": Plan(2, 128, "bf16", True, 8),
    "bf16-true+8bit": Plan(4, 64, "bf16-true", True, 2, optimizer_8bit=True),
    "fp16+offload-activations": Plan(8, 32, "fp16", False, 1, offload_activations=True),
    "fp32+offload": Plan(8, 32, "fp32", False, 1, offload_optimizer=True, offload_activations=True),  # (not fp16)
}
needs = {name: pytest.mark.skipif(find_spec(name) is None, reason=f"{name} is not installed")
         for name in ("transformers", "lightning", "accelerate")}


@needs["transformers"]
@needs["accelerate"]
@pytest.mark.parametrize("name", ["fp32", "bf16+ckpt", "bf16-true+8bit"])
def test_the_hf_export_is_training_arguments(name, tmp_path):
    import warnings

    from transformers import TrainingArguments

    plan = PLANS[name]
    e = export(plan, "hf")
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)  # a deprecated key (gradient_checkpointing in transformers 5)
        args = TrainingArguments(output_dir=str(tmp_path), use_cpu=True, **e.values)
    assert args.per_device_train_batch_size == plan.micro_batch_size
    assert args.gradient_accumulation_steps == plan.grad_accum_steps
    assert (args.bf16, args.fp16) == (plan.precision == "bf16", plan.precision == "fp16")
    assert args.gradient_checkpointing == plan.activation_checkpointing
    assert args.optim.value == ("adamw_torch_8bit" if plan.optimizer_8bit else "adamw_torch_fused")
    keys = {line.split(":")[0] for line in e.unexpressed}
    assert ("precision" in keys) == (plan.precision == "bf16-true") and "context_length" not in keys
    assert [line.split(":")[0] for line in e.in_your_code] == ["context_length"]


@needs["lightning"]
@pytest.mark.parametrize("name", ["fp32", "bf16+ckpt", "bf16-true+8bit"])
def test_the_lightning_export_is_trainer_arguments(name, tmp_path):
    import lightning

    plan = PLANS[name]
    e = export(plan, "lightning")
    trainer = lightning.Trainer(**e.values["trainer"], accelerator="cpu", logger=False, default_root_dir=tmp_path,
                                enable_progress_bar=False, enable_model_summary=False)
    assert trainer.accumulate_grad_batches == plan.grad_accum_steps
    assert trainer.precision == {"fp32": "32-true", "bf16": "bf16-mixed", "bf16-true": "bf16-true"}[plan.precision]
    assert trainer.num_devices == plan.world_size and e.values["dataloader"]["batch_size"] == plan.micro_batch_size
    keys = {line.split(":")[0] for line in e.unexpressed}
    assert ("activation_checkpointing" in keys) == plan.activation_checkpointing
    assert ("optimizer_8bit" in keys) == plan.optimizer_8bit


@needs["accelerate"]
@pytest.mark.parametrize("name", PLANS)
def test_the_accelerate_export_is_a_config_accelerate_loads(name, tmp_path):
    from accelerate.commands.config.config_args import load_config_from_file

    plan = PLANS[name]
    e = export(plan, "accelerate")
    path = tmp_path / "accelerate.yaml"
    path.write_text(e.text())
    cfg = load_config_from_file(str(path))
    assert (f"grad_accum_steps: {plan.grad_accum_steps} is Accelerator(gradient_accumulation_steps=" in
            " ".join(e.in_your_code)) == (plan.grad_accum_steps > 1)
    assert not any(line.startswith(("context_length", "micro_batch_size", "grad_accum")) for line in e.unexpressed)
    assert str(cfg.mixed_precision) == {"fp32": "no", "bf16": "bf16", "fp16": "fp16", "bf16-true": "no"}[
        plan.precision]
    assert cfg.num_processes == plan.world_size and str(cfg.distributed_type) in ("NO", "DistributedType.NO")


def test_the_torchtune_export_is_recipe_overrides():
    plan = PLANS["bf16-true+8bit"]
    lines = export(plan, "torchtune").text().splitlines()
    assert "batch_size=4" in lines and "gradient_accumulation_steps=2" in lines and "dtype=bf16" in lines
    assert "enable_activation_checkpointing=true" in lines and "tokenizer.max_seq_len=64" in lines
    assert "optimizer._component_=torchao.optim.AdamW8bit" in lines
    mixed = export(PLANS["bf16+ckpt"], "torchtune")
    assert not any(line.startswith("dtype=") for line in mixed.text().splitlines())
    assert any(line.startswith("precision: bf16 is autocast") for line in mixed.unexpressed)


def test_the_cli_names_what_a_target_cannot_express_and_strict_refuses(tmp_path):
    path = tmp_path / "best.yaml"
    write_config(Config(model="model.py", plan=PLANS["fp32+offload"]), path, tmp_path / "model.py", "test")
    r = run_cli("export", "--config", path, "--to", "hf")
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["per_device_train_batch_size"] == 8
    assert "not expressed: offload_optimizer" in r.stderr and "not expressed: offload_activations" in r.stderr
    strict = run_cli("export", "--config", path, "--to", "hf", "--strict")
    assert strict.exit_code == 2 and strict.stdout == ""
    assert "--strict: hf cannot express offload_optimizer, offload_activations (each" in strict.stderr
    assert "set in your code: context_length: 32 is your data's sequence length" in strict.stderr
    bad = run_cli("export", "--config", path, "--to", "keras")
    assert bad.exit_code == 2 and "--to 'keras': expected one of hf, lightning, accelerate, torchtune" in bad.stderr
    assert load_config(path).plan == PLANS["fp32+offload"]  # read, never rewritten


@needs["transformers"]
@needs["accelerate"]
def test_the_exported_hf_arguments_train_a_small_hf_model_with_trainer(tmp_path):
    """device: cpu. A 2-layer GPT-2 from its config, trained 3 steps by transformers' own Trainer with the exported
    arguments (bf16 autocast, checkpointing, 8 steps of accumulation)."""
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=32, n_embd=32, n_layer=2, n_head=2))
    rows = [{"input_ids": ids, "labels": ids} for ids in torch.randint(0, 64, (64, 32))]
    kw = export(PLANS["bf16+ckpt"], "hf").values
    args = TrainingArguments(output_dir=str(tmp_path), use_cpu=True, max_steps=3, report_to=[], logging_steps=1,
                             save_strategy="no", learning_rate=1e-3, **kw)
    trainer = Trainer(model=model, args=args, train_dataset=rows)
    out = trainer.train()
    assert trainer.state.global_step == 3 and torch.isfinite(torch.tensor(out.training_loss))
    assert trainer.args.gradient_accumulation_steps == 8 and trainer.args.per_device_train_batch_size == 2


SGD_MODEL = '''import torch

DEFAULTS = {"batch": 2, "context": 8}


def build_model():
    return torch.nn.Linear(8, 8)


def make_batch(batch_size, context_length, device):
    return torch.randn(batch_size, context_length, 8, device=device)


def optimizer(params, lr):  # one state buffer a parameter (momentum), where AdamW keeps two
    return torch.optim.SGD(params, lr=lr, momentum=0.9)
'''


def config_for(tmp_path, model_text: str | None) -> str:
    """best.yaml for tmp_path/model.py (written where model_text is given; missing otherwise)."""
    if model_text is not None:
        (tmp_path / "model.py").write_text(model_text)
    path = tmp_path / "best.yaml"
    write_config(Config(model="model.py", plan=PLANS["fp32"]), path, tmp_path / "model.py", "test")
    return path


@pytest.mark.parametrize("target", ["hf", "lightning", "accelerate", "torchtune"])
def test_a_model_files_own_optimizer_is_not_expressed_where_the_target_writes_adamw(target, tmp_path):
    path = config_for(tmp_path, SGD_MODEL)
    r = run_cli("export", "--config", path, "--to", target)
    assert r.exit_code == 0, r.output
    writes_adamw = target in ("hf", "torchtune")
    assert ("not expressed: optimizer: model.py's own optimizer()" in r.stderr) == writes_adamw, r.stderr
    if writes_adamw:
        assert "AdamW" in r.stderr and ("optimizer._component_" if target == "torchtune" else "Trainer(optimizers=")\
            in r.stderr
        strict = run_cli("export", "--config", path, "--to", target, "--strict")
        assert strict.exit_code == 2 and strict.stdout == ""
        assert f"--strict: {target} cannot express " in strict.stderr and "optimizer (each is named" in strict.stderr
    assert load_config(path).model.source == "model.py"  # read, never rewritten


@pytest.mark.parametrize("model_text", [SGD_MODEL.split("\n\ndef optimizer")[0] + "\n", None, "def optimizer(:\n"],
                         ids=["no-optimizer", "missing", "not-python"])
def test_no_optimizer_note_without_an_optimizer_hook_or_a_readable_model_file(model_text, tmp_path):
    path = config_for(tmp_path, model_text)
    for target in ("hf", "torchtune"):
        r = run_cli("export", "--config", path, "--to", target)
        assert r.exit_code == 0 and "not expressed: optimizer" not in r.stderr, r.output
        assert "set in your code: context_length" in r.stderr or target == "torchtune"


@pytest.mark.parametrize("text, found", [
    (SGD_MODEL, True), ("from hooks import make_sgd as optimizer\n", True), ("optimizer = make_sgd\n", True),
    ("try:\n    from hooks import optimizer\nexcept ImportError:\n    pass\n", True),
    ("def build_model():\n    optimizer = None\n", False), ("optimizer_8bit = True\n", False), ("", False),
])
def test_defines_reads_the_files_top_level_without_running_it(text, found, tmp_path):
    (tmp_path / "m.py").write_text("raise SystemExit(3)\n" + text)  # never run
    assert defines(tmp_path / "m.py", "optimizer") is found
    assert defines(tmp_path / "absent.py", "optimizer") is False and defines(tmp_path, "optimizer") is False


@pytest.mark.parametrize("target", ["hf", "lightning", "accelerate", "torchtune"])
def test_strict_passes_a_plan_each_target_expresses(target, tmp_path):
    """What every training script sets (the sequence length; Accelerate's DataLoader batch size and accumulation)
    is named on stderr and not refused: --strict refuses only levers the target's arguments cannot switch on."""
    plan = Plan(4, 64, "fp32" if target == "torchtune" else "bf16", False, 2)
    path = tmp_path / "best.yaml"
    write_config(Config(model="model.py", plan=plan), path, tmp_path / "model.py", "test")
    r = run_cli("export", "--config", path, "--to", target, "--strict")
    assert r.exit_code == 0, r.output
    assert "not expressed" not in r.stderr and r.stdout.strip()
    assert ("set in your code: context_length: 64" in r.stderr) == (target != "torchtune")  # (its max_seq_len)


@pytest.mark.parametrize("target", ["hf", "lightning", "accelerate"])
def test_checkpointing_measured_on_the_model_files_own_blocks_is_not_the_targets_switch(target, tmp_path):
    """A ConvNext with a blocks() hook (transformers gives it no checkpointing): the hf export said
    "gradient_checkpointing": true, which makes Trainer call the model's own switch (it raises there; elsewhere it
    wraps other modules than were measured), and --strict let it through (from a new user's pass)."""
    (tmp_path / "model.py").write_text(SGD_MODEL.split("\n\ndef optimizer")[0] + "\n\ndef blocks(model):\n"
                                                                                  "    return [model]\n")
    path = tmp_path / "best.yaml"
    write_config(Config(model="model.py", plan=PLANS["bf16+ckpt"]), path, tmp_path / "model.py", "test")
    r = run_cli("export", "--config", path, "--to", target)
    assert r.exit_code == 0, r.output
    said = " ".join(r.stderr.split())
    assert "activation_checkpointing: measured on model.py's blocks as oomtune wrapped them" in said, said
    assert said.count("activation_checkpointing:") == 1 and "torch.utils.checkpoint" in said
    if target == "hf":
        values = json.loads(r.stdout)
        assert [values[k] for k in ("activation_checkpointing", "gradient_checkpointing") if k in values] == [False]
    strict = run_cli("export", "--config", path, "--to", target, "--strict")
    assert strict.exit_code == 2 and "activation_checkpointing" in strict.stderr.split("--strict:")[-1]
    without = export(PLANS["bf16+ckpt"], "hf")  # no blocks() of its own: the model's switch is what was measured
    assert [v for k, v in without.values.items() if k.endswith("_checkpointing")] == [True]


def test_a_plan_of_context_1_names_no_sequence_length_to_set():
    """An image model (context 1) was told "context_length: 1 is your data's sequence length (the tokenizer's
    max_length...)" (from a new user's pass)."""
    image, text = Plan(8, 1, "bf16", False, 2), Plan(8, 64, "bf16", False, 2)
    for target in ("hf", "lightning", "accelerate"):
        assert not any(line.startswith("context_length") for line in export(image, target).in_your_code)
        assert any(line.startswith("context_length: 64") for line in export(text, target).in_your_code)


def test_a_probed_plan_checkpointed_on_wrapped_blocks_says_so_in_the_config_and_export_reads_it(tmp_path):
    """device: fake. A model with no checkpointing switch of its own (no blocks() hook either: a plain PyTorch model,
    a ConvNext) is checkpointed by oomtune wrapping its ModuleList: the config records it (found_by.checkpointing_via)
    and export does not turn a switch on that the model does not have (from a review). A Hugging Face model's own
    switch is recorded as such, and exported as the switch."""
    from oomtune.api import estimate

    models = ROOT / "tests" / "finetune" / "models"
    # budgets where the target batch fits on the checkpointing rung only (peaks with --margin 0: convnext at 16
    # 5.06 MB in bf16, 4.37 MB checkpointed; the LoRA Llama at 4: 2.43 and 1.49 MB)
    for name, via, batch, budget in (("hf_convnext.py", "blocks", 16, "5200000"),
                                     ("hf_llama_lora.py", "switch", 4, "2200000")):
        out = tmp_path / f"{name}.yaml"
        result = estimate(models / name, budget=budget, margin="0", batch=batch, out=out)
        assert result.plan.activation_checkpointing, result.plan
        assert load_config(out).found_by.checkpointing_via == via
        r = run_cli("export", "--config", out, "--to", "hf", "--strict")
        assert (r.exit_code == 2) is (via == "blocks"), r.output


@pytest.mark.parametrize("target", ["hf", "lightning"])
def test_a_model_files_own_loss_is_named_where_the_trainer_computes_the_models(target, tmp_path):
    """A loss() hook (label smoothing, a contrastive loss) is what the plan trained with; Hugging Face's Trainer
    takes the model's outputs.loss instead, with no word (from a new user's pass). Lightning's training_step is the
    user's own: nothing to say there."""
    path = config_for(tmp_path, SGD_MODEL.split("\n\ndef optimizer")[0] + "\n\ndef loss(model, batch):\n"
                                                                       "    return model(batch).square().mean()\n")
    r = run_cli("export", "--config", path, "--to", target)
    assert r.exit_code == 0, r.output
    assert ("not expressed: loss: model.py's own loss()" in r.stderr) is (target == "hf"), r.stderr
    strict = run_cli("export", "--config", path, "--to", target, "--strict")
    assert strict.exit_code == (2 if target == "hf" else 0), strict.output
