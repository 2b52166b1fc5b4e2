"""Activation checkpointing of a model file's model: the block stacks the default wraps, a Hugging Face model's own
switch, and the wrapper that recomputes a block in backward (keeping the buffers its forward updates, batch norms'
running statistics among them, as one forward left them)."""

from __future__ import annotations

import contextlib
import functools
import inspect
import sys
from collections.abc import Callable, Iterator

import torch
import torch.utils.checkpoint as tuc
from torch import nn
from torch.utils.checkpoint import checkpoint

STACK_SHARE = 0.25  # a stack with under this share of the largest stack's parameters is not a block stack


def block_stacks(model: nn.Module) -> list[nn.ModuleList]:
    """The nn.ModuleLists whose members all have one type (an encoder's and a decoder's layers are two), largest
    (by parameters) first; one inside another that was taken is part of it; one with under STACK_SHARE of the
    largest one's parameters (two output heads beside twelve layers) is not a stack of blocks."""
    def size(m: nn.Module) -> int:
        return sum(p.numel() for p in m.parameters())

    lists = [m for m in model.modules() if isinstance(m, nn.ModuleList) and len(m) and len({type(x) for x in m}) == 1]
    lists = sorted((m for m in lists if size(m)), key=size, reverse=True)
    taken: list[nn.ModuleList] = []
    inside: set[int] = set()
    for stack in lists:
        if id(stack) in inside or size(stack) < STACK_SHARE * size(lists[0]):
            continue
        taken.append(stack)
        inside.update(id(m) for m in stack.modules())
    return taken


SCALARS = (str, bool, int, float, type(None))


def _settings(member: nn.Module) -> Iterator[tuple[str, str, object]]:
    """(submodule, attribute, value) of each setting a member's modules hold: a str, bool, int, float or None, or a
    tuple of them, that is not private (a layer type, a flag, a window size, a dropout rate, ModernBERT's local
    window as a pair)."""
    for name, m in member.named_modules():
        for k, v in vars(m).items():
            if not k.startswith("_") and (isinstance(v, SCALARS)
                                          or isinstance(v, tuple) and all(isinstance(x, SCALARS) for x in v)):
                yield name, k, v


def _counters(stack: nn.ModuleList) -> frozenset[tuple[str, str]]:
    """(submodule, attribute) of each int setting that counts the stack's members (a layer's index: every member
    that has it holds an int, member i's i plus the same offset), which tells nothing of what a member does;
    anything else that differs does. Members without it are compared without it: a hybrid's first layer that
    keeps its index on another submodule leaves the others a run."""
    seen: dict[tuple[str, str], list] = {}
    for i, member in enumerate(stack):
        for name, k, v in _settings(member):
            seen.setdefault((name, k), []).append(v - i if type(v) is int else None)
    return frozenset(key for key, offsets in seen.items() if len(offsets) > 1 and None not in offsets
                     and len(set(offsets)) == 1)


def _signature(member: nn.Module, counters: frozenset = frozenset()) -> tuple:
    """What makes two members alike: their parameters' and buffers' names, shapes, dtypes and trainability, their
    modules' classes and their settings but the stack's counters. A window size or a dropout rate counts (blocks
    alike in shapes and flags whose later ones attend locally, window None against 64: the extrapolation from 2, 3
    and 4 of them saw none of the local ones where they came after the 4th)."""
    tensors = tuple((name, tuple(t.shape), t.dtype, getattr(t, "requires_grad", False))
                    for name, t in (*member.named_parameters(), *member.named_buffers()))
    modules = tuple((name, type(m).__name__) for name, m in member.named_modules())
    settings = tuple(sorted(((name, k, repr(v)) for name, k, v in _settings(member) if (name, k) not in counters)))
    return tensors, modules, settings


def repeated_runs(model: nn.Module) -> list[tuple[nn.ModuleList, int]]:
    """(stack, where its run of alike members starts) for each stack whose run is as long as the longest; [] where
    no run has two members."""
    found = []
    for stack in block_stacks(model):
        counters = _counters(stack)
        signatures = [_signature(m, counters) for m in stack]
        start = len(stack) - 1
        while start > 0 and signatures[start - 1] == signatures[-1]:
            start -= 1
        found.append((stack, start))
    longest = max((len(s) - start for s, start in found), default=0)
    return [(s, start) for s, start in found if len(s) - start == longest] if longest >= 2 else []


