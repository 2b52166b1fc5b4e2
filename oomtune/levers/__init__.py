"""The levers past gradient accumulation, built as a plan says: bf16-true weights, 8-bit AdamW state, NF4 frozen
weights, the optimizer offloaded to host memory, saved activations offloaded to host memory. `step.build_training`
and the training step call these, and nothing else builds them, so a trial measures what training runs.

A lever whose library is missing (`missing_library`) is left out of the ladder with a note; a config that asks
for it is one line naming the extra that brings it."""

from __future__ import annotations

import contextlib
import importlib.util
from collections.abc import Sequence

import torch
from torch import nn

from ..errors import BAD_INPUT, OomtuneError
from ..memory.on_host import CudaOnHost

EXTRA = "pip install 'oomtune[finetune]'"
LIBRARY_LEVERS = ("optimizer_8bit", "nf4_frozen_weights")


def installed(name: str) -> bool:
    return importlib.util.find_spec(name) is not None


def missing_library(lever: str, device_kind: str) -> str | None:
    """Why `lever` cannot run on `device_kind` here (the library it needs is not installed), or None. The cpu and
    fake devices run 8-bit AdamW with oomtune's own stand-in, so only cuda needs a library for it."""
    if lever == "nf4_frozen_weights" and not installed("torchao"):
        return f"NF4 frozen weights need torchao ({EXTRA})"
    if lever == "optimizer_8bit" and device_kind == "cuda" and not (installed("torchao") or installed("bitsandbytes")):
        return f"8-bit AdamW on cuda needs torchao or bitsandbytes ({EXTRA})"
    return None


def check_plan_runs(plan, device_kind: str) -> None:
    """One line, exit 2, for a plan whose levers' libraries are missing here (one whose levers cannot apply to the
    model file's own optimizer: make_optimizer)."""
    for lever in LIBRARY_LEVERS:
        if lever == "optimizer_8bit" and plan.offload_optimizer:
            continue  # offloaded, 8-bit AdamW is the stand-in on the host (make_optimizer): no library
        why = getattr(plan, lever) and missing_library(lever, device_kind)
        if why:
            raise OomtuneError(f"plan.{lever}: {why}", BAD_INPUT)


def build_model(model_file, plan, device) -> nn.Module:
    """The model file's model on `device`, its weights as the plan's levers store them.

    bf16-true builds it with bf16 as the default dtype (Lightning's way: no fp32 copy of the weights is ever made).
    NF4 builds it in host memory, stores the frozen Linear weights in 4 bits there, then moves it to the device,
    as loading a quantized checkpoint does: the device never holds the unquantized weights."""
    dtype = _default_dtype(torch.bfloat16) if plan.precision == "bf16-true" else contextlib.nullcontext()
    four_bit = four_bit_of(model_file, plan)
    if plan.nf4_frozen_weights or four_bit:
        with dtype, device.host(), torch.device("cpu"), CudaOnHost():  # (its own .to("cuda") too: quantized first)
            model = model_file.build()
            prepare_model(model, plan, model_file.label, device.computes, four_bit)
        relocate(model, device)
        return model
    with dtype, device.placement():
        model = model_file.build()
    if any(t.device != device.torch_device for t in (*model.parameters(), *model.buffers())):
        model.to(device.torch_device)  # anything build_model placed explicitly elsewhere (`.to("cuda")`)
    prepare_model(model, plan, model_file.label)
    return model


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype):
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


def relocate(model: nn.Module, device) -> None:
    """Move a model built in host memory to the device. On cuda, `.to()`; on the simulated devices, whose host and
    device are both the CPU, a copy of every parameter and buffer made outside `host()`, so the tracker counts
    it on the device (and the host copy is freed). Tied parameters stay tied."""
    if device.kind == "cuda":
        model.to(device.torch_device)
        return
    moved: dict[int, nn.Parameter] = {}
    for module in model.modules():
        for name, p in list(module._parameters.items()):
            if p is not None:
                if id(p) not in moved:
                    moved[id(p)] = nn.Parameter(_copy(p.detach()), requires_grad=p.requires_grad)
                module._parameters[name] = moved[id(p)]
        for name, b in list(module._buffers.items()):
            if b is not None:
                module._buffers[name] = _copy(b)


