"""Fake tensors that take the code path real ones take.

The fake device runs the model on FakeTensors: shapes, dtypes and storages, no data. Code that is not ours looks
closer than the shapes in these places, and each is met here so that what the fake device measures is what the
cpu device (and the GPU) would:

1. `Module._apply` (`.to()`, `.half()`, PEFT putting an adapter next to its base layer; swaps.py) swaps a FakeTensor
   parameter's contents with `torch.utils.swap_tensors`, which refuses a tensor something holds a weak reference
   to, and FakeTensorMode memoises every tensor it makes by weak reference. `swappable_fakes` drops a tensor's
   memo entries just before it is swapped (they map the meta tensor of the op that made it, long gone), so the
   swap keeps the Parameter object: tied weights stay tied, frozen ones stay frozen, and its hooks stay on it (a
   swap alone moved them with the contents: `.to(bfloat16)` dropped a model file's post-accumulate-grad hooks).
2. Values. Code branches on data: transformers drops an all-ones attention mask (SDPA's own causal mask instead of
   a (B, 1, T, T) one), a boolean mask picks tokens. `Values` keeps a real copy (a shadow) of every small tensor
   computed only from the batch and constants, so reading one of those gives the real answer. A scalar that
   depends on the weights reads 0 (GradScaler's found-inf check: finite, the optimizer step is taken, the worst
   case for memory); an op whose output shape depends on such values (an MoE routing tokens with nonzero) raises
   `NeedsValues`, and the search measures on computed tensors instead (see FakeDevice.compute_instead).
3. Libraries that take a FakeTensor for tracing (transformers' `is_tracing`) are told it is not while a fake
   measurement runs (`library_view`).
4. `copy.deepcopy` of a module built on fake tensors (nn.TransformerEncoder's layers, PEFT's modules_to_save)
   deep-copies each FakeTensor's `__dict__`, and its fake mode with it. The copies then belong to a mode of their
   own: the mode the model runs in takes them as foreign inputs and converts them at every op, into tensors on
   storages of their own (a second copy of those weights, counted from the first forward on), and the copied
   mode's internals later crashed the process (a BERT with a deep-copied head: a segfault in the next trial).
   `one_fake_mode` has a fake mode deep-copy as itself.
5. `torch.tensor(data)` / `torch.as_tensor(data)` where `data` holds FakeTensors (a list of 0-d tensors: torchtune's
   Llama 3 RoPE scaling builds its frequencies so) reads their storages in C++, past the dispatcher, and failed
   ("data is not allocated yet"). known_data.py puts their known values in their place (their shadows' numbers); one
   without values raises `NeedsValues`, and the search computes instead.
"""

from __future__ import annotations

import contextlib
import sys
import weakref
from collections.abc import Callable, Iterator

import torch
from torch._subclasses.fake_tensor import (
    DataDependentOutputException,
    DynamicOutputShapeException,
    FakeTensor,
    FakeTensorMode,
)
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes, _get_current_dispatch_mode_stack
from torch.utils._pytree import tree_leaves, tree_map_only

from ..errors import OomtuneError
from .swaps import swappable_fakes
from .tracker import METADATA_OPS, MemoryTracker

_aten = torch.ops.aten
UNINITIALIZED = frozenset(op for op in (_aten.empty.memory_format, _aten.empty_strided.default,
                                        _aten.empty_like.default, _aten.new_empty.default,
                                        _aten.new_empty_strided.default))

SHADOW = "_oomtune_value"  # the attribute holding a FakeTensor's real copy
MAX_SHADOW_ELEMENTS = 1 << 22  # larger results are not copied (their values are not read by code that branches)
_LOCAL_SCALAR = torch.ops.aten._local_scalar_dense.default
_EMBEDDING = torch.ops.aten.embedding.default
_UNKNOWN = object()
# factories whose values are known without running anything: a float all-ones attention mask (BART's decoder makes
# one) is read by transformers like an integer one
CONSTANT_FACTORIES = frozenset((_aten.ones, _aten.zeros, _aten.full, _aten.scalar_tensor, _aten.arange,
                                _aten.linspace, _aten.eye))
