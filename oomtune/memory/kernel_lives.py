"""When each value of a compiled graph dies, which kernel writes its result over a dying input, and the order the
kernels run in, as inductor's generated code has them (its wrapper's `del` lines and `# reuse` lines).

A fused kernel's intermediates are never in memory (compiled.buffers); the kernel reads its inputs and writes its
output buffer, which is allocated before the kernel runs, while every input is still alive. An input therefore dies
after the last kernel that reads it, directly or through a fused intermediate that kernel recomputes: not at the
intermediate op that read it last in the graph. Inductor writes a kernel's output over an input that dies in it
instead, where it may (its scheduler's decide_inplace_update): the input is a buffer of this graph (an intermediate,
or in backward a saved tensor AOTAutograd donates; never a graph input of forward or a primal), of the same dtype
and storage size (within 5%), read by the kernel only at the place it writes (every op from it to the output
elementwise or a view that keeps each element's place: not a transpose, a slice, a cat, a gather), and read by no
kernel fused with it. Kernels of as many elements that read the same buffer run together (its fusion of nodes that
share reads). Not modelled: inductor's fusion of kernels that share no read (its CPU code fused two such in a
reviewer's graph, leaving a buffer alive ours had freed: under by one buffer there), the input it picks where
several qualify."""

from __future__ import annotations

import operator

import torch
from torch import fx


def is_view(node: fx.Node) -> bool:
    """A view of its first argument (or an item of a multi-output op's result): no storage of its own."""
    target = node.target
    return target is operator.getitem or (isinstance(target, torch._ops.OpOverload) and target.is_view)


def _alias(node: fx.Node) -> bool:
    """A result that shares its first argument's storage: a view, or _unsafe_view (which inductor still counts as a
    buffer of its own: compiled.buffers goes by is_view)."""
    return is_view(node) or _name(node) == "_unsafe_view"


def _root(node: fx.Node) -> fx.Node:
    while node.op == "call_function" and _alias(node) and node.args and isinstance(node.args[0], fx.Node):
        node = node.args[0]
    return node


def _ends(nodes: list[fx.Node], kept: set[fx.Node], index: dict[fx.Node, int]) -> dict[fx.Node, fx.Node]:
    """Each node's last kernel: itself where it is written out (kept, or the graph's output), else the last kernel
    that recomputes it (reached through fused intermediates only); itself where none reads it."""
    ends: dict[fx.Node, fx.Node] = {}
    for node in reversed(nodes):
        if node in kept or node.op == "output":
            ends[node] = node
            continue
        ends[node] = max((u if u in kept or u.op == "output" else ends[u] for u in node.users),
                         key=index.__getitem__, default=node)
    return ends


def _size(node: fx.Node) -> tuple | None:
    val = node.meta.get("val")
    if not isinstance(val, torch.Tensor):
        return None
    return val.dtype, val.untyped_storage().nbytes() if val.layout == torch.strided else None


def _fits(dying: fx.Node, kernel: fx.Node) -> bool:
    a, b = _size(dying), _size(kernel)
    if a is None or b is None or a[1] is None or b[1] is None or a[0] != b[0]:
        return False
    return 0.95 * a[1] <= b[1] <= a[1]


def _numel(node: fx.Node) -> int | None:
    val = node.meta.get("val")
    return val.numel() if isinstance(val, torch.Tensor) else None


class _Kernels:
    """Each fused kernel's recomputed intermediates and the buffers it reads."""

    def __init__(self, kept: set[fx.Node]):
        self.kept, self._parts = kept, {}

    def parts(self, kernel: fx.Node) -> tuple[list[fx.Node], set[fx.Node]]:
        if kernel not in self._parts:
            parts, reads, seen, work = [], set(), set(), list(kernel.all_input_nodes)
            while work:
                node = work.pop()
                if node in seen:
                    continue
                seen.add(node)
                if node in self.kept or node.op != "call_function":
                    reads.add(_root(node))
                else:
                    parts.append(node)
                    work.extend(node.all_input_nodes)
            self._parts[kernel] = (parts, reads)
        return self._parts[kernel]


