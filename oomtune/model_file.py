"""Load a user's model file by path, check it keeps the contract, and fill in the default hooks.

Required: build_model() and make_batch(batch_size, context_length, device).
Optional: loss(model, batch), blocks(model), optimizer(params, lr), train_batches(...), eval_batches(...),
DEFAULTS = {"batch": ..., "context": ...}. A missing hook means the default, never an error.
Every call into user code goes through `_call`, so a user's bug becomes one line naming the file and the
hook, while an out-of-memory error passes through untouched for the search to catch.
"""

from __future__ import annotations

import importlib.util
import inspect
import reprlib
import sys
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_leaves

from .checkpointing import (
    block_stacks,
    buffers_kept,
    callable_blocks,
    cannot_checkpoint,
    checkpointed,
    enable_hf_checkpointing,
    hf_checkpointing,
)
from .config.schema import ModelSection
from .errors import ModelFileError, OomtuneError, first_line
from .hook_names import REQUIRED, batch_taken, did_you_mean, not_a_loss
from .memory.devices import is_oom
from .memory.host_kernels import host_hint
from .model_import import neighbours_first

Batch = Any  # a Tensor, a tuple/list of Tensors, or a dict of str -> Tensor (nested: their leaves)
DEFAULT_KEYS = {"batch", "context", "min_context"}
_FUSED_DEVICES = ("cuda", "cpu", "xpu", "mps", "hpu")  # torch's fused AdamW kernels (_get_fused_kernels_supported...)


def default_adamw(params: Sequence[nn.Parameter], lr: float) -> torch.optim.Optimizer:
    """AdamW where the model file has no optimizer(), fused where torch has that kernel for every parameter (one kernel
    a step, no parameter-sized scratch: foreach AdamW, torch's choice on CUDA, holds one), as Hugging Face's Trainer
    (torch >= 2.8) and torchtune's recipes run it by default."""
    fused = all(p.is_floating_point() and p.device.type in _FUSED_DEVICES for p in params)  # (torch checks only at
    return torch.optim.AdamW(params, lr=lr, fused=True if fused else None)  # the first step, raising)