@contextlib.contextmanager
def runs_cut(runs: list[tuple[nn.ModuleList, int]], keep: int = 2) -> Iterator[None]:
    """Inside, each stack of `runs` (repeated_runs) keeps `keep` members of its run; the others are put back after,
    in order (a forward that does not depend on how many blocks there are, at a fraction of its cost)."""
    cut = []
    try:
        for stack, start in runs:
            rest = list(stack)[start + keep:]
            del stack[start + keep:]
            cut.append((stack, rest))
        yield
    finally:
        for stack, rest in cut:
            stack.extend(rest)


def callable_blocks(member: nn.Module) -> list[nn.Module]:
    """What checkpointing wraps for one member of a block stack: the member, where its class has a forward; else
    (an nn.ModuleList or nn.ModuleDict, or a module with no forward of its own, which nothing can call: vit-pytorch
    keeps each layer as a ModuleList([attention, feed-forward]) and calls the two) its children's, in order.
    Wrapping a member that is never called does nothing."""
    if type(member).forward is not nn.Module.forward:
        return [member]
    return [b for child in member.children() for b in callable_blocks(child)]


def describe_blocks(blocks: list[nn.Module]) -> str:
    """"12 blocks (Attention x6, FeedForward x6)": how many, of which classes."""
    counts: dict[str, int] = {}
    for b in blocks:
        counts[type(b).__name__] = counts.get(type(b).__name__, 0) + 1
    kinds = ", ".join(f"{name} x{n}" for name, n in counts.items())
    return f"{len(blocks)} block{'s' if len(blocks) != 1 else ''} ({kinds})"


def blocks_that_run(blocks: list[nn.Module], forward: Callable[[], object]) -> int | None:
    """How many of `blocks` a forward runs: `forward()` (one forward and loss, on fake tensors) with each block's
    forward counted where checkpointing would wrap it (its instance's `forward`, which a call through the module
    and a direct `.forward()` both reach). None where the forward fails: it says nothing."""
    ran: set[int] = set()
    own = [b.__dict__.get("forward") for b in blocks]  # (an instance forward already there is put back)

    def counted(i: int, call: Callable) -> Callable:
        @functools.wraps(call)
        def run(*args, **kwargs):
            ran.add(i)
            return call(*args, **kwargs)
        return run

    for i, b in enumerate(blocks):
        b.forward = counted(i, b.forward)
    try:
        forward()
    except Exception:  # (a forward that needs another batch than the probe's first: the rung stays)
        return None
    finally:
        for b, before in zip(blocks, own, strict=True):
            if before is None:
                del b.forward
            else:
                b.forward = before
    return len(ran)


def hf_checkpointing(model: nn.Module) -> Callable | None:
    """A Hugging Face model's own checkpointing switch (transformers 5 renamed it), through a PEFT wrapper too; None
    where the model says it has none (supports_gradient_checkpointing False: ConvNext, ResNet, EfficientNet, whose
    switch raises), so its blocks are found as any model's are."""
    if getattr(model, "supports_gradient_checkpointing", True) is False:
        return None
    for name in ("activation_checkpointing_enable", "gradient_checkpointing_enable"):
        enable = getattr(model, name, None)
        if callable(enable):
            return enable
    return None


# module attributes that switch a model's own activation checkpointing on, where libraries keep it
OWN_SWITCHES = (
    "gradient_checkpointing",  # transformers, diffusers
    "grad_checkpointing",  # timm, open_clip
    "use_checkpoint",  # Swin and many research code bases
    "checkpoint_activations",  # fairseq, Megatron-style code
)


