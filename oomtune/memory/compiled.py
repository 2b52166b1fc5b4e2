"""torch.compile's memory on the simulated devices: a call traced by AOTAutograd, run as inductor would keep it.

Dynamo does not compile under a TorchDispatchMode (the memory tracker): a compiled model runs eager on the cpu and
fake devices. What compiling changes in memory is kept here instead, for a block (a transformer layer, as torchtune
compiles them one by one) or a function (the loss):

1. Which tensors are saved for backward. AOTAutograd traces forward and backward together and its min-cut
   partitioner chooses what forward keeps (cheap pointwise results are recomputed in backward): the forward graph's
   outputs beyond the call's own are those. The call runs those two graphs, on the device's tensors.
2. Which intermediates exist at all. Inductor fuses pointwise ops and reductions into kernels that write only what
   leaves them: a kernel's output is a buffer where an op that is not fused (a matmul, attention, a convolution:
   `extern`) reads it, or where it leaves the graph (saved for backward, returned). Every other op's result lives
   in registers, unless inductor's own thresholds write it out (a result many kernels read that is costly to
   recompute; reductions). The graphs run op by op here, and an op whose result is such an intermediate runs
   untracked: nothing of it is counted. (Not modelled: inductor's reuse of a dead buffer for one of the same size,
   which the allocator model sees as a reuse anyway.)

Where AOTAutograd cannot trace a call (a data-dependent branch, a tensor it would bake in as a constant: a KV cache,
an op with no fake kernel), the call runs eager and `fallbacks` says why: the estimate names it."""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
from torch import fx, nn
from torch._subclasses.fake_tensor import FakeTensor
from torch.utils._python_dispatch import _disable_current_modes
from torch.utils._pytree import tree_flatten, tree_unflatten

from . import kernel_lives
from .kernel_lives import is_view as _aliases
from .tracker import adopt, untracked

REDUCTIONS = frozenset(("sum", "mean", "amax", "amin", "max", "min", "prod", "var", "var_mean", "std", "any", "all",
                        "argmax", "argmin", "logsumexp"))
# ops inductor lowers into its fused kernels (beside every op tagged pointwise): reductions, and the composite ops
# it decomposes into pointwise ops and reductions
FUSED = REDUCTIONS | frozenset((
    "linalg_vector_norm", "norm", "_softmax", "_log_softmax", "_softmax_backward_data",
    "_log_softmax_backward_data", "native_layer_norm", "native_layer_norm_backward", "native_group_norm",
    "native_group_norm_backward", "_fused_rms_norm", "_fused_rms_norm_backward", "nll_loss_forward",
    "nll_loss_backward", "nll_loss2d_forward", "nll_loss2d_backward", "_to_copy", "clone", "cat", "where",
    "native_dropout", "native_dropout_backward", "embedding", "slice_backward", "select_backward", "slice_scatter",
    "select_scatter", "index_select", "gather", "masked_fill", "constant_pad_nd", "full", "zeros", "ones",
    "new_zeros", "new_ones", "new_full", "full_like", "zeros_like", "ones_like", "scalar_tensor", "arange", "iota",
    "fill", "copy", "expand_copy", "permute_copy", "repeat", "tril", "triu", "mse_loss", "mse_loss_backward",
    "_native_batch_norm_legit_functional", "native_batch_norm_backward", "lift_fresh_copy",
    "rand", "rand_like", "randn", "randn_like", "bernoulli",  # (drawn inside the kernel that uses them)
))
fallbacks: dict[str, str] = {}  # what was not compiled -> why (compile_notes: read and cleared by the searches)


def compile_notes() -> tuple[str, ...]:
    """The calls that ran eager though compiled since the last call, as notes (and forgets them)."""
    out = tuple(f"compiled {name}: {why}" for name, why in sorted(fallbacks.items()))
    fallbacks.clear()
    return out


_CONSTANT = frozenset(("full", "zeros", "full_like", "zeros_like", "new_zeros", "new_full"))


def _fused(node: fx.Node) -> bool:
    target = node.target
    if not isinstance(target, torch._ops.OpOverload):
        return False
    name = target.overloadpacket.__name__
    if name == "scatter":  # into a constant tensor (cross-entropy's backward): a pointwise select, for inductor
        base = node.args[0]
        return isinstance(base, fx.Node) and isinstance(base.target, torch._ops.OpOverload) and \
            base.target.overloadpacket.__name__ in _CONSTANT
    return torch.Tag.pointwise in target.tags or name in FUSED