@dataclass
class ModelFile:
    path: Path
    module: ModuleType
    defaults: dict[str, int] = field(default_factory=dict)
    args: dict[str, Any] | None = None  # build_model(**args): the file's ARGS with --model-arg's values (None: no ARGS)
    section: ModelSection | None = None  # what a config records of it (None: an object no config can name)
    max_context: int | None = None  # MAX_CONTEXT: the longest context the model takes (a Hugging Face model's)

    # -- plumbing --------------------------------------------------------------------------------
    @property
    def label(self) -> str:
        return self.path.name

    def has(self, hook: str) -> bool:
        return callable(getattr(self.module, hook, None))

    def _call(self, hook: str, *args, **kwargs):
        fn = getattr(self.module, hook)
        with self.user_code(f"{hook}()"):
            return fn(*args, **kwargs)

    @contextmanager
    def user_code(self, what: str):
        """Run user code: its error (or sys.exit) -> one ModelFileError line naming `what`; OOM passes through."""
        try:
            yield
        except OomtuneError:
            raise
        except SystemExit as e:  # would exit with the file's code (3 reads as PEER_FAILED) or print its message
            raise ModelFileError(f"{self.label}: {what} called {_exit_call(e)}") from e
        except Exception as e:
            if is_oom(e):
                raise
            error = ModelFileError(f"{self.label}: {what} raised {_raised(e)}{host_hint(e)}")
            error.raised = True
            raise error from e

    def fail(self, hook: str, what: str) -> ModelFileError:
        return ModelFileError(f"{self.label}: {hook}() {what}")

    # -- the hooks -------------------------------------------------------------------------------
    def build(self) -> nn.Module:
        model = self._call("build_model", **(self.args or {}))
        if not isinstance(model, nn.Module):
            raise self.fail("build_model", f"returned {type(model).__name__}; expected a torch.nn.Module")
        if self.section is not None and self.section.lora is not None:
            from .models.lora import with_lora

            model = with_lora(model, self.section.lora, self.section.task, self.label)
        if not any(p.requires_grad for p in model.parameters()):
            raise self.fail("build_model", "returned a model with no trainable parameters")
        if any(p.device.type == "meta" for p in model.parameters()):  # (a fake tensor's device is the cpu)
            raise self.fail("build_model", "returned a model with weights on the meta device, which hold no data: "
                            "build it on a real device (or call to_empty() and initialize it)")
        sparse = [n for n, m in model.named_modules()
                  if isinstance(m, (nn.Embedding, nn.EmbeddingBag)) and m.sparse and m.weight.requires_grad]
        if sparse:
            raise self.fail("build_model", f"returned a model whose {sparse[0] or 'embedding'} has sparse=True: sparse "
                            "gradients are not supported (the training step clips the gradients' norm, and the memory "
                            "levers need dense ones): build it with sparse=False")
        return model

    def batch(self, batch_size: int, context_length: int, device: torch.device) -> Batch:
        batch = self._call("make_batch", batch_size, context_length, device)
        self.check_batch("make_batch", batch, device)
        return batch

    def sample_tensors(self, context_length: int, batch_size: int = 1) -> tuple[list[torch.Tensor], bool] | None:
        """The tensors of make_batch(batch_size, context_length), and whether they were asked for on PyTorch's meta
        device (nothing allocated; else, where it cannot run there because it reads values or calls .cuda(), the
        cpu, for one or two sequences): what shapes and devices it makes. None where it cannot run on either."""
        for device in (torch.device("meta"), torch.device("cpu")):
            try:
                batch = self.module.make_batch(batch_size, context_length, device)
            except (Exception, SystemExit):
                continue
            return [t for t in tree_leaves(batch) if isinstance(t, torch.Tensor)], device.type == "meta"
        return None

    def check_batch(self, hook: str, batch: Batch, device: torch.device) -> None:
        if isinstance(batch, (tuple, list, dict)) and not batch:
            raise self.fail(hook, f"returned an empty {type(batch).__name__}")
        if isinstance(batch, torch.Tensor):
            tensors = [batch]
        elif isinstance(batch, (tuple, list)) and all(isinstance(t, torch.Tensor) for t in tree_leaves(batch)):
            tensors = tree_leaves(batch)  # (nested tuples, lists and dicts too: the step walks them as a tree)
        elif isinstance(batch, dict) and all(isinstance(k, str) for k in batch):
            tensors = [t for t in tree_leaves(batch) if isinstance(t, torch.Tensor)]
        else:
            raise self.fail(hook, f"returned {_describe(batch)}; expected a Tensor, a tuple/list of Tensors, or a "
                                  "dict of name -> Tensor")
        if not tensors:
            raise self.fail(hook, f"returned a {type(batch).__name__} with no tensors in it")
        for t in tensors:
            if t.device.type != device.type:
                raise self.fail(hook, f"returned a tensor on {t.device}; expected {device} (use its `device` "
                                      "argument)")

    def loss(self, model: nn.Module, batch: Batch) -> torch.Tensor:
        if self.has("loss"):
            value = self._call("loss", model, batch)
            where = "loss"
        else:
            value = self._default_loss(model, batch)
            near = did_you_mean(self.module, "loss", "; the file defines {}: misspelt?")
            where = f"the default loss (model output{near})"
        if not isinstance(value, torch.Tensor):
            raise ModelFileError(f"{self.label}: {where} gave {_describe(value)}; expected a scalar Tensor")
        if value.dim() != 0 and not self.has("loss"):
            raise ModelFileError(not_a_loss(self.label, value, batch, did_you_mean(self.module, "loss", "{}")))
        if value.dim() != 0:
            raise ModelFileError(f"{self.label}: {where} gave a tensor of shape {tuple(value.shape)}; expected a "
                                 "scalar (reduce it, e.g. .mean())")
        if torch.is_grad_enabled() and not value.requires_grad:
            raise ModelFileError(f"{self.label}: {where} does not require grad; is it computed from the model?")
        return value

    def _default_loss(self, model: nn.Module, batch: Batch) -> torch.Tensor:
        """model(*batch) / model(**batch) / model(batch) -> a scalar, (logits, loss), or an object with .loss."""
        with self.user_code("the model's forward"), batch_taken(self.label, model, batch):
            if isinstance(batch, dict):
                out = model(**batch)
            elif isinstance(batch, (tuple, list)):
                out = model(*batch)
            else:
                out = model(batch)
        if isinstance(out, torch.Tensor):
            return out
        if isinstance(out, (tuple, list)) and len(out) == 2 and isinstance(out[1], torch.Tensor):
            if out[1].dim() and isinstance(out[0], torch.Tensor) and not out[0].dim():
                raise ModelFileError(f"{self.label}: the model returned (a scalar, a tensor of shape "
                                     f"{tuple(out[1].shape)}): the default loss takes (logits, loss), the loss "
                                     "second; return them in that order, or define loss(model, batch)")
            return out[1]  # (logits, loss)
        loss = getattr(out, "loss", None)
        if loss is None and isinstance(out, dict):
            loss = out.get("loss")
        if isinstance(loss, torch.Tensor):
            return loss
        if loss is None and (hasattr(out, "loss") or isinstance(out, dict) and "loss" in out):
            raise ModelFileError(f"{self.label}: the model returned {_describe(out)} whose loss is None (a Hugging "
                                 "Face model computes it only when the batch has labels: add a 'labels' entry, or "
                                 "define loss(model, batch))")
        raise ModelFileError(
            f"{self.label}: the model returned {_describe(out)}; the default loss takes a scalar, "
            "(logits, loss) or an object with .loss — define loss(model, batch)" + did_you_mean(self.module, "loss")
        )

    def optimizer(self, params: Sequence[nn.Parameter], lr: float,
                  model: nn.Module | None = None) -> torch.optim.Optimizer:
        """The `optimizer` hook over the trainable `params`: called `optimizer(params, lr, model)` when its signature
        takes a third argument (nanoGPT's configure_optimizers groups parameters by name), else `(params, lr)`."""
        if not self.has("optimizer"):
            return default_adamw(params, lr)
        opt = self._call("optimizer", *((params, lr, model) if self._hook_takes_model() else (params, lr)))
        if not isinstance(opt, torch.optim.Optimizer):
            raise self.fail("optimizer", f"returned {_describe(opt)}; expected a torch.optim.Optimizer")
        if params and not {id(p) for g in opt.param_groups for p in g["params"]} & {id(p) for p in params}:
            raise self.fail("optimizer", f"returned an optimizer over none of the {len(params)} trained parameters "
                            "it was given (training would change nothing): build it over them")
        return opt

    def _hook_takes_model(self) -> bool:
        try:
            params = inspect.signature(self.module.optimizer).parameters.values()
        except (TypeError, ValueError):  # a builtin or a C function: its signature is unknown
            return False
        positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
        return len(positional) >= 3 or any(p.kind is p.VAR_POSITIONAL for p in params)

    def blocks(self, model: nn.Module) -> list[nn.Module]:
        """What activation checkpointing wraps: the `blocks` hook, else the members of `block_stacks(model)` (a member
        that cannot be called, a ModuleList of a layer's parts, stands for its parts: callable_blocks)."""
        if self.has("blocks"):
            return self._hooked_blocks(model)
        return [block for stack in block_stacks(model) for member in stack for block in callable_blocks(member)]

    def _hooked_blocks(self, model: nn.Module) -> list[nn.Module]:
        """The `blocks` hook's modules: an iterable of nn.Module, at least one (a defined hook that finds
        nothing is a mistake, not "no checkpointing")."""
        returned = self._call("blocks", model)
        if not isinstance(returned, Iterable):
            raise self.fail("blocks", f"returned {_describe(returned)}; expected an iterable of nn.Module (the "
                                      "blocks activation checkpointing wraps, e.g. model.layers)")
        with self.user_code("blocks()"):  # a generator runs user code as it is consumed
            found = list(returned)
        if not found:
            raise self.fail("blocks", f"returned an empty {type(returned).__name__}; expected at least one "
                                      "nn.Module to checkpoint (or remove blocks() for the default)")
        bad = next((b for b in found if not isinstance(b, nn.Module)), None)
        if bad is not None:
            raise self.fail("blocks", f"returned {_describe(bad)} among its items; expected only nn.Module "
                                      "objects")
        # checkpointing a module the forward never calls does nothing (fresh layers, another instance's blocks);
        # a compiled model's modules() include its _orig_mod's, which its attributes resolve to
        inside = {id(m) for m in model.modules()}
        stray = sum(id(b) not in inside for b in found)
        if stray:
            raise self.fail("blocks", f"returned modules that are not in the model ({stray} of {len(found)}): "
                                      "return submodules of the model it is given")
        if any(b is model or b is getattr(model, "_orig_mod", None) for b in found):
            raise self.fail("blocks", "returned the model itself: checkpointed whole, its backward recomputes the "
                                      "whole forward at once and saves nothing; return its repeated layers "
                                      "(e.g. model.layers)")
        return found

    def supports_checkpointing(self, model: nn.Module) -> bool:
        """Also validates a `blocks` hook, so static_memory (before any trial) rejects a bad one."""
        if self.has("blocks"):
            return bool(self._hooked_blocks(model))
        return hf_checkpointing(model) is not None or bool(self.blocks(model))

    def enable_checkpointing(self, model: nn.Module, wrap: bool = False) -> None:
        """Recompute each block's activations in backward instead of keeping them: Hugging Face models (PEFT-wrapped
        too) through their own switch, the rest (and every model, `wrap`: compiled blocks) by wrapping `blocks`."""
        enable = None if self.has("blocks") or wrap else hf_checkpointing(model)
        breaks = cannot_checkpoint(model) if enable is not None else None
        if breaks:  # (a plan written by hand, or before oomtune knew: its forward would fail with a shape error)
            raise ModelFileError(f"plan.activation_checkpointing: {self.label} cannot train checkpointed ({breaks}): "
                                 "set it to false")
        if enable is not None:
            with self.user_code(f"the model's {enable.__name__}()"):
                enable_hf_checkpointing(model, enable)
            return
        blocks = self.blocks(model)
        if not blocks:
            raise ModelFileError(
                f"{self.label}: activation checkpointing found no blocks (no nn.ModuleList of same-type "
                "modules); define blocks(model)"
            )
        for block in blocks:
            block.forward = checkpointed(block.forward, buffers_kept(block))

    def batches(self, hook: str, batch_size: int, context_length: int, device: torch.device) -> Iterator[Batch]:
        """The iterator of `hook` (train_batches / eval_batches, which the caller checked the file has)."""
        returned = self._call(hook, batch_size, context_length, device)
        try:
            return iter(returned)
        except TypeError:
            raise self.fail(hook, f"returned {reprlib.repr(returned)} ({type(returned).__name__}); expected an "
                                  "iterable of batches (a generator that yields them, or a list)") from None


