"""A plan as other trainers take it: Hugging Face `TrainingArguments`, Lightning's `Trainer`, an Accelerate config,
torchtune recipe overrides. No torch here; nothing is imported from those libraries (the tests load each export
into the real class).

Each export returns what the target expresses; what the user's own code sets as for any run (the data's sequence
length, and for Accelerate the DataLoader's batch size and the accumulation steps); and every plan key the target
cannot express, with what to do instead. The caller prints the last two on stderr, and refuses the last under
--strict."""

from __future__ import annotations

import ast
import importlib.util
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path

from ..errors import OomtuneError
from .schema import PEFT_TASKS, ModelSection, Plan

TARGETS = ("hf", "lightning", "accelerate", "torchtune")


@dataclass(frozen=True)
class Export:
    target: str
    values: dict  # what the target takes (JSON-able)
    unexpressed: tuple[str, ...] = field(default=())  # "key: what to do instead", one a plan key it cannot take
    in_your_code: tuple[str, ...] = field(default=())  # "key: where", one a plan key set where every run sets it

    def text(self) -> str:
        """What `oomtune export` prints: JSON for hf and lightning, YAML for accelerate, key=value for torchtune."""
        import json

        if self.target in ("hf", "lightning"):
            return json.dumps(self.values, indent=2)
        if self.target == "accelerate":
            import yaml

            return yaml.safe_dump(self.values, sort_keys=False).rstrip()  # (quoted where YAML would read a bool: no)
        return "\n".join(f"{k}={_override(v)}" for k, v in self.values.items())


# the targets whose checkpointing switch is the model's own, and what to do where the model file has blocks()
_OWN_BLOCKS = {"hf": "TrainingArguments' switch (left false here) would turn the model's own checkpointing on, other "
                     "modules or an error where it has none: wrap each of those blocks' forward in "
                     "torch.utils.checkpoint in your model",
               "lightning": "wrap each of those blocks' forward in torch.utils.checkpoint in your LightningModule",
               "accelerate": "wrap each of those blocks' forward in torch.utils.checkpoint in your model"}

# what a training script sets for any run, so no target's arguments hold it: --strict does not refuse these
_IN_YOUR_CODE = ("context_length: ", "micro_batch_size: ", "grad_accum_steps: ")

# the targets that write an optimizer (AdamW), and what to do instead where the model file has its own optimizer()
_OWN_OPTIMIZER = {"hf": "optim here is AdamW (adamw_torch_fused), whose state may not fit the plan: pass yours as "
                        "Trainer(optimizers=(optimizer, None))",
                  "torchtune": "optimizer._component_ here is torch.optim.AdamW, whose state may not fit the plan: "
                               "set optimizer._component_ (and its arguments) to yours"}


def export(plan: Plan, target: str, optimizer_of: str | None = None, blocks_of: str | None = None,
           loss_of: str | None = None, model: ModelSection | None = None) -> Export:
    """`plan` as `target` takes it (see TARGETS). `optimizer_of`: the model file's name where it defines its own
    optimizer() (see defines), which the plan was measured with and a target that writes AdamW does not express.
    `blocks_of`: its name where the plan's checkpointing wrapped its blocks (a blocks() hook; a model with no switch
    of its own): a target's switch turns the model's own checkpointing on instead (other modules, or an error).
    `loss_of`: its name where it defines loss(), which Hugging Face's Trainer does not call (it takes the model's).
    `model`: the config's model section; for hf, the PEFT LoraConfig and BitsAndBytesConfig that build that model."""
    makers = {"hf": _hf, "lightning": _lightning, "accelerate": _accelerate, "torchtune": _torchtune}
    if target not in makers:
        raise OomtuneError(f"--to {target!r}: expected one of {', '.join(TARGETS)}")
    values, unexpressed = makers[target](plan)
    if blocks_of and plan.activation_checkpointing and target in _OWN_BLOCKS:
        unexpressed = [line for line in unexpressed if not line.startswith("activation_checkpointing: ")]
        if target == "hf":
            values[_hf_checkpointing_key()] = False  # (its switch is the model's own, not these blocks)
        if "fsdp_config" in values:  # accelerate's FSDP would checkpoint by its own wrap policy: other modules
            values["fsdp_config"]["fsdp_activation_checkpointing"] = False
        unexpressed.append(f"activation_checkpointing: measured on {blocks_of}'s blocks as oomtune wrapped them (its "
                           f"blocks() hook, or its nn.ModuleList), not the model's own switch; {_OWN_BLOCKS[target]}")
    if optimizer_of and target == "torchtune":
        values.pop("optimizer.fused", None)  # (oomtune's default AdamW's, not the model file's optimizer's)
    if optimizer_of and target in _OWN_OPTIMIZER:
        unexpressed.append(f"optimizer: {optimizer_of}'s own optimizer(), which the plan was measured with; "
                           f"{_OWN_OPTIMIZER[target]}")
    if loss_of and target == "hf":  # (Lightning's training_step, Accelerate's loop and torchtune's recipe: yours)
        unexpressed.append(f"loss: {loss_of}'s own loss(), which the plan was measured with; Trainer computes the "
                           "model's own (outputs.loss): pass yours as Trainer(compute_loss_func=...)")
    yours = [line for line in unexpressed if line.startswith(_IN_YOUR_CODE)]
    if target == "hf":
        yours += _hf_model_configs(plan, model)
        unexpressed = [line for line in unexpressed if not (line.startswith("nf4_frozen_weights: ") and
                                                            any(y.startswith("nf4_frozen_weights: ") for y in yours))]
    return Export(target, values, tuple(line for line in unexpressed if line not in yours), tuple(yours))