def _copy(t: torch.Tensor) -> torch.Tensor:
    """A new tensor with t's values in new storage; a wrapper subclass (NF4) is copied through its inner tensors."""
    from torch.utils._python_dispatch import is_traceable_wrapper_subclass

    if is_traceable_wrapper_subclass(t):
        names, ctx = t.__tensor_flatten__()
        inner = {n: _copy(getattr(t, n)) for n in names}
        return type(t).__tensor_unflatten__(inner, ctx, t.size(), t.stride())
    return t.clone()


def prepare_model(model: nn.Module, plan, label: str, computes: bool = True, four_bit=None) -> None:
    """bf16-true: every floating weight and buffer in bf16 (but NF4 weights the model file made: as made), unless
    every trained weight is bf16 as built (under bf16 as the default dtype, or by the model file: a config saying
    torch_dtype bfloat16), where what the model keeps in fp32 stays so, as Hugging Face's own bf16 loading keeps it
    (the rotary frequencies: in bf16 every position's angle would drift). 4-bit: the layout the model file declares
    (`four_bit`, nf4_bnb.py: on every plan, `plan` None too), else the NF4 lever's, every frozen Linear weight in
    torchao's NF4 (`computes` False: tensors without values, see nf4.quantize_frozen)."""
    trained = {p.dtype for p in model.parameters() if p.requires_grad and p.is_floating_point()}
    if plan is not None and plan.precision == "bf16-true" and trained != {torch.bfloat16}:
        _cast_but_nf4(model)
    if four_bit is not None:
        from ..model_file import is_compiled
        from .nf4_bnb import is_bnb_4bit, quantize_declared

        if is_compiled(model):
            raise OomtuneError(f"{label}: build_model() compiles a model whose weights its {four_bit.source} "
                               "stores in 4 bits: torch.compile cannot trace bitsandbytes' dequantization here yet "
                               "(return the model uncompiled)", BAD_INPUT)
        if quantize_declared(model, four_bit, computes) == 0 and not any(map(is_bnb_4bit, model.modules())):
            raise OomtuneError(f"{label}: {four_bit.source} quantizes frozen nn.Linear weights, and the model has "
                               "none (the base layers of a PEFT LoRA model: add --lora-r, or adapters in "
                               "build_model)", BAD_INPUT)
    elif plan is not None and plan.nf4_frozen_weights:
        from .nf4 import quantize_frozen

        if quantize_frozen(model, computes) == 0:
            raise OomtuneError(f"plan.nf4_frozen_weights: {label} has no frozen nn.Linear (or Conv1D) weight to "
                               "store in NF4 (it applies to the base layers of a PEFT LoRA model whose forward is "
                               "nn.Linear's: a subclass with its own, Falcon's FalconLinear, is left as it is)",
                               BAD_INPUT)


def four_bit_of(model_file, plan=None):
    """The bitsandbytes 4-bit layout the model file or Hugging Face folder declares (nf4_bnb.Bnb4bit), or None;
    one line, exit 2, where bitsandbytes is missing or the plan asks what cannot run with it."""
    from .nf4_bnb import OLDEST, declared, too_old

    four_bit = declared(model_file.module)
    if four_bit is None:
        return None
    what = f"{model_file.label} declares {four_bit.name} weights ({four_bit.source})"
    if not installed("bitsandbytes"):
        raise OomtuneError(f"{what}: they need bitsandbytes ({EXTRA})", BAD_INPUT)
    if (old := too_old()) is not None:
        raise OomtuneError(f"{what}: bitsandbytes {old} is installed, and oomtune models bitsandbytes "
                           f"{'.'.join(map(str, OLDEST))} or later (an older one runs no 4-bit kernels off the GPU, "
                           f"and before 0.43.2 kept each 4-bit layer's input for backward): upgrade it ({EXTRA})",
                           BAD_INPUT)
    clash = plan is not None and (
        plan.sharding != "none" and f"they run on one process only, not with plan.sharding {plan.sharding}"
        or plan.nf4_frozen_weights and "plan.nf4_frozen_weights (torchao's NF4) has nothing left to store: drop it"
        or plan.compile and "plan.compile cannot trace bitsandbytes' dequantization yet: drop it")
    if clash:
        raise OomtuneError(f"{what}: {clash}", BAD_INPUT)
    return four_bit


def _cast_but_nf4(model: nn.Module) -> None:
    """model.to(bf16) (the model's own `to`: a Hugging Face model's checks included), with the NF4 weights a model
    file made left as made: they are taken out of their modules around it (on fake tensors `.to` turned them into
    plain bf16 weights, 4x their size)."""
    from ..memory.made_nf4 import is_nf4

    kept = [(m, name, p) for m in model.modules() for name, p in m._parameters.items() if p is not None and is_nf4(p)]
    for m, name, _ in kept:
        m._parameters[name] = None
    try:
        model.to(torch.bfloat16)
    finally:
        for m, name, p in kept:
            m._parameters[name] = p