def is_compiled(model: nn.Module) -> bool:
    """torch.compile(model) (an OptimizedModule) or model.compile(), on the model or any submodule (also once
    levers/compile.trace_own_compile traced it on a simulated device, which takes Dynamo's wrappers off)."""
    return any(type(m).__name__ == "OptimizedModule" or getattr(m, "_compiled_call_impl", None) is not None
               or m.__dict__.get("_oomtune_traced_own_compile", False) for m in model.modules())


def own_compile_note(label: str, device_kind: str, training: bool = False) -> str:
    """What a model build_model() compiled itself is on a simulated device, where Dynamo runs nothing under the
    memory tracker: traced as --compile traces (levers/compile.trace_own_compile)."""
    what = ("it trains through that trace here (torch.compile itself on --device cuda)" if training else
            "its memory is the compiled graph's as oomtune traces it, not measured from inductor's own (on --device "
            "cuda it is)")
    return (f"{label}: build_model() compiles its model (torch.compile); torch.compile does not run under the "
            f"{device_kind} device's memory tracker, so the model is traced as --compile traces (AOTAutograd's "
            f"partition, inductor's fusions; per block and the loss where what it compiled holds every block, else "
            f"each compiled part whole): {what}")


def _exit_call(e: SystemExit) -> str:
    return "sys.exit()" if e.code is None else f"sys.exit({e.code!r})"