def _hf_model_configs(plan: Plan, model: ModelSection | None) -> list[str]:
    """The PEFT LoraConfig of the config's LoRA, and the BitsAndBytesConfig of an NF4 plan (its compute dtype the
    plan's precision; double quantization, as torchao's NF4 quantizes its scales), as Python to paste."""
    out = []
    lora = model.lora if model is not None else None
    if lora is not None:
        args = [f"r={lora.r}", f"lora_alpha={2 * lora.r if lora.alpha is None else lora.alpha:g}",
                f"lora_dropout={lora.dropout:g}", f"target_modules={list(lora.targets) or None}"]
        args += [f"task_type={PEFT_TASKS[model.task]!r}"] if model.task is not None else []
        out.append(f"lora: peft.get_peft_model(model, LoraConfig({', '.join(args)}))")
    if plan.nf4_frozen_weights:
        compute = {"fp32": "float32", "fp16": "float16"}.get(plan.precision, "bfloat16")
        out.append("nf4_frozen_weights: from_pretrained(..., quantization_config=BitsAndBytesConfig(load_in_4bit=True, "
                   f"bnb_4bit_quant_type='nf4', bnb_4bit_use_double_quant=True, bnb_4bit_compute_dtype=torch.{compute}"
                   "))" + (", then the LoRA adapters" if lora is None else ", before the LoRA adapters"))
    return out


def defines(model_path: str | Path, name: str) -> bool:
    """Whether the model file binds `name` (a hook: optimizer, blocks) at its top level (a def, an assignment, an
    import), read with `ast`: the file is not run (no torch, nothing it prints lands in the export). A file that is
    missing, unreadable or not Python is False: export never fails on it."""
    p = Path(model_path)
    if p.suffix != ".py":
        return False
    try:
        stack = list(ast.parse(p.read_bytes()).body)
    except (OSError, SyntaxError, ValueError, RecursionError, MemoryError):
        return False
    while stack:  # top-level statements, and those inside if / try / with / for / while at the top level
        node = stack.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            if node.name == name:
                return True
            continue
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            if any((a.asname or a.name.split(".")[0]) == name for a in node.names):
                return True
        elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            if any(isinstance(n, ast.Name) and n.id == name for t in targets for n in ast.walk(t)):
                return True
        for attr in ("body", "orelse", "finalbody", "handlers"):
            stack.extend(getattr(node, attr, None) or [])
    return False


def _common_unexpressed(plan: Plan, where: str) -> list[str]:
    """What none of these trainers' arguments hold: the context (a data-side length) and the weights' format."""
    # (context 1: a model with no sequence, images: nothing of the data's length to set)
    out = [f"context_length: {plan.context_length} is your data's sequence length ({where})"] \
        if plan.context_length > 1 else []
    if plan.nf4_frozen_weights:
        out.append("nf4_frozen_weights: load the base model in 4-bit NF4 (transformers' BitsAndBytesConfig("
                   "load_in_4bit=True, bnb_4bit_quant_type='nf4'), or torchao's to_nf4), then add the LoRA adapters")
    return out


