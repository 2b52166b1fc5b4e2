"""The ranks of a run (processes, one per GPU, started by torchrun): the process group, the few collectives oomtune
calls itself, and how the ranks agree on an out-of-memory error. Every run has a `Dist`: a run of one process has
`LOCAL` (rank 0 of 1, no process group), whose collectives return their inputs, so no code asks "are there ranks?".
How the model is wrapped and its gradients synchronised is in `wrap.py`.

Agreement. A rank that runs out of memory must not leave the others waiting inside a collective it will never
join, and every rank must take the same decision (halve the micro-batch, or call a trial an OOM). So every unit
of work that may run out of memory is followed by one agreement all-reduce (`Dist.agree`): each rank says
whether it ran out, and all of them learn which ranks did. A rank that runs out skips straight to its next
agreement, and after an agreement that failed no rank calls another for that unit of work. For this to hold,
the work between two agreements must not contain collectives a failed rank would skip:

- ddp: every micro-step runs under `no_sync()` (no collectives; buffers are not broadcast in forward), and the
  gradients are averaged once per optimizer step, after the agreement (`sync_gradients`). DDP's own in-backward
  all-reduce is not used: a rank that ran out of memory half way through a backward would leave its peers
  blocked in a bucket's all-reduce.
- fsdp: forward and backward all-gather parameters (FSDP2, one unit a block, then the root); non-final
  micro-steps skip the reduce-scatter (`set_requires_gradient_sync(False)`). A rank that runs out of memory
  inside that work first checks, through the rendezvous store (not a collective), whether every rank ran out
  with it (the same shapes in the same budget strike at the same op: what the probe measures); if so they
  agree as above. If it ran out alone, its peers are waiting inside an all-gather it can never join: it stops
  with `LoneOutOfMemory`, its exit breaks the peers' collective, and torchrun stops them. Either way an FSDP
  step left half way cannot be retried in place (its units' state), so the trainer stops every rank with the
  halved plan written to the config and the launcher relaunches them from the last checkpoint; a probe's
  trial, which builds a fresh model each time, just records the OOM.
"""

from __future__ import annotations

import atexit
import contextlib
import datetime as dt
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from ..errors import OOM_RELAUNCH, OomtuneError, first_line
from ..memory.devices import is_oom
from .launch import DEFAULT_TIMEOUT_S, launched_by_torchrun

JOIN_TIMEOUT_S = 120.0  # how long the ranks wait for each other to join, at least

T = TypeVar("T")


class LoneOutOfMemory(OomtuneError):
    """This rank ran out of memory inside FSDP's collectives and the others did not: no agreement is possible."""

    def __init__(self, rank: int, message: str):
        self.rank = rank
        self.oom_message = message
        super().__init__(f"rank {rank} ran out of memory inside an FSDP step and the other ranks did not, so they "
                         f"wait in a collective it cannot join ({message})", OOM_RELAUNCH)


class RanksOutOfMemory(torch.cuda.OutOfMemoryError):
    """Raised on every rank after an agreement in which at least one rank ran out of memory."""

    def __init__(self, ranks: list[int], world_size: int, messages: list[str | None]):
        self.ranks = ranks
        first = next((m for m in messages if m), "")
        who = ", ".join(map(str, ranks))
        super().__init__(f"CUDA out of memory on rank{'s' if len(ranks) > 1 else ''} {who} of {world_size}: {first}")


@dataclass
class _GroupState:
    mesh: Any = None  # the device mesh FSDP2 shards over, made once (building it is a collective)
    ooms: int = 0  # out-of-memory errors inside collective work so far (the same count on every rank)