def make_optimizer(model_file, params: Sequence[nn.Parameter], lr: float, model: nn.Module, plan, device):
    """The model file's optimizer (the default AdamW where it has none); for the 8-bit / offload levers, made so over
    its param groups and their hyper-parameters (own_optimizer.py: a class they cannot rebuild is one line, exit 2)."""
    if not (plan.optimizer_8bit or plan.offload_optimizer):
        return model_file.optimizer(params, lr, model)
    from .own_optimizer import blocked, group_settings, rebuilt

    check_plan_runs(plan, device.kind)
    optimizer = model_file.optimizer(params, lr, model)
    for key in ("optimizer_8bit", "offload_optimizer"):
        why = getattr(plan, key) and blocked(optimizer, key)
        if why:
            raise OomtuneError(f"plan.{key}: {model_file.label}'s optimizer() {why} (remove the key)", BAD_INPUT)
    groups, cls = group_settings(optimizer, eight_bit=plan.optimizer_8bit), type(optimizer)
    del optimizer  # (a fresh one: no state)
    if plan.optimizer_8bit:
        from .adamw8bit import BlockwiseAdamW8bit, library_adamw8bit

        # offloaded, the state and step are in host memory: oomtune's eager stand-in there (torchao's state layout),
        # not the library's compiled step, which would need inductor's C++ toolchain for CPU and, on an H200 with
        # torch 2.11, broke the compiled GPU step of every model trained after it in the process (make gpu-check)
        on_gpu = device.kind == "cuda" and not plan.offload_optimizer
        cls = library_adamw8bit() if on_gpu else BlockwiseAdamW8bit
    make = rebuilt(groups, cls)
    ordered = [p for g in groups for p in g["params"]]
    if plan.offload_optimizer:
        from .offload import HostOffloadOptimizer

        return HostOffloadOptimizer(ordered, make, device)
    return make(ordered)


def model_state(model: nn.Module) -> dict:
    """The model's state dict as a checkpoint keeps it: 4-bit frozen weights (torchao's NF4, bitsandbytes' layout)
    left out (they are rebuilt from the model file, which the trainer seeds alike on every build)."""
    left_out = _four_bit_keys(model)
    return {k: v for k, v in model.state_dict().items() if k not in left_out}


def load_model_state(model: nn.Module, state: dict) -> None:
    """Load a checkpoint's model state (model_state's): strict, except for the 4-bit weights it leaves out."""
    left_out = _four_bit_keys(model)
    missing, unexpected = model.load_state_dict({k: v for k, v in state.items() if k not in left_out},
                                                strict=not left_out)
    if set(missing) - left_out or unexpected:
        raise KeyError(f"model state: missing {sorted(set(missing) - left_out)[:1]}, unexpected {unexpected[:1]}")


def _four_bit_keys(model: nn.Module) -> set[str]:
    from ..memory.made_nf4 import is_nf4

    return ({k for k, v in model.state_dict().items() if is_nf4(v)}
            | {f"{name}.weight" if name else "weight" for name, m in model.named_modules() if hasattr(m, "bnb_4bit")})


def cast_inputs(batch, plan):
    """bf16-true: the batch's floating-point tensors in bf16, as the weights are (Lightning's convert_input); token
    ids and masks stay as they are. Any other plan: the batch itself."""
    if plan.precision != "bf16-true":
        return batch
    from torch.utils._pytree import tree_map

    return tree_map(lambda x: x.to(torch.bfloat16) if isinstance(x, torch.Tensor) and x.is_floating_point() else x,
                    batch)


def saved_activations(plan, device) -> contextlib.AbstractContextManager:
    """Where the forward's saved tensors go: host memory under offload_activations, else nowhere special."""
    if not plan.offload_activations:
        return contextlib.nullcontext()
    from .offload import activations_on_host

    return activations_on_host(device)


def gradient_holders(optimizer, model: nn.Module) -> list[torch.Tensor]:
    """The tensors whose .grad clipping must read: the host copies under offload, else the model's parameters."""
    holders = getattr(optimizer, "gradient_holders", None)
    return holders() if holders is not None else list(model.parameters())