def fused_order(nodes: list[fx.Node], kernels: _Kernels, fused: set[fx.Node]):
    """(order, leader): the graph's nodes in the order inductor's scheduler runs them, and for each fused kernel the
    first of those it is fused with. A later fused kernel that reads a buffer an earlier one reads, over as many
    elements, joins it (runs right after it, with what it recomputes) where every input it needs exists by then
    (its fusion of nodes that share reads)."""
    order, i, leader = list(nodes), 0, {}
    while i < len(order):
        first = order[i]
        if first in fused:
            done, at = set(order[:i + 1]), i + 1
            reads, size = kernels.parts(first)[1], _numel(first)
            leader[first] = first
            for later in [n for n in order[at:] if n in fused and _numel(n) == size and n not in leader]:
                parts, its_reads = kernels.parts(later)
                if not reads & its_reads:
                    continue
                move = [n for n in order if n is later or (n in parts and n not in done)]
                if all(x in done or x in move for n in move for x in n.all_input_nodes):
                    order = order[:at] + move + [n for n in order[at:] if n not in move]
                    done.update(move)
                    at += len(move)
                    leader[later] = first
            i = at - 1
        i += 1
    return order, leader


SHAPE_ONLY = frozenset(("view", "_unsafe_view", "alias", "unsqueeze", "squeeze", "reshape"))  # (same linear order)


def _name(node: fx.Node) -> str:
    target = node.target
    return target.overloadpacket.__name__ if isinstance(target, torch._ops.OpOverload) else ""


def _elementwise(node: fx.Node) -> bool:
    target = node.target
    return isinstance(target, torch._ops.OpOverload) and \
        (torch.Tag.pointwise in target.tags or _name(node) in ("_to_copy", "clone"))


def _same_index(node: fx.Node, root: fx.Node) -> bool:
    """`node` is `root` or a chain of views of it that keep each element's place."""
    while node is not root:
        if node.op != "call_function" or _name(node) not in SHAPE_ONLY or not node.args:
            return False
        node = node.args[0]
    return True


def _read_where_written(kernel: fx.Node, root: fx.Node, parts: list[fx.Node], index: dict) -> bool:
    """Whether the kernel reads `root` only where it writes (inductor's can_inplace: the read's index is the
    write's): every op of the kernel on a path from `root` to its output is elementwise or a view that keeps each
    element's place, and `root` is read through such views only (not a transpose, a slice, a gather, a cat)."""
    on_path: set[fx.Node] = set()
    for node in sorted([*parts, kernel], key=index.__getitem__):
        outside = [x for x in node.all_input_nodes if x not in on_path and _root(x) is root]
        if not outside and not any(x in on_path for x in node.all_input_nodes):
            continue
        if not (_elementwise(node) or _name(node) in SHAPE_ONLY) or not all(_same_index(x, root) for x in outside):
            return False
        on_path.add(node)
    return True


def plan(nodes: list[fx.Node], kept: set[fx.Node], fused: set[fx.Node], donated: set[fx.Node]):
    """(order, dies, over): the order the nodes run in (fused_order), the values freed after each node runs, and
    for a fused kernel's output the dying input it is written over, with its views (freed as it runs). `fused`: the
    kept nodes that are fused kernels' outputs (an extern kernel, a matmul, writes into a buffer of its own);
    `donated`: backward's saved tensors inductor may reuse. A kernel writes over an input only where no kernel fused
    with it reads that input too (inductor marks a fused kernel done once all of it is written)."""
    kernels = _Kernels(kept)
    nodes, leader = fused_order(nodes, kernels, fused)
    index = {n: i for i, n in enumerate(nodes)}
    ends = _ends(nodes, kept, index)
    dies: dict[fx.Node, list[fx.Node]] = {}
    for value in nodes:
        if value.users:
            at = max((ends[u] for u in value.users), key=index.__getitem__)
            dies.setdefault(at, []).append(value)
    death = {v: at for at, values in dies.items() for v in values}
    shared: dict[fx.Node, list[fx.Node]] = {}
    for node in nodes:
        shared.setdefault(_root(node), []).append(node)
    over: dict[fx.Node, list[fx.Node]] = {}
    for kernel in nodes:
        if kernel not in fused:
            continue
        group = [k for k in fused if k is not kernel and leader.get(k) is leader.get(kernel)]
        for root in dict.fromkeys(_root(v) for v in dies.get(kernel, ())):
            owned = (root.op == "call_function" and root in kept) or root in donated
            last = max((death[v] for v in shared[root] if v in death), key=index.__getitem__)
            if owned and last is kernel and _fits(root, kernel) and \
                    not any(root in kernels.parts(k)[1] for k in group) and \
                    _read_where_written(kernel, root, kernels.parts(kernel)[0], index):
                over[kernel] = [v for v in shared[root] if death.get(v) is kernel]
                dies[kernel] = [v for v in dies[kernel] if v not in over[kernel]]
                break
    return nodes, dies, over