@dataclass(frozen=True)
class Dist:
    """This process's place among the ranks, and the few collectives oomtune itself calls. With no process group
    (`backend` none, the `LOCAL` one) or on the fake backend, a collective returns its inputs."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    backend: str = "none"  # none (one process, no group) | gloo (cpu) | nccl (cuda) | fake (the estimator)
    device: torch.device = torch.device("cpu")  # where the tensors of oomtune's own collectives live
    timeout_s: float = DEFAULT_TIMEOUT_S
    _state: _GroupState = field(default_factory=_GroupState, compare=False, repr=False)

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def grouped(self) -> bool:
        """A process group exists (possibly of one rank): the model is wrapped, a checkpoint is a DCP folder."""
        return self.backend != "none"

    @property
    def _talks(self) -> bool:
        """Collectives reach other processes."""
        return self.world_size > 1 and self.backend not in ("none", "fake")

    def _all_reduce(self, values: list[float], op) -> list[float]:
        if not self._talks:
            return list(values)
        t = torch.tensor(values, dtype=torch.float64, device=self.device)
        dist.all_reduce(t, op=op)
        return t.tolist()

    def max(self, *values: float) -> list[float]:
        return self._all_reduce(list(values), dist.ReduceOp.MAX)

    def min(self, *values: float) -> list[float]:
        return self._all_reduce(list(values), dist.ReduceOp.MIN)

    def sum(self, *values: float) -> list[float]:
        return self._all_reduce(list(values), dist.ReduceOp.SUM)

    def mean(self, value: float) -> float:
        return self.sum(value)[0] / self.world_size

    def barrier(self) -> None:
        if self._talks:
            dist.barrier()

    def agree(self, oom_message: str | None) -> None:
        """One agreement: raise RanksOutOfMemory on every rank if any rank passed a message (it ran out). One
        process without a group has nobody to agree with: nothing to do."""
        if not self.grouped:
            return
        flags = [0.0] * self.world_size
        flags[self.rank] = 1.0 if oom_message is not None else 0.0
        failed = [r for r, f in enumerate(self.sum(*flags)) if f]
        if not failed:
            return
        messages: list[str | None] = [oom_message]
        if self._talks:
            messages = [None] * self.world_size
            dist.all_gather_object(messages, oom_message)  # every rank saw the failure: all call this
        raise RanksOutOfMemory(failed, self.world_size, messages)

    def agreed(self, work: Callable[[], T], collectives: bool = False) -> T:
        """Run `work`; with a process group, agree on whether any rank ran out of memory (see `agree`).
        `collectives`: the work itself holds collectives (FSDP's), so a rank that ran out alone cannot agree."""
        if not self.grouped:
            return work()
        oom = None
        try:
            result = work()
        except RanksOutOfMemory:
            raise  # agreed inside
        except Exception as e:
            if not is_oom(e):
                raise
            oom = first_line(e)
        if oom is not None and collectives and not self.all_ran_out():
            raise LoneOutOfMemory(self.rank, oom)
        self.agree(oom)  # outside the except block: the failed work's frames are gone
        return result

    def all_ran_out(self) -> bool:
        """After this rank ran out of memory inside work that holds collectives (FSDP): did every rank? Asked
        through the rendezvous store, which a peer blocked in a collective does not need to answer."""
        if not self._talks:
            return True
        store = dist.distributed_c10d._get_default_store()
        self._state.ooms += 1
        prefix = f"oomtune/oom/{self._state.ooms}"
        store.set(f"{prefix}/{self.rank}", "1")
        # the others strike within moments, if at all; and answer before a peer's collective times out
        wait = dt.timedelta(seconds=min(10.0, self.timeout_s / 2))
        try:
            store.wait([f"{prefix}/{r}" for r in range(self.world_size)], wait)
        except (RuntimeError, dist.DistError):  # DistStoreError: timed out
            return False
        return True

    def mesh(self):
        if not self.grouped:
            raise OomtuneError("a device mesh needs a process group (a ddp / fsdp plan)")
        if self._state.mesh is None:
            from torch.distributed.device_mesh import init_device_mesh

            self._state.mesh = init_device_mesh(self.device.type, (self.world_size,))
        return self._state.mesh


LOCAL = Dist()  # one process, no process group: never mutated (its collectives and agreements do nothing)


def init(device_kind: str, sharding: str, timeout_s: float = DEFAULT_TIMEOUT_S) -> Dist:
    """Join the ranks torchrun started (its environment variables), or form a world of one for a ddp/fsdp plan run
    without torchrun (a checkpoint of N ranks resumed on one); LOCAL for a plain single-process run."""
    launched = launched_by_torchrun()
    if not launched and sharding == "none" and not dist.is_initialized():
        return LOCAL
    backend = "nccl" if device_kind == "cuda" else "gloo"
    local_rank = int(os.environ.get("LOCAL_RANK", "0")) if launched else 0
    if device_kind == "cuda":
        torch.cuda.set_device(local_rank)
    if not dist.is_initialized():
        # the join gets its own, longer wait: a rank that starts slowly on a loaded machine is not one that died
        timeout = dt.timedelta(seconds=max(timeout_s, JOIN_TIMEOUT_S))
        try:
            if launched:
                dist.init_process_group(backend, timeout=timeout)
            else:
                dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
        except (RuntimeError, ValueError) as e:
            raise OomtuneError(f"could not join the other ranks ({backend}): {first_line(e)}") from None
        # a process that exits with its group alive can abort (SIGABRT) in interpreter teardown, when gloo's
        # threads drop their last tensors: destroy it while the interpreter is whole, however the command ends
        atexit.register(close)
    device = torch.device("cuda", local_rank) if backend == "nccl" else torch.device("cpu")
    d = Dist(dist.get_rank(), dist.get_world_size(), local_rank, dist.get_backend(), device, timeout_s=timeout_s)
    d.mesh()  # now, outside any measured work (FSDP needs it; building it is a collective)
    _set_collective_timeout(timeout_s)
    return d


def _set_collective_timeout(timeout_s: float) -> None:
    """After the join, collectives wait `--dist-timeout` (torch < 2.3 has no setter: there they wait the join's)."""
    setter = getattr(dist.distributed_c10d, "_set_pg_timeout", None)
    if setter is not None and dist.get_backend() in ("gloo", "nccl"):
        setter(dt.timedelta(seconds=timeout_s))


@contextlib.contextmanager
def fake_world(world_size: int) -> Iterator[Dist]:
    """A process group of `world_size` ranks that exist only as rank 0 here (collectives do nothing): FSDP2 shards
    for that many ranks, which is what the estimator needs to measure one rank's memory on fake tensors."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        raise OomtuneError("a process group already exists in this process: cannot estimate a fake world")
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world_size)
    try:
        d = Dist(0, world_size, 0, "fake", torch.device("cpu"))
        d.mesh()
        yield d
    finally:
        dist.destroy_process_group()


def ranks_for(plan, device, d: Dist = LOCAL) -> contextlib.AbstractContextManager[Dist]:
    """The ranks a plan needs: `d` for one process or where `d` has its group; for ddp / fsdp on the fake device a
    fake world of plan.world_size ranks (rank 0's memory is measured; a rank's is what each needs, FSDP shards
    evenly)."""
    if plan.sharding == "none" or d.grouped:
        return contextlib.nullcontext(d)
    if device.kind != "fake":
        raise OomtuneError(f"a plan for {plan.world_size} ranks ({plan.sharding}) is measured here on the fake device "
                           "only; on real ranks use `oomtune probe --nproc-per-node`")
    return fake_world(plan.world_size)


def close() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