def buffers(graph: fx.Graph) -> set[fx.Node]:
    """The nodes whose results inductor writes to memory: the graph's outputs, every op not fused and what such an
    op reads, reductions, a fused result inductor would not recompute in each reader (`_reused`), and the base of
    any of those that is a view (a fused op with several results: all, if one is)."""
    kept: set[fx.Node] = set()
    for node in graph.nodes:
        if node.op == "output":
            kept.update(n for n in node.all_input_nodes)
        elif node.op == "call_function" and not _aliases(node) and not _fused(node):
            kept.add(node)
            kept.update(node.all_input_nodes)
        elif node.op == "call_function" and _reduction(node):
            kept.add(node)  # (a loop of its own, read by what follows)
    _with_bases(kept)
    kept |= _reused(graph, kept)
    _with_bases(kept)
    return kept


def _reduction(node: fx.Node) -> bool:
    target = node.target
    if not isinstance(target, torch._ops.OpOverload) or target.overloadpacket.__name__ not in REDUCTIONS:
        return False
    return target.overloadpacket.__name__ not in ("max", "min") or target._overloadname in ("dim", "default")


def _with_bases(kept: set[fx.Node]) -> None:
    work = list(kept)
    while work:  # a view kept keeps its base
        node = work.pop()
        if node.op == "call_function" and _aliases(node) and node.args and isinstance(node.args[0], fx.Node):
            base = node.args[0]
            if base not in kept:
                kept.add(base)
                work.append(base)


def _reused(graph: fx.Graph, kept: set[fx.Node]) -> set[fx.Node]:
    """Fused results inductor writes out all the same (its GraphLowering.run_node, with its config's thresholds for
    a CUDA device): one read by more than one op that reads more than realize_reads_threshold buffers or is made of
    more than the opcount threshold of ops once its inputs are inlined; one that reads more than the accumulated
    reads threshold, whoever reads it. Otherwise each reader recomputes it."""
    from torch._inductor import config

    most_reads = config.realize_reads_threshold
    most_ops = config.realize_opcount_threshold or config._realize_opcount_threshold_default
    most_acc = config.realize_acc_reads_threshold or config._realize_acc_reads_threshold_default
    reads: dict[fx.Node, frozenset] = {}
    ops: dict[fx.Node, int] = {}
    out: set[fx.Node] = set()
    for node in graph.nodes:
        inputs = node.all_input_nodes
        if node.op != "call_function" or node in kept:
            reads[node], ops[node] = frozenset((node,)), 0
            continue
        reads[node] = frozenset().union(*(reads[n] for n in inputs))
        ops[node] = sum(ops[n] for n in inputs) + (0 if _aliases(node) else 1)
        reused = len(node.users) > 1 and (len(reads[node]) > most_reads or ops[node] > most_ops)
        if not _aliases(node) and (reused or len(reads[node]) > most_acc):
            out.add(node)
            reads[node], ops[node] = frozenset((node,)), 0
    return out