# a few random numbers drawn to take a branch, as real ones take it: PEFT's LyCORIS layers (LoHa, LoKr) apply their
# adapter `if torch.rand(1) > module_dropout`, which a valueless draw read as False (no adapter, no gradient); a
# LayerDrop's `torch.rand(1) < p`. Weights are drawn far larger, and stay without values.
RANDOM_FACTORIES = frozenset((_aten.rand, _aten.randn))
MAX_RANDOM_SHADOW = 64  # elements
# in-place fills that leave a tensor without values as it was (Values._filled)
DRAWS = frozenset((_aten.uniform_.default, _aten.normal_.default))
FILLS = DRAWS | {_aten.fill_.Scalar, _aten.zero_.default}


class NeedsValues(OomtuneError):
    """An op needs tensor values the fake device does not have (its output shape, or a value that is not a
    scalar read): the search falls back to computing."""

    def __init__(self, func, what: str | None = None) -> None:
        name = getattr(func, "__name__", str(func)).split(".")[0]
        super().__init__(what or f"aten.{name} has an output that depends on tensor values (data-dependent), which "
                         "fake tensors do not have")


# -- 2. values ----------------------------------------------------------------------------------------------------

def shadow_of(t: torch.Tensor) -> torch.Tensor | None:
    """The real values behind `t`: itself for a real tensor, its shadow for a FakeTensor that has one."""
    if not isinstance(t, FakeTensor):
        return t
    return getattr(t, SHADOW, None)


def _arg_tensors(args, kwargs) -> Iterator[torch.Tensor]:
    """The tensors among an op's arguments (aten ops nest them at most one list deep)."""
    for a in (*args, *kwargs.values()):
        if isinstance(a, torch.Tensor):
            yield a
        elif isinstance(a, (list, tuple)):
            yield from (x for x in a if isinstance(x, torch.Tensor))


def _out_tensors(out) -> list[torch.Tensor] | None:
    """The op's tensor outputs, or None where it returns something else (a size, a device) or nothing."""
    if isinstance(out, torch.Tensor):
        return [out]
    if isinstance(out, (list, tuple)) and out and all(isinstance(t, torch.Tensor) for t in out):
        return list(out)
    return None


def _plain_fill(func, args, kwargs) -> bool:
    """A fill FakeTensorMode would run without an error or a change of its own (Values._filled): not a draw into
    integers nor a normal draw with a negative std (both fail, as on real tensors), not into a fake constant (whose
    constant the mode drops)."""
    t = args[0]
    if t.constant is not None:
        return False
    if func not in DRAWS:
        return True
    std = args[2] if len(args) > 2 else kwargs.get("std", 1.0)
    return t.is_floating_point() and (func is not _aten.normal_.default or std >= 0)


def _written(func, args, kwargs) -> list[torch.Tensor]:
    """The tensors `func` writes into (in-place and out= ops)."""
    schema = getattr(func, "_schema", None)
    if schema is None or not schema.is_mutable:
        return []
    written = []
    for i, arg in enumerate(schema.arguments):
        if arg.alias_info is None or not arg.alias_info.is_write:
            continue
        value = args[i] if i < len(args) and not arg.kwarg_only else kwargs.get(arg.name)
        written.extend(t for t in tree_leaves(value) if isinstance(t, torch.Tensor))
    return written