def _raised(e: BaseException) -> str:
    return f"{type(e).__name__}: {first_line(e, '(no message)')}"


def _describe(x: Any) -> str:
    if isinstance(x, torch.Tensor):
        return f"a Tensor of shape {tuple(x.shape)}"
    if isinstance(x, (tuple, list)):
        inner = ", ".join("Tensor" if isinstance(v, torch.Tensor) else type(v).__name__ for v in x[:4])  # (fake)
        return f"a {type(x).__name__} of ({inner}{', ...' if len(x) > 4 else ''})"
    if x is None:
        return "None"
    name = type(x).__name__
    return f"{'an' if name[0].lower() in 'aeiou' else 'a'} {name}"


def load_model_file(path: str | Path) -> ModelFile:
    """Import a model file by path and check the contract; every problem is one ModelFileError line."""
    p = Path(path)
    if not p.exists():
        raise ModelFileError(f"model file not found: {p}")
    if not p.is_file() or p.suffix != ".py":
        raise ModelFileError(f"model file {p}: expected a Python file (.py)")
    name = f"oomtune_model_{abs(hash(str(p.resolve())))}"
    spec = importlib.util.spec_from_file_location(name, p)
    if spec is None or spec.loader is None:
        raise ModelFileError(f"model file {p}: cannot be imported")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses / pickling inside the file need their module registered
    folder = neighbours_first(p.resolve().parent)
    try:
        spec.loader.exec_module(module)
    except SyntaxError as e:
        sys.modules.pop(name, None)
        where = f" at line {e.lineno}" if e.lineno else ""  # a NUL byte in the file has no line
        raise ModelFileError(f"{p.name}: syntax error{where}: {e.msg}") from e
    except SystemExit as e:  # would exit with the file's code (3 reads as PEER_FAILED) or print its message
        sys.modules.pop(name, None)
        raise ModelFileError(f"{p.name}: importing it called {_exit_call(e)}") from e
    except Exception as e:
        sys.modules.pop(name, None)
        raise ModelFileError(f"{p.name}: importing it raised {_raised(e)}") from e
    finally:  # back where it was on sys.path, else last: a neighbour named like a library shadows none for oomtune
        if folder[0] in sys.path:
            sys.path.remove(folder[0])
        sys.path.insert(len(sys.path) if folder[1] is None else folder[1], folder[0])
        sys.modules.update(folder[2])  # the caller's own modules of a neighbour's name, back where they were
    return checked(module, p.resolve())