def _hf(plan: Plan) -> tuple[dict, list[str]]:
    kw = {"per_device_train_batch_size": plan.micro_batch_size,
          "gradient_accumulation_steps": plan.grad_accum_steps,
          "bf16": plan.precision == "bf16", "fp16": plan.precision == "fp16",
          _hf_checkpointing_key(): plan.activation_checkpointing,
          "optim": "adamw_torch_8bit" if plan.optimizer_8bit else "adamw_torch_fused"}  # (oomtune's default AdamW)
    if plan.compile:
        kw["torch_compile"] = True  # (the whole model, where oomtune compiles each block: close in memory)
    out = _common_unexpressed(plan, "the tokenizer's max_length; TRL's SFTConfig(max_length=...)")
    if plan.sharding == "fsdp":
        kw["fsdp"] = "full_shard auto_wrap"
    if plan.precision == "bf16-true":
        out.append("precision: bf16-true is the model loaded in bf16 (from_pretrained(..., torch_dtype="
                   "torch.bfloat16)) with bf16=False: TrainingArguments has no flag for it")
    out += _when(plan, chunked_loss=CHUNKED_YOURS, optimizer_in_backward=IN_BACKWARD_YOURS,
                 offload_optimizer="TrainingArguments cannot; use DeepSpeed ZeRO with offload_optimizer "
                                         "(deepspeed=...) or FSDP's cpu offload",
                 offload_activations="TrainingArguments cannot; wrap the model's forward in "
                                     "torch.autograd.graph.save_on_cpu()")
    if plan.world_size > 1:
        out.append(f"world_size: {plan.world_size} ranks are the launch's: torchrun --nproc-per-node "
                   f"{plan.world_size}")
    return kw, out


@cache
def _hf_checkpointing_key() -> str:
    """`activation_checkpointing` where the installed transformers' TrainingArguments has it (it deprecates the old
    name), else `gradient_checkpointing` (every version since 4.11). Read from its source with `ast`: importing
    transformers would import torch."""
    try:
        spec = importlib.util.find_spec("transformers")
        source = Path(spec.submodule_search_locations[0], "training_args.py") if spec else None
        tree = ast.parse(source.read_bytes()) if source is not None else None
    except (OSError, SyntaxError, ValueError, TypeError, IndexError, ImportError):
        tree = None
    for node in tree.body if tree is not None else ():
        if isinstance(node, ast.ClassDef) and node.name == "TrainingArguments":
            if any(isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)
                   and n.target.id == "activation_checkpointing" for n in node.body):
                return "activation_checkpointing"
    return "gradient_checkpointing"


_LIGHTNING_PRECISION = {"fp32": "32-true", "bf16": "bf16-mixed", "fp16": "16-mixed", "bf16-true": "bf16-true"}


def _lightning(plan: Plan) -> tuple[dict, list[str]]:
    strategy = {"none": "auto", "ddp": "ddp", "fsdp": "fsdp"}[plan.sharding]
    trainer = {"precision": _LIGHTNING_PRECISION[plan.precision], "accumulate_grad_batches": plan.grad_accum_steps,
               "strategy": strategy, "devices": plan.world_size}
    out = _common_unexpressed(plan, "your LightningDataModule's")
    out += _when(plan, activation_checkpointing="the Trainer takes it only through FSDPStrategy("
                                                "activation_checkpointing_policy=...); otherwise call "
                                                "torch.utils.checkpoint in your module (or "
                                                "model.gradient_checkpointing_enable())",
                 optimizer_8bit="return torchao.optim.AdamW8bit (or bitsandbytes' AdamW8bit) from "
                                "configure_optimizers",
                 offload_optimizer="the Trainer takes it only through DeepSpeedStrategy(offload_optimizer=True)",
                 offload_activations="wrap training_step's forward in torch.autograd.graph.save_on_cpu()",
                 chunked_loss=CHUNKED_YOURS, optimizer_in_backward=IN_BACKWARD_YOURS, compile=COMPILE_YOURS)
    return {"trainer": trainer, "dataloader": {"batch_size": plan.micro_batch_size}}, out