class Values(TorchDispatchMode):
    """Shadows of small tensors computed from known values; answers for data-dependent reads (module doc, 2).
    Enter it inside FakeTensorMode, so that every op it sees has fake arguments.

    Known values start at real tensors, at integer and boolean factories (token ids, masks, positions, lengths)
    and at constant ones of any dtype (ones, zeros, full, arange: a float mask), and at a few random numbers (a
    branch's draw, RANDOM_FACTORIES): other floating-point factories (random, uninitialized) are where weights start,
    and weights have no values on the fake device, so nothing computed from them is copied (the model's own compute
    never runs here)."""

    def __init__(self, call: Callable | None = None) -> None:
        super().__init__()
        self._call = call  # (func, args, kwargs) -> func's outputs, where the op is run (None: func itself)
        self._shadowed: set[int] = set()  # storages some tensor on which has a shadow
        self._stale: set[int] = set()  # of those, written with unknown values since: their shadows are stale

    def _known(self, t: torch.Tensor) -> torch.Tensor | None:
        s = shadow_of(t)
        if s is None or s is t:
            return s
        return None if id(t.untyped_storage()) in self._stale else s

    def _all_known(self, args, kwargs) -> bool | None:
        """True: every tensor argument has values; None: one has not; False: there are no tensor arguments."""
        any_tensor = False
        for t in _arg_tensors(args, kwargs):
            if self._known(t) is None:
                return None
            any_tensor = True
        return any_tensor

    def _real(self, func, args, kwargs):
        """`func` on the shadows, outside every mode (the caller checked every tensor argument has one);
        _UNKNOWN where the real op fails."""
        real_args, real_kwargs = tree_map_only(torch.Tensor, self._known, (args, kwargs))
        try:
            with _disable_current_modes():
                return func(*real_args, **real_kwargs)
        except Exception:
            return _UNKNOWN

    def _mark_stale(self, t: torch.Tensor) -> None:
        """`t` was written with unknown values: no tensor on its storage (views included) has known values now."""
        if not isinstance(t, FakeTensor):
            return
        key = id(t.untyped_storage())
        if key in self._shadowed and key not in self._stale:
            self._stale.add(key)

    def _attach(self, fake: torch.Tensor, value: torch.Tensor) -> None:
        setattr(fake, SHADOW, value)
        st = fake.untyped_storage()
        key = id(st)
        if key not in self._shadowed:
            self._shadowed.add(key)
            weakref.finalize(st, self._forget_storage, key)

    def _forget_storage(self, key: int) -> None:
        self._shadowed.discard(key)
        self._stale.discard(key)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in METADATA_OPS:  # a tensor's device (wrapper subclasses ask for it all the time): no values
            return func(*args, **(kwargs or {}))
        kwargs = kwargs or {}
        if func in FILLS and type(args[0]) is FakeTensor and self._known(args[0]) is None and \
                _plain_fill(func, args, kwargs):
            return self._filled(args[0])
        if func is _EMBEDDING:
            self._check_indices(args[0], args[1])
        try:
            out = func(*args, **kwargs) if self._call is None else self._call(func, args, kwargs)
        except DataDependentOutputException:
            return self._read(func, args, kwargs)
        except DynamicOutputShapeException:
            return self._shaped_by_values(func, args, kwargs)
        outs = _out_tensors(out)
        if outs is None or func in UNINITIALIZED or any(t.numel() > MAX_SHADOW_ELEMENTS for t in outs):
            known = None  # (an empty tensor's values are whatever the memory held: not known)
        else:
            known = self._all_known(args, kwargs)
            drawn = func.overloadpacket in RANDOM_FACTORIES and all(t.numel() <= MAX_RANDOM_SHADOW for t in outs)
            if known is False and func.overloadpacket not in CONSTANT_FACTORIES and not drawn and \
                    any(t.dtype.is_floating_point or t.dtype.is_complex for t in outs):
                known = None  # a floating-point factory (random, uninitialized): where weights start
        real = self._real(func, args, kwargs) if known is not None else _UNKNOWN
        if real is _UNKNOWN:
            if self._shadowed and func._schema.is_mutable:
                for t in _written(func, args, kwargs):
                    self._mark_stale(t)
            return out
        for fake, value in zip(outs, _out_tensors(real) or (), strict=False):
            if isinstance(fake, FakeTensor):
                self._attach(fake, value)
        return out

    def _filled(self, t: FakeTensor) -> FakeTensor:
        """An in-place fill of a fake tensor without values (a weight's init: uniform_, normal_, fill_, zero_): it
        still has none after, and a fake tensor's fill makes nothing and returns its tensor; so it is not run (a
        fake model's build runs one or two for each weight: a tenth of a trial's ops, GPT-2's)."""
        if self._shadowed:
            self._mark_stale(t)
        return t

    def _check_indices(self, weight: torch.Tensor, indices: torch.Tensor) -> None:
        """An embedding's known indices past its rows fail as the real op does (a context longer than the model's
        positions: fake tensors alone would look it up and go on)."""
        known = self._known(indices)
        if known is None or not known.numel():
            return
        with _disable_current_modes():
            low, high = int(known.min()), int(known.max())
        if low < 0 or high >= weight.shape[0]:
            raise IndexError("index out of range in self")

    def _read(self, func, args, kwargs):
        """A value read (`.item()`, `bool(t)`, torch.equal): the real answer, else 0 for a scalar."""
        real = self._real(func, args, kwargs) if self._all_known(args, kwargs) is not None else _UNKNOWN
        if real is not _UNKNOWN:
            return real
        if func is not _LOCAL_SCALAR:
            raise NeedsValues(func)
        dtype = args[0].dtype
        return False if dtype == torch.bool else (0.0 if dtype.is_floating_point else 0)

    def _shaped_by_values(self, func, args, kwargs):
        """nonzero, masked_select, unique...: the real op on the shadows gives the shape; fakes of that shape."""
        real = self._real(func, args, kwargs) if self._all_known(args, kwargs) is not None else _UNKNOWN
        if real is _UNKNOWN:
            raise NeedsValues(func)
        device = next(_arg_tensors(args, kwargs)).device

        def fake_like(value: torch.Tensor) -> torch.Tensor:
            fake = torch.empty_strided(value.shape, value.stride(), dtype=value.dtype, device=device)
            self._attach(fake, value)
            return fake

        return tree_map_only(torch.Tensor, fake_like, real)