def graph_runner(gm: fx.GraphModule, example_inputs=None, backward: bool = False) -> Callable:
    """AOTAutograd's compiler for each graph: a boxed call that runs `gm`'s nodes in the order inductor's scheduler
    runs them, frees each value (an input too) after the last kernel that reads it, writes a fused kernel's result
    over an input that dies in it where inductor would (kernel_lives), and counts only what `buffers` says inductor
    keeps.
    `backward`: the graph is a backward one, whose saved tensors AOTAutograd may donate to inductor."""
    nodes = list(gm.graph.nodes)
    if any(node.op == "get_attr" for node in nodes):
        raise RuntimeError("the trace bakes in tensors that are not its inputs (a cache?)")
    kept = buffers(gm.graph)
    fused = {n for n in kept if n.op == "call_function" and _fused(n) and not _aliases(n)}
    nodes, dies, over = kernel_lives.plan(nodes, kept, fused, _donated(nodes) if backward else set())

    def run(args: list):
        env: dict[fx.Node, object] = {}
        inputs = list(args)
        args.clear()  # (boxed: the caller's list let go of, and each input taken out of ours as it is read, so
        at = 0  # that a saved tensor handed to backward dies after the last kernel that reads it)
        for node in nodes:
            if node.op == "placeholder":
                env[node], inputs[at] = inputs[at], None
                at += 1
            elif node.op == "call_function":
                a, k = fx.map_arg((node.args, node.kwargs), lambda n: env[n])
                if node in kept and node not in over:  # (a view of a fused result too runs untracked: its
                    env[node] = node.target(*a, **k)  # storage was never made)
                else:
                    with untracked():  # a fused kernel's intermediate: never in memory
                        env[node] = node.target(*a, **k)
                if node in over:  # written over an input that dies in it: counted once that input is gone
                    del a, k
                    for gone in over[node]:
                        env.pop(gone, None)
                    adopt(env[node])
            elif node.op == "output":
                return fx.map_arg(node.args[0], lambda n: env[n])
            for dead in dies.get(node, ()):
                env.pop(dead, None)
        raise AssertionError("graph without output")

    run._boxed_call = True
    return run


def _donated(nodes: list[fx.Node]) -> set[fx.Node]:
    """Backward's placeholders AOTAutograd donates (saved tensors made in forward, aliasing none of its inputs or
    outputs): the ones inductor may write over (its DonatedBuffer), as the tracing context lists them."""
    context = torch._guards.TracingContext.try_get()
    meta = getattr(context, "fw_metadata", None) if context is not None else None
    idxs = set(getattr(meta, "bw_donated_idxs", None) or ())
    return {n for i, n in enumerate(x for x in nodes if x.op == "placeholder") if i in idxs}


class _Call(nn.Module):
    """The traced call: `module` (whose parameters and buffers AOTAutograd lifts to inputs), called as `call` with
    the tensors it is given put back among the fixed arguments; its result flattened to a tuple."""

    def __init__(self, module: nn.Module | None, call: Callable, fixed: list, where: list[int], spec):
        super().__init__()
        self.module = module
        self._call, self._fixed, self._where, self._spec = call, fixed, where, spec
        self.out_spec = None

    def forward(self, *tensors):
        leaves = list(self._fixed)
        for i, t in zip(self._where, tensors, strict=True):
            leaves[i] = t
        args, kwargs = tree_unflatten(leaves, self._spec)
        out, self.out_spec = tree_flatten(self._call(*args, **kwargs))
        if not all(isinstance(o, torch.Tensor) for o in out):
            raise TypeError("it returns something other than tensors")
        return tuple(out)


def _kv_cache(value) -> bool:
    """A transformers KV cache (a layer in training is handed one where use_cache is on)."""
    kind = type(value)
    return kind.__module__.startswith("transformers.") and any(c.__name__ == "Cache" for c in kind.__mro__)


def _cache_held(leaves: list) -> bool:
    """Whether a KV cache among the arguments holds keys already (a PEFT prefix, a generation): the call cannot be
    traced, since the trace would store its traced tensors in it. An empty one (training's) is given as None to the
    trace: training never reads it back, and the keys and values are saved for backward all the same."""
    for x in leaves:
        if _kv_cache(x):
            try:
                if x.get_seq_length():
                    return True
            except Exception:  # noqa: BLE001 (a cache that cannot say: not traced)
                return True
    return False


def _key(leaves: list, module: nn.Module | None) -> tuple:
    def one(x):
        if isinstance(x, torch.Tensor):
            return ("T", tuple(x.shape), x.stride(), x.dtype, x.requires_grad, x.device.type)
        return ("V", type(x).__name__, repr(x))

    training = tuple(m.training for m in module.modules()) if module is not None else ()  # (dropout, batch norms)
    return (tuple(one(x) for x in leaves), training, torch.is_grad_enabled(), torch.is_autocast_enabled("cpu"),
            torch.get_autocast_dtype("cpu"))