def _accelerate(plan: Plan) -> tuple[dict, list[str]]:
    mixed = {"fp32": "no", "bf16": "bf16", "fp16": "fp16", "bf16-true": "no"}[plan.precision]
    cfg = {"compute_environment": "LOCAL_MACHINE", "distributed_type": {"none": "NO", "ddp": "MULTI_GPU",
                                                                        "fsdp": "FSDP"}[plan.sharding],
           "mixed_precision": mixed, "num_processes": plan.world_size, "num_machines": 1, "machine_rank": 0,
           "use_cpu": False}
    if plan.sharding == "fsdp":
        cfg["fsdp_config"] = {"fsdp_sharding_strategy": "FULL_SHARD",
                              "fsdp_auto_wrap_policy": "TRANSFORMER_BASED_WRAP",
                              "fsdp_activation_checkpointing": plan.activation_checkpointing,
                              "fsdp_offload_params": False, "fsdp_state_dict_type": "SHARDED_STATE_DICT"}
    out = _common_unexpressed(plan, "your DataLoader's")
    out.append(f"micro_batch_size: {plan.micro_batch_size} is your DataLoader's batch_size (per process)")
    if plan.grad_accum_steps > 1:
        out.append(f"grad_accum_steps: {plan.grad_accum_steps} is Accelerator(gradient_accumulation_steps="
                   f"{plan.grad_accum_steps}) with `with accelerator.accumulate(model):` (the config file has no key "
                   "for it outside DeepSpeed)")
    if plan.activation_checkpointing and plan.sharding != "fsdp":
        out.append("activation_checkpointing: the config takes it only with FSDP; call "
                   "model.gradient_checkpointing_enable() (or torch.utils.checkpoint)")
    if plan.precision == "bf16-true":
        out.append("precision: bf16-true is the model and optimizer in bf16 (model.to(torch.bfloat16)), "
                   "mixed_precision: no")
    out += _when(plan, optimizer_8bit="create torchao.optim.AdamW8bit (or bitsandbytes' AdamW8bit) and pass it to "
                                      "accelerator.prepare",
                 offload_optimizer="the config takes it only through DeepSpeed (offload_optimizer_device: cpu)",
                 offload_activations="wrap the forward in torch.autograd.graph.save_on_cpu()",
                 chunked_loss=CHUNKED_YOURS, optimizer_in_backward=IN_BACKWARD_YOURS, compile=COMPILE_YOURS)
    return cfg, out


def _torchtune(plan: Plan) -> tuple[dict, list[str]]:
    dtype = {"fp32": "fp32", "bf16-true": "bf16"}.get(plan.precision)
    kw = {"batch_size": plan.micro_batch_size, "gradient_accumulation_steps": plan.grad_accum_steps,
          "enable_activation_checkpointing": plan.activation_checkpointing,
          "enable_activation_offloading": plan.offload_activations,
          "tokenizer.max_seq_len": plan.context_length,
          "optimizer._component_": "torchao.optim.AdamW8bit" if plan.optimizer_8bit else "torch.optim.AdamW"}
    if not plan.optimizer_8bit:
        kw["optimizer.fused"] = True  # oomtune's default AdamW, as the plan was measured
    if plan.chunked_loss:
        kw["loss._component_"] = "torchtune.modules.loss.CEWithChunkedOutputLoss"
    if plan.optimizer_in_backward:  # (its single-device recipes: no accumulation, no clipping, as the plan)
        kw.update({"optimizer_in_bwd": True, "clip_grad_norm": None})
    if plan.compile:
        kw["compile"] = True  # (each layer and the loss: as oomtune compiles)
    out: list[str] = []
    if dtype is not None:
        kw["dtype"] = dtype
    else:
        out.append(f"precision: {plan.precision} is autocast; torchtune's recipes train in one dtype "
                   "(dtype=bf16 keeps the weights in bf16, which is the bf16-true rung, not this one)")
    if plan.offload_optimizer:  # one process only (the plan refuses it with fsdp): single-device recipes
        out.append("offload_optimizer: torchtune offloads with fsdp_cpu_offload in its distributed recipes; "
                   "single-device recipes have optimizer_in_bwd instead")
    if plan.nf4_frozen_weights:
        out.append("nf4_frozen_weights: use the model's qlora_ builder (model._component_=torchtune.models...."
                   "qlora_...)")
    if plan.offload_activations and not plan.activation_checkpointing:
        out.append("offload_activations: torchtune's recipes offload activations only with "
                   "enable_activation_checkpointing=true, which this plan does not use")
    return kw, out


CHUNKED_YOURS = ("compute the loss yourself: the model's logits (no labels passed) in 8 slices of the sequence, "
                 "each upcast to fp32 and summed with F.cross_entropy(..., reduction='sum'), over the tokens counted")


IN_BACKWARD_YOURS = ("step the optimizer in backward yourself: register_post_accumulate_grad_hook on each trained "
                     "parameter, calling optimizer.step() and setting the gradient to None; no accumulation or "
                     "clipping")


COMPILE_YOURS = "compile each block (transformer layer) yourself, block.compile(), and the loss with torch.compile"


def _when(plan: Plan, **notes: str) -> list[str]:
    """`key: note` for each plan key that is on."""
    return [f"{key}: {note}" for key, note in notes.items() if getattr(plan, key)]


def _override(v) -> str:
    return "null" if v is None else str(v).lower() if isinstance(v, bool) else str(v)  # (tune run's YAML values)
