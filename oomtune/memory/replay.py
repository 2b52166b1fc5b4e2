"""A trial's memory at another micro-batch, replayed from two traced trials instead of run. No torch here.

A simulated device that traces (TrackedDevice.traces) records what each storage did during a measurement, in order:
born or resized (its bytes before rounding), freed, and where the phases of the step begin. Between two trials of the
same plan that differ only in the micro-batch, the training step runs the same ops in the same order; only the sizes
differ, and a storage's bytes are a product of its shape, in which the micro-batch is one factor: affine in the
micro-batch, exactly. Two traces that line up event by event, each size on a line with a whole number of bytes per
sample, give every storage's size at any micro-batch, and the tracker's count, the phase peaks and the caching
allocator model (allocator.py) are then re-run on those sizes in milliseconds, where a fake trial costs its Python
(about half a second for a small model).

Two traces that do not line up (the model branches on the batch size, or pads it) are not replayed. Storages in
host memory (the offload levers, NF4's quantization) are replayed on lines too, counted apart: the host's peak. A
model that changes its sizes by other than a line would still line up at two points and be replayed wrong: the
probe's prior uses replays (search/prior.py), and the device's own trials, which certify each rung, catch such a
miss and correct it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from .allocator import MIN_BLOCK, CachingAllocatorModel, rounded
from .reading import Reading


@dataclass(frozen=True)
class Trace:
    """One measurement: the (rounded) sizes of the storages alive when it began, in the order the allocator model
    was fed them, then its events with storages numbered in order of birth (the initial ones first, then those in
    host memory, `host_initial`): ("set", n, bytes), ("free", n), ("mark", phase or None); for a storage in host
    memory (the offload levers, NF4's quantization), ("hset", n, bytes) and ("hfree", n), which the host's count
    follows apart from the device's and its allocator.

    Storages that die together (a graph's saved tensors, released at once) die in an order that changes from run to
    run (it follows ids); a run of frees with nothing between them leaves the count and the allocator model alike
    whatever their order (a freed block merges with its free neighbours, so the same blocks end up free), so each
    such run is kept in order of birth."""

    initial: tuple[int, ...]
    events: tuple[tuple, ...] = field(repr=False)
    host_initial: tuple[int, ...] = ()

    @property
    def hosted(self) -> bool:
        """Some storage lived in host memory."""
        return bool(self.host_initial) or any(ev[0] == "hset" for ev in self.events)

    def host_peak(self) -> int:
        """The host's peak, as replay() counts it (the storages in host memory alone: no allocator model)."""
        sizes = dict(enumerate(self.host_initial, start=len(self.initial)))
        live = peak = sum(self.host_initial)
        for ev in self.events:
            if ev[0] == "hset":
                live += rounded(ev[2]) - sizes.get(ev[1], 0)
                sizes[ev[1]] = rounded(ev[2])
                peak = max(peak, live)
            elif ev[0] == "hfree":
                live -= sizes.pop(ev[1])
        return peak

    @staticmethod
    def of(initial: list[tuple[int, int]], events: list[tuple], host_initial: list[tuple[int, int]] = ()) -> Trace:
        """From the tracker's record: `initial` and `host_initial` as (key, size), events keyed by the storage's id,
        which a storage born after another died may reuse."""
        number = {key: i for i, (key, _) in enumerate([*initial, *host_initial])}
        born = len(number)
        out: list[tuple] = []
        frees: list[tuple] = []  # a run of frees, in order of birth: the order within one is not kept (see below)
        for ev in events:
            kind = ev[0]
            if kind in ("free", "hfree"):
                frees.append((kind, number.pop(ev[1])))
                continue
            out += sorted(frees, key=lambda f: f[1])
            frees.clear()
            if kind in ("set", "host"):
                n = number.get(ev[1])
                if n is None:
                    n = number[ev[1]] = born
                    born += 1
                out.append(("set" if kind == "set" else "hset", n, ev[2]))
            else:
                out.append(ev)
        out += sorted(frees, key=lambda f: f[1])
        return Trace(tuple(size for _, size in initial), tuple(out), tuple(size for _, size in host_initial))


@dataclass(frozen=True)
class Lines:
    """Two traces lined up: each set event's bytes as `base + per_sample * micro_batch`."""

    initial: tuple[int, ...]
    events: tuple[tuple, ...] = field(repr=False)  # ("set" | "hset", n, base, per_sample) | ("free" | "hfree", n)
    micro_batches: tuple[int, int]  # the two traced                               # | ("mark", phase)
    host_initial: tuple[int, ...] = ()

    @staticmethod
    def through(a: Trace, batch_a: int, b: Trace, batch_b: int) -> Lines | None:
        """The lines through two traces at different micro-batches; None where they do not line up (see module
        doc)."""
        if (batch_a == batch_b or a.initial != b.initial or a.host_initial != b.host_initial
                or len(a.events) != len(b.events)):
            return None
        events: list[tuple] = []
        step = batch_b - batch_a
        for ea, eb in zip(a.events, b.events, strict=True):
            if ea[0] != eb[0] or ea[1] != eb[1]:
                return None
            if ea[0] not in ("set", "hset"):
                events.append(ea)
                continue
            per_sample, rest = divmod(eb[2] - ea[2], step)
            if rest:
                return None
            events.append((ea[0], ea[1], ea[2] - per_sample * batch_a, per_sample))
        return Lines(a.initial, tuple(events), (batch_a, batch_b), a.host_initial)


def replay(lines: Lines, micro_batch: int, model: CachingAllocatorModel,
           total: Callable[[int, int | None], int]) -> Reading | None:
    """The measurement at `micro_batch`: the tracker's count and the allocator `model` (fresh, seeded as the device
    seeds it) fed the sizes on the lines, phases split at the marks as Device.mark splits them; `total(tensor
    peak, reserved peak)` is the device margin's. None where a size would be negative (off the lines' range)."""
    out = Reading(modelled_reserved_bytes=0)
    sizes = dict(enumerate(lines.initial))
    for n, size in sizes.items():
        model.malloc(n, size)
    model.reset_peak()
    live = peak = sum(lines.initial)
    hosts = dict(enumerate(lines.host_initial, start=len(lines.initial)))  # the host's storages, counted apart
    host_live = out.host_peak_bytes = sum(lines.host_initial)
    malloc, resize = model.malloc, model.resize
    for ev in lines.events:
        kind = ev[0]
        if kind == "set":
            _, n, base, per_sample = ev
            raw = base + per_sample * micro_batch
            if raw < 0 or n in hosts:  # (a number of the host's: not one trace's lines)
                return None
            size, old = -(-raw // MIN_BLOCK) * MIN_BLOCK, sizes.get(n)  # (rounded)
            if old == size:  # the tracker records no event for a resize that keeps the rounded size
                continue
            sizes[n] = size
            if old is None:
                live += size
                malloc(n, size)
            else:
                live += size - old
                resize(n, size)
            if live > peak:
                peak = live
        elif kind == "hset":
            _, n, base, per_sample = ev
            raw = base + per_sample * micro_batch
            if raw < 0 or n in sizes:
                return None
            host_live += rounded(raw) - hosts.get(n, 0)
            hosts[n] = rounded(raw)
            out.host_peak_bytes = max(out.host_peak_bytes, host_live)
        elif kind == "hfree":
            if ev[1] not in hosts:
                return None
            host_live -= hosts.pop(ev[1])
        elif kind == "free":
            if ev[1] not in sizes:
                return None
            live -= sizes.pop(ev[1])
            model.free(ev[1])
        else:
            out.modelled_reserved_bytes = max(out.modelled_reserved_bytes, model.peak_reserved_bytes)
            out.phase_peaks[out.phase] = max(out.phase_peaks.get(out.phase, 0), peak)
            out.peak_allocated_bytes = max(out.peak_allocated_bytes, peak)
            out.peak_bytes = max(out.peak_bytes, total(peak, model.peak_reserved_bytes))
            peak = live
            model.reset_peak()
            if ev[1] is not None:
                out.phase = ev[1]
    return out