def checkpoints_itself(model: nn.Module) -> str | None:
    """How build_model() turned the model's own activation checkpointing on, or None: a module attribute of
    OWN_SWITCHES set to True (a Hugging Face model's gradient_checkpointing_enable, timm's
    set_grad_checkpointing), or blocks wrapped in torch's CheckpointWrapper (torchtune, torchtitan). Every rung
    then runs checkpointed, and a checkpointing rung would measure the same peaks again."""
    for m in model.modules():
        if any(c.__name__ == "CheckpointWrapper" and c.__module__.startswith("torch.distributed")
               for c in type(m).__mro__):
            return "its blocks are wrapped in torch's CheckpointWrapper"
        on = next((name for name in OWN_SWITCHES if getattr(m, name, None) is True), None)
        if on is not None:
            return f"{type(m).__name__}.{on} is True"
    return None


def cannot_checkpoint(model: nn.Module) -> str | None:
    """Why the model cannot train checkpointed through its own switch, where that is known, or None. PEFT prefix
    tuning hands its trained prefix to every layer as a key/value cache, and a Hugging Face model checkpointed
    while training runs without a cache (use_cache=False): the keys come out shorter than the attention mask and
    the forward fails (PEFT's issue 869)."""
    config = getattr(model, "active_peft_config", None)
    if str(getattr(config, "peft_type", "")).endswith("PREFIX_TUNING"):
        return ("PEFT prefix tuning passes its prefix as a key/value cache, which a Hugging Face model checkpointed "
                "in training runs without")
    return None


def _own_forward_mentions_checkpoint(cls: type) -> bool:
    """The class's forward is the user's own code (not an installed library's) and its source calls something named
    checkpoint: a cheap test before the forward is run to see (calls_checkpoint)."""
    try:
        where = inspect.getsourcefile(cls.forward) or ""
        return "-packages" not in where and "checkpoint(" in inspect.getsource(cls.forward)
    except (OSError, TypeError):
        return False


def calls_checkpoint(model: nn.Module, forward: Callable[[], object]) -> str | None:
    """How the model checkpoints itself in every forward with no switch to find (its own code calls
    torch.utils.checkpoint.checkpoint unconditionally), or None: `forward()` is run once (on fake tensors, a
    micro-batch of 1), counting the calls through the name its module imported the function by. Run only where
    a class's own forward names checkpoint; a forward that fails says nothing."""
    own = [c for c in {type(m) for m in model.modules()} if _own_forward_mentions_checkpoint(c)]
    if not own:
        return None
    calls: list[bool] = []
    original = tuc.checkpoint

    def counting(*args, **kwargs):
        calls.append(True)
        return original(*args, **kwargs)

    spaces = [vars(sys.modules[c.__module__]) for c in own if c.__module__ in sys.modules] + [vars(tuc)]
    patched = [(ns, name) for ns in spaces for name, value in list(ns.items()) if value is original]
    for ns, name in patched:
        ns[name] = counting
    try:
        forward()
    except Exception:  # (a forward that needs another batch than the probe's first: the rung stays)
        return None
    finally:
        for ns, name in patched:
            ns[name] = original
    names = ", ".join(sorted(f"{c.__name__}.forward" for c in own))
    return f"{names} calls torch.utils.checkpoint in every forward" if calls else None


def no_checkpointing_note(label: str, itself: str | None = None, breaks: str | None = None,
                          idle: str | None = None) -> str:
    """Why a ladder has no checkpointing rung: the model checkpoints itself (`itself` says how; a rung would
    measure the same thing again), it cannot run checkpointed (`breaks`: why), what checkpointing would wrap never
    runs (`idle`: what), or it has nothing to wrap."""
    if idle:
        return (f"no activation checkpointing rung: {label}'s forward runs none of the {idle} it would wrap, so it "
                "would save nothing; define blocks(model) returning the modules the forward calls, one or a few "
                "per layer (e.g. each layer's attention and feed-forward)")
    if itself:
        return (f"no activation checkpointing rung: {label}'s build_model() turns the model's own activation "
                f"checkpointing on ({itself}), so every rung runs checkpointed already")
    if breaks:
        return f"no activation checkpointing rung: {label} cannot train checkpointed ({breaks})"
    return (f"no activation checkpointing rung: {label} has no blocks to wrap (no nn.ModuleList of same-type "
            "modules, no gradient_checkpointing_enable); define blocks(model) to add it")


