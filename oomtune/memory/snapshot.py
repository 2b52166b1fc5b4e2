"""A trial's allocation history in the pickle format of `torch.cuda.memory._snapshot()`, for PyTorch's memory viewer
(`python -m torch.cuda._memory_viz trace_plot FILE -o FILE.html`, or pytorch.org/memory_viz).

On cuda the history is PyTorch's own (`torch.cuda.memory._record_memory_history` around the trial). On the simulated
devices it is the tracker's: every storage's birth and death in order, as "alloc" and "free" events, each at an
address of its own, with the op that made it as its first frame, then the Python frames that called it (the model
file's lines, the training step; torch's own left out), and the breakdown's part (parameter, gradient, optimizer
state, autocast copy, activation, temporary) as its category."""

from __future__ import annotations

import pickle
from pathlib import Path

from ..errors import OomtuneError
from ..files import atomic_write, nearest_existing, try_write_in, what_stands
from .recorder import Recorder


def from_recorder(rec: Recorder, kind_of) -> dict:
    """The snapshot dict of what `rec` recorded; `kind_of(rec, record) -> str` names each storage's part."""
    events: list[tuple[int, dict]] = []
    address = 0
    for r in rec.records:
        frames = [{"filename": r.phase, "line": 0, "name": r.op or "(built before the trial)"}] + \
            [{"filename": file, "line": line, "name": name} for file, line, name in r.frames]
        alloc = {"action": "alloc", "addr": address, "size": r.nbytes, "stream": 0, "frames": frames,
                 "category": kind_of(rec, r)}
        events.append((r.born, alloc))
        if r.died is not None:
            for action in ("free_requested", "free_completed"):
                events.append((r.died, {**alloc, "action": action}))
        address += r.nbytes
    trace = [e for _, e in sorted(events, key=lambda pair: pair[0])]
    segment = {"device": 0, "address": 0, "total_size": address, "stream": 0, "segment_type": "large",
               "allocated_size": sum(r.nbytes for r in rec.records if r.died is None), "active_size": 0,
               "requested_size": 0, "blocks": []}
    return {"segments": [segment], "device_traces": [trace]}


def check_path(path: Path | None, on_ranks: bool = False, others: tuple = ()) -> None:
    """--memory-snapshot, checked before any trial runs: not a folder, in a folder that exists or can be made, and
    that can be written; not one of the command's `others` (the model file, --out, the config checked); where a
    file is there already, a pickle (a snapshot written before), never a file of the user's that is anything else;
    and not on several ranks (`on_ranks`: a snapshot is one process's trial)."""
    if path is None:
        return
    if on_ranks:
        raise OomtuneError("--memory-snapshot records one process's trial: run it without --nproc-per-node")
    p = Path(path)
    stands = what_stands(p)
    if stands not in (None, "a folder"):  # (never written through, nor read: a pipe would hang the check)
        raise OomtuneError(f"--memory-snapshot {p} is {stands}: oomtune writes no file through a link, nor into a "
                           "pipe or a device; name another file, or remove it")
    if p.is_dir():
        raise OomtuneError(f"--memory-snapshot {p} is a folder: name a file in it (e.g. {p / 'memory.pickle'})")
    for other in others:
        if other is not None and p.resolve() == Path(other).resolve():
            raise OomtuneError(f"--memory-snapshot {p} is {other}, which the command reads or writes: name another "
                               "file (e.g. memory.pickle)")
    if p.exists() and not _is_pickle(p):
        raise OomtuneError(f"--memory-snapshot {p} exists and is not a memory snapshot (a pickle): not overwriting "
                           "it; name another file or move it away")
    folder = nearest_existing(p.absolute().parent)
    if not folder.is_dir():
        raise OomtuneError(f"--memory-snapshot {p}: {folder} is not a folder")
    try:
        try_write_in(folder)
    except OSError as e:
        raise OomtuneError(f"--memory-snapshot {p}: cannot write in {folder} ({e.strerror or e})") from None


def _is_pickle(p: Path) -> bool:
    """A regular file that starts as a pickle of protocol 2 or later does (what this module and PyTorch write)."""
    try:
        with p.open("rb") as f:
            return p.is_file() and f.read(1) == b"\x80"
    except OSError:
        return False


def write(data: dict, path: Path) -> None:
    """Write the pickle atomically (a snapshot half written is never left where one was asked for)."""
    try:
        atomic_write(path, lambda f: pickle.dump(data, f))
    except OSError as e:
        raise OomtuneError(f"--memory-snapshot {path}: cannot write it: {e.strerror or e}") from None


def take(model_file, plan, device, steps: int) -> dict:
    """The snapshot of one trial of `plan` on `device`: PyTorch's own history on cuda, the tracker's elsewhere."""
    from .breakdown import snapshot
    from .devices import TrackedDevice

    if isinstance(device, TrackedDevice):
        return snapshot(model_file, plan, device, steps)
    import torch

    from ..search.trial import run_trial

    torch.cuda.memory._record_memory_history(stacks="python", max_entries=200_000)  # (C++ frames: slow to resolve)
    try:
        run_trial(model_file, plan, device, steps)
        return torch.cuda.memory._snapshot()
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)