def checked(module, path: Path) -> ModelFile:
    """The model file's contract, checked on `module` (an imported file, or any object with the hooks)."""
    for required in REQUIRED:
        if not hasattr(module, required):
            raise ModelFileError(f"{path.name}: missing required function {required}(){did_you_mean(module, required)}")
        if not callable(value := getattr(module, required)):
            raise ModelFileError(f"{path.name}: {required} must be a function, got {type(value).__name__} "
                                 f"{repr(value)[:40]}")
    defaults = getattr(module, "DEFAULTS", {})
    if not isinstance(defaults, dict):
        raise ModelFileError(f"{path.name}: DEFAULTS must be a dict like {{'batch': 32, 'context': 512}}")
    for k, v in defaults.items():
        if k not in DEFAULT_KEYS:
            allowed = ", ".join(sorted(DEFAULT_KEYS))
            raise ModelFileError(f"{path.name}: DEFAULTS has unknown key {k!r} (allowed: {allowed})")
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise ModelFileError(f"{path.name}: DEFAULTS[{k!r}] must be a positive integer, got {v!r}")
    limit = getattr(module, "MAX_CONTEXT", None)
    if limit is not None and (not isinstance(limit, int) or isinstance(limit, bool) or limit < 1):
        raise ModelFileError(f"{path.name}: MAX_CONTEXT must be a positive integer, got {limit!r}")
    args = getattr(module, "ARGS", None)
    if args is not None and (not isinstance(args, dict) or not all(isinstance(k, str) and k.isidentifier() and
                                                                   isinstance(v, (int, float, bool, str))
                                                                   for k, v in args.items())):
        raise ModelFileError(f"{path.name}: ARGS must be a dict of build_model()'s keyword arguments to numbers, "
                             "true/false or strings, like {'n_layer': 12, 'dropout': 0.0}")
    return ModelFile(path=path, module=module, defaults=dict(defaults), args=None if args is None else dict(args),
                     max_context=limit)