def enable_hf_checkpointing(model: nn.Module, enable: Callable) -> None:
    """Non-reentrant checkpointing, which needs no input that requires grad; where transformers is too old to be
    told so (reentrant), a model whose input embeddings are frozen (PEFT) gets `enable_input_require_grads`, or
    no gradient would flow back through the checkpointed layers to the adapters."""
    key = "activation_checkpointing_kwargs" if enable.__name__.startswith("activation") else \
        "gradient_checkpointing_kwargs"
    try:
        enable(**{key: {"use_reentrant": False}})
    except TypeError:  # transformers before 4.35: reentrant only
        enable()
        embeddings = getattr(model, "get_input_embeddings", lambda: None)()
        frozen = embeddings is not None and not any(p.requires_grad for p in embeddings.parameters())
        if frozen and callable(getattr(model, "enable_input_require_grads", None)):
            model.enable_input_require_grads()


def checkpointed(forward: Callable, context_fn: Callable | None = None) -> Callable:
    """`forward`, recomputed in backward (non-reentrant). Compiling (a compiled model on cuda), torch takes no
    context_fn but its own dispatch modes: the buffers are then not put back (buffers_kept)."""
    extra = {"context_fn": context_fn} if context_fn is not None else {}

    @functools.wraps(forward)
    def run(*args, **kwargs):
        if not torch.is_grad_enabled():  # eval: nothing to save, nothing to recompute
            return forward(*args, **kwargs)
        kept = {} if torch.compiler.is_compiling() else extra
        return checkpoint(forward, *args, use_reentrant=False, **kept, **kwargs)

    return run


def _version(t: torch.Tensor) -> int:
    """Its version counter; -1 for a tensor made under inference_mode, which has none (and is never written)."""
    try:
        return t._version
    except RuntimeError:
        return -1


def buffers_kept(block: nn.Module) -> Callable | None:
    """For a block with buffers: checkpoint's context_fn that puts back, after backward's recompute, the buffers its
    forward changed in place, as that forward left them. The recompute runs the training forward again, so without
    it every update moved twice a step: batch norms' running mean, variance and batch count, a counter, an EMA.
    Which buffers changed is read from their version counters (in-place writes from Python bump them), so only those
    are copied; batch norms' running statistics, which their kernel writes without a bump, always are. Not seen: a
    buffer the forward replaces (`self.buf = ...`). Not undone: the recompute starts from the buffers as the forward
    left them, so a block whose output depends on a buffer it updates gets the gradient of that second forward.
    None where the block has no buffers."""
    buffers = list(block.buffers())
    if not buffers:
        return None
    stats = {id(b) for m in block.modules() if isinstance(m, nn.modules.batchnorm._NormBase) and m.track_running_stats
             for b in (m.running_mean, m.running_var) if b is not None}

    def contexts():
        changed: list[torch.Tensor] = []
        return _Forward(buffers, stats, changed), _Recompute(changed)

    return contexts


class _Forward:
    """Around the checkpointed forward: which buffers it wrote (into `changed`)."""

    def __init__(self, buffers: list[torch.Tensor], stats: set[int], changed: list[torch.Tensor]):
        self.buffers, self.stats, self.changed = buffers, stats, changed

    def __enter__(self):
        self.before = [_version(b) for b in self.buffers]

    def __exit__(self, *exc):
        self.changed[:] = [b for b, v in zip(self.buffers, self.before, strict=True)
                           if _version(b) != v or id(b) in self.stats]


class _Recompute:
    """Around each recompute (one per backward through the block: a second backward or autograd.grad then backward
    recomputes again, so it is re-entered): the written buffers put back as the forward left them."""

    def __init__(self, changed: list[torch.Tensor]):
        self.changed = changed

    def __enter__(self):
        with torch.no_grad():
            self.saved = [(b, b.clone()) for b in self.changed]

    def __exit__(self, *exc):
        with torch.no_grad():
            for b, value in self.saved:
                b.copy_(value)
        self.saved = []