# -- 3. libraries -------------------------------------------------------------------------------------------------

@contextlib.contextmanager
def library_view() -> Iterator[None]:
    """Libraries' FakeTensor checks answer "not tracing" while inside (module doc, 3)."""
    patched = []
    hf = sys.modules.get("transformers.utils.import_utils")
    if hf is not None and callable(getattr(hf, "is_fake_tensor", None)):
        patched.append((hf, "is_fake_tensor", hf.is_fake_tensor))
        hf.is_fake_tensor = lambda x: False
    try:
        yield
    finally:
        for module, name, original in patched:
            setattr(module, name, original)


# -- 4. copies ----------------------------------------------------------------------------------------------------

def _copied_as_itself(mode: FakeTensorMode, memo: dict) -> FakeTensorMode:
    return mode


@contextlib.contextmanager
def one_fake_mode() -> Iterator[None]:
    """While inside, `copy.deepcopy` of a FakeTensor makes a FakeTensor of the same fake mode (module doc, 4)."""
    previous = vars(FakeTensorMode).get("__deepcopy__")
    FakeTensorMode.__deepcopy__ = _copied_as_itself
    try:
        yield
    finally:
        if previous is None:
            del FakeTensorMode.__deepcopy__
        else:
            FakeTensorMode.__deepcopy__ = previous


@contextlib.contextmanager
def real_code_paths(cpu_kernels: bool = False, tracker: MemoryTracker | None = None) -> Iterator[None]:
    """Everything above, for a stretch of work on fake tensors (enter inside FakeTensorMode), with NF4 weights'
    dequantization made from the first of its kind (made_nf4.py, which reads this module's Values). `cpu_kernels`:
    ops whose outputs the CPU's kernels make otherwise than the meta kernels are made as the CPU's make them
    (cpu_kernels.py), in Values' own dispatch (no mode of their own: one less Python call per op); FakeTensorMode's
    cache keys laid out in fewer Python calls (cache_keys.py). `tracker`: one
    entered just above FakeTensorMode (nothing between) runs Values' dispatch itself (MemoryTracker.inner), for the
    same reason: Values is then no mode of its own either (current_values() finds it)."""
    from .cache_keys import fast_cache_keys
    from .cpu_kernels import cpu_kernel_call
    from .known_data import known_data
    from .made_nf4 import made_dequant

    values = Values(cpu_kernel_call if cpu_kernels else None)
    with swappable_fakes(), library_view(), _inside(values, tracker), one_fake_mode(), known_data(), made_dequant(), \
            fast_cache_keys():
        yield


@contextlib.contextmanager
def _inside(values: Values, tracker: MemoryTracker | None) -> Iterator[None]:
    """Values as a mode of its own, or run by `tracker` (its `inner`) while inside."""
    if tracker is None:
        with values:
            yield
        return
    previous, tracker.inner = tracker.inner, values.__torch_dispatch__
    try:
        yield
    finally:
        tracker.inner = previous


def current_values() -> Values | None:
    """The Values at work now: a mode of its own, or the one an active tracker runs (real_code_paths)."""
    for mode in reversed(_get_current_dispatch_mode_stack()):
        if isinstance(mode, Values):
            return mode
        inner = getattr(mode, "inner", None)
        if isinstance(getattr(inner, "__self__", None), Values):
            return inner.__self__
    return None
