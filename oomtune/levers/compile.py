"""torch.compile as a plan's lever (plan.compile): each block compiled alone, and the loss, as torchtune compiles a
model (`compile_model`, `compile_loss`). On cuda torch itself compiles them (inductor); on the cpu and fake devices,
where Dynamo does not run under the memory tracker, each is a `memory.compiled.CompiledCall`: traced by AOTAutograd,
its saved tensors chosen by the min-cut partitioner, its fused kernels' intermediates never in memory. Checkpointing
wraps the compiled block (recomputed in backward, as a compiled checkpointed layer is)."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from ..memory.compiled import CompiledCall, fallbacks


def compiled(name: str, call: Callable, device_kind: str, module: nn.Module | None = None) -> Callable:
    """`call` compiled: torch.compile on cuda, a CompiledCall on the simulated devices."""
    if device_kind == "cuda":
        return torch.compile(call)
    return CompiledCall(name, call, module)


def _own_forward(block: nn.Module) -> Callable:
    """The block's forward without transformers' checkpointing wrapper (its GradientCheckpointingLayer's class
    forward checkpoints inside): a compiled block is checkpointed from outside (model_file.enable_checkpointing)."""
    forward = type(block).forward
    if any(c.__name__ == "GradientCheckpointingLayer" for c in type(block).__mro__) and hasattr(forward, "__wrapped__"):
        forward = forward.__wrapped__
    return forward.__get__(block) if "forward" not in vars(block) else block.forward


def compile_model(model_file, model: nn.Module, device_kind: str) -> None:
    """Each of the model file's blocks compiled in place (before checkpointing wraps them), and a Hugging Face
    model's own loss function where it has one."""
    if device_kind == "cuda":  # each trial's model compiled afresh: past Dynamo's recompile limit it would run eager
        torch._dynamo.reset()
    blocks = model_file.blocks(model)
    if not blocks:
        fallbacks["blocks"] = f"{model_file.label} has none (define blocks(model)): only the loss is compiled"
    for i, block in enumerate(blocks):
        if device_kind == "cuda":
            block.compile()
        else:
            block.forward = CompiledCall(f"block {i} ({type(block).__name__})", _own_forward(block), block)
    base = model.get_base_model() if callable(getattr(model, "get_base_model", None)) else model
    loss = getattr(type(base), "loss_function", None)
    if isinstance(loss, property) and loss.fset is not None:  # (transformers' PreTrainedModel)
        base.loss_function = compiled("the loss", base.loss_function, device_kind)


def compiled_by_the_model_file(model: nn.Module) -> list[nn.Module]:
    """The modules build_model() compiled itself: torch.compile(module) (an OptimizedModule) or module.compile()."""
    return [m for m in model.modules()
            if type(m).__name__ == "OptimizedModule" or getattr(m, "_compiled_call_impl", None) is not None]


PER_BLOCK, WHOLE = "per block", "whole"  # how trace_own_compile traced a model the model file compiled
TRACED_OWN = "_oomtune_traced_own_compile"  # on a model so traced: model_file.is_compiled still says it is


def trace_own_compile(model_file, model: nn.Module, per_block: bool = False) -> str:
    """On the simulated devices, where Dynamo runs nothing under the memory tracker (a torch.compile'd model runs
    eager there), what the model file compiled itself is traced as `--compile` traces (CompiledCall: AOTAutograd's
    partition, inductor's fusions): per block, and the loss, where every block lies inside a module it compiled,
    or `per_block` (the plan's --compile too), as torchtune compiles (a whole-model graph of a transformers model
    leaks its tracing tensors into the model's caches); else each outermost module it compiled, whole (a part of the
    model, a model without blocks: a compiled module inside it is part of its graph). Returns how (PER_BLOCK:
    checkpointing then wraps the compiled blocks, as under --compile). (On cuda torch.compile runs as asked.)"""
    own = compiled_by_the_model_file(model)
    for m in own:  # Dynamo's wrappers taken off (inside one, AOTAutograd's tracing cannot read fake tensors)
        if type(m).__name__ == "OptimizedModule":
            m.forward = m._orig_mod.__call__
        else:
            m._compiled_call_impl = None
    object.__setattr__(model, TRACED_OWN, True)
    blocks = model_file.blocks(model)
    if blocks and (per_block or all(any(b is x for m in own for x in m.modules()) for b in blocks)):
        compile_model(model_file, model, "cpu")
        return PER_BLOCK
    for m in own:
        if any(o is not m and any(m is x for x in o.modules()) for o in own):
            continue  # (inside another compiled module: traced as part of it)
        inner = m._orig_mod if type(m).__name__ == "OptimizedModule" else m
        call = CompiledCall(f"{model_file.label}'s compiled {type(inner).__name__}", inner._call_impl, inner)
        if inner is m:
            m._compiled_call_impl = call
        else:
            m.forward = call
    return WHOLE