class CompiledCall:
    """`call` (a module's forward, or a function) as a compiled call runs on the simulated devices: traced once per
    kind of arguments (shapes, dtypes, what requires grad, autocast, training mode), then run as `graph_runner`
    runs the graphs. A kind it cannot trace runs eager, and `fallbacks` says why."""

    def __init__(self, name: str, call: Callable, module: nn.Module | None = None):
        self.name, self.call, self.module = name, call, module
        self.__wrapped__ = call  # (inspect.unwrap: what was compiled)
        self._traced: dict[tuple, tuple] = {}
        self._failed: set[tuple] = set()
        self.eager_why: str | None = None  # why the last call that ran eager did

    def _eager(self, why: str, args, kwargs):
        self.eager_why = why
        fallbacks[self.name] = f"{why}, so it ran eager and its memory is the eager one's"
        return self.call(*args, **kwargs)

    def __call__(self, *args, **kwargs):
        leaves, spec = tree_flatten((args, kwargs))
        if _cache_held(leaves):
            return self._eager("it was given a KV cache that holds keys already", args, kwargs)
        leaves = [None if _kv_cache(x) else x for x in leaves]
        where = [i for i, x in enumerate(leaves) if isinstance(x, torch.Tensor)]
        key = (str(spec), _key(leaves, self.module))
        if key in self._failed:
            return self.call(*args, **kwargs)
        found = self._traced.get(key)
        if found is None:
            fixed = [None if isinstance(x, torch.Tensor) else x for x in leaves]
            holder = _Call(self.module, self.call, fixed, where, spec)
            try:
                found = (_trace(holder, [leaves[i] for i in where]), holder)
            except Exception as e:  # noqa: BLE001 (whatever AOTAutograd cannot trace runs eager, and is named)
                self._failed.add(key)
                what = f"{type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}"
                return self._eager(f"AOTAutograd could not trace it ({what})", args, kwargs)
            self._traced[key] = found
        fn, holder = found
        out = fn(*[leaves[i] for i in where])
        return tree_unflatten(list(out), holder.out_spec)


def _inductor_decompositions() -> dict:
    """The ops inductor decomposes before the partitioner chooses what to save (log_softmax into its pointwise
    parts and a reduction, so that backward recomputes them from the logits rather than keep fp32 log-probs)."""
    from torch._inductor.decomposition import select_decomp_table

    # attention is not decomposed (CUDA's inductor calls the fused kernel; the table's SDPA entry took the CPU's
    # math kernel, with its attention weights, once an earlier trace in the process had run)
    return {op: fn for op, fn in select_decomp_table().items() if "scaled_dot_product" not in op.name()}


def _stand_in(t: torch.Tensor) -> torch.Tensor:
    """A fake tensor of the same layout on a storage nobody counts, for a fake one: AOTAutograd keeps its example
    inputs (where they are fake, it traces with them as they are), which would keep the device's tensor alive."""
    if not isinstance(t, FakeTensor):
        return t  # (real ones it turns into fakes of its own)
    with t.fake_mode:
        out = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=t.device)
    return out.requires_grad_(t.requires_grad) if t.is_floating_point() or t.is_complex() else out


def _partition(gm: fx.GraphModule, joint_inputs, **kwargs):
    """Inductor's own partition of the joint graph: its joint-graph passes (pattern rewrites that change what is
    worth saving), then the min-cut partitioner as inductor calls it; random ops left as they are (a dropout stays
    one op, drawn inside the kernel that uses it: FUSED)."""
    from torch._guards import detect_fake_mode
    from torch._inductor import config
    from torch._inductor.compile_fx import partition_fn
    from torch._inductor.virtualized import V

    with V.set_fake_mode(detect_fake_mode(joint_inputs)), config.patch(fallback_random=True):
        return partition_fn(gm, joint_inputs, **kwargs)


def _trace(holder: _Call, tensors: list) -> Callable:
    from torch._functorch.aot_autograd import aot_module_simplified

    from .cuda_kernels import native_attention

    with _disable_current_modes(), untracked(), native_attention(), \
            torch._functorch.config.patch(force_non_lazy_backward_lowering=True):  # (both graphs traced now)
        tensors = [_stand_in(t) for t in tensors]  # (AOTAutograd keeps what it traced with)
        with torch._guards.tracing(torch._guards.TracingContext(None)):  # (where it lists what it donates)
            return aot_module_simplified(holder, tensors, fw_compiler=graph_runner,
                                         bw_compiler=functools.partial(graph_runner, backward=True),
                                         partition_fn=_partition,
                                         decompositions=_inductor_decompositions())
