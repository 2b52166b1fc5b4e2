"""Training on several ranks (processes, one per GPU, started by torchrun): the process group, how the model is
wrapped (DDP or FSDP2), when gradients are synchronised, and how the ranks agree on an out-of-memory error.

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
import inspect
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from torch import nn

from .devices import is_oom
from .errors import OOM_RELAUNCH, OomtuneError

DEFAULT_TIMEOUT_S = 300.0  # a collective waits this long for the other ranks before the run stops with an error
T = TypeVar("T")


def launched_by_torchrun() -> bool:
    """True in a worker started by torchrun (or anything that sets its environment variables)."""
    return all(k in os.environ for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"))


def env_rank() -> int:
    return int(os.environ.get("RANK", "0")) if launched_by_torchrun() else 0


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
class Dist:
    """This process's place among the ranks, and the few collectives oomtune itself calls."""

    rank: int
    world_size: int
    local_rank: int
    backend: str  # gloo (cpu) | nccl (cuda) | fake (the estimator)
    device: torch.device  # where the tensors of oomtune's own collectives live
    _mesh: Any = None
    timeout_s: float = DEFAULT_TIMEOUT_S
    _ooms: int = 0  # out-of-memory errors inside collective work so far (the same count on every rank)

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def _all_reduce(self, values: list[float], op) -> list[float]:
        if self.world_size == 1 or self.backend == "fake":
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

    def agree(self, oom_message: str | None) -> None:
        """One agreement: raise RanksOutOfMemory on every rank if any rank passed a message (it ran out)."""
        flags = [0.0] * self.world_size
        flags[self.rank] = 1.0 if oom_message is not None else 0.0
        failed = [r for r, f in enumerate(self.sum(*flags)) if f]
        if not failed:
            return
        messages: list[str | None] = [oom_message]
        if self.world_size > 1 and self.backend != "fake":
            messages = [None] * self.world_size
            dist.all_gather_object(messages, oom_message)  # every rank saw the failure: all call this
        raise RanksOutOfMemory(failed, self.world_size, messages)

    def all_ran_out(self) -> bool:
        """After this rank ran out of memory inside work that holds collectives (FSDP): did every rank? Asked
        through the rendezvous store, which a peer blocked in a collective does not need to answer."""
        if self.world_size == 1 or self.backend == "fake":
            return True
        store = dist.distributed_c10d._get_default_store()
        self._ooms += 1
        prefix = f"oomtune/oom/{self._ooms}"
        store.set(f"{prefix}/{self.rank}", "1")
        # the others strike within moments, if at all; and answer before a peer's collective times out
        wait = dt.timedelta(seconds=min(10.0, self.timeout_s / 2))
        try:
            store.wait([f"{prefix}/{r}" for r in range(self.world_size)], wait)
        except (RuntimeError, dist.DistError):  # DistStoreError: timed out
            return False
        return True

    def mesh(self):
        if self._mesh is None:
            from torch.distributed.device_mesh import init_device_mesh

            self._mesh = init_device_mesh(self.device.type, (self.world_size,))
        return self._mesh


def agreed(d: Dist | None, work: Callable[[], T], collectives: bool = False) -> T:
    """Run `work`; with several ranks, agree on whether any ran out of memory (see the module doc). `collectives`:
    the work itself holds collectives (FSDP's), so a rank that ran out alone cannot agree."""
    if d is None:
        return work()
    oom = None
    try:
        result = work()
    except RanksOutOfMemory:
        raise  # agreed inside
    except Exception as e:
        if not is_oom(e):
            raise
        oom = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    if oom is not None and collectives and not d.all_ran_out():
        raise LoneOutOfMemory(d.rank, oom)
    d.agree(oom)  # outside the except block: the failed work's frames are gone
    return result


def init(device_kind: str, sharding: str, timeout_s: float = DEFAULT_TIMEOUT_S) -> Dist | None:
    """Join the ranks torchrun started (its environment variables), or form a world of one for a ddp/fsdp plan run
    without torchrun (a checkpoint of N ranks resumed on one); None for a plain single-process run."""
    launched = launched_by_torchrun()
    if not launched and sharding == "none" and not dist.is_initialized():
        return None
    backend = "nccl" if device_kind == "cuda" else "gloo"
    local_rank = int(os.environ.get("LOCAL_RANK", "0")) if launched else 0
    if device_kind == "cuda":
        torch.cuda.set_device(local_rank)
    if not dist.is_initialized():
        timeout = dt.timedelta(seconds=timeout_s)
        try:
            if launched:
                dist.init_process_group(backend, timeout=timeout)
            else:
                dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
        except (RuntimeError, ValueError) as e:
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise OomtuneError(f"could not join the other ranks ({backend}): {first}") from None
        # a process that exits with its group alive can abort (SIGABRT) in interpreter teardown, when gloo's
        # threads drop their last tensors: destroy it while the interpreter is whole, however the command ends
        atexit.register(close)
    device = torch.device("cuda", local_rank) if backend == "nccl" else torch.device("cpu")
    d = Dist(dist.get_rank(), dist.get_world_size(), local_rank, dist.get_backend(), device, timeout_s=timeout_s)
    d.mesh()  # now, outside any measured work (FSDP needs it; building it is a collective)
    return d


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


def check_world(world_size: int, sharding: str | None) -> None:
    if world_size < 1:
        raise OomtuneError(f"--world-size must be at least 1, got {world_size}")
    if sharding is not None and sharding not in ("none", "ddp", "fsdp"):
        raise OomtuneError(f"--sharding {sharding!r}: expected none, ddp or fsdp")
    if sharding == "none" and world_size > 1:
        raise OomtuneError(f"--sharding none is one process: with --world-size {world_size} use ddp or fsdp")
    if sharding == "fsdp" and (why := fsdp_unsupported("cpu")) is not None:  # the fake device's tensors are cpu's
        raise OomtuneError(f"--sharding fsdp: {why}")


def ranks_for(plan, device, dist: Dist | None = None) -> contextlib.AbstractContextManager:
    """The ranks a plan needs: none for one process; for ddp / fsdp on the fake device a fake world of
    plan.world_size ranks (rank 0's memory is measured; a rank's is what each needs, FSDP shards evenly)."""
    if plan.sharding == "none" or dist is not None:
        return contextlib.nullcontext(dist)
    if device.kind != "fake":
        raise OomtuneError(f"a plan for {plan.world_size} ranks ({plan.sharding}) is measured here on the fake device "
                           "only; on real ranks use `oomtune probe --nproc-per-node`")
    return fake_world(plan.world_size)


def close() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


# -- the model on several ranks ------------------------------------------------------------------------

FSDP_OFF_CUDA_SINCE = (2, 7)  # before it, FSDP2 made CUDA streams whatever the device (CPU streams lacked events)


def _torch_version() -> tuple[int, int]:
    major, minor = str(torch.__version__).split(".")[:2]
    return int(major), int("".join(ch for ch in minor if ch.isdigit()) or 0)


def fsdp_unsupported(device_type: str) -> str | None:
    """Why FSDP2 cannot run on this device type with this torch (None: it can). Off CUDA (the cpu and fake
    devices, gloo) it needs torch 2.7: earlier, its first forward asks for a CUDA stream."""
    if device_type == "cuda" or _torch_version() >= FSDP_OFF_CUDA_SINCE:
        return None
    return (f"FSDP2 runs off CUDA (on the {device_type} device) only from torch "
            f"{'.'.join(map(str, FSDP_OFF_CUDA_SINCE))}; this is torch {torch.__version__}")


def wrap(model: nn.Module, sharding: str, blocks: list[nn.Module], d: Dist) -> nn.Module:
    """ddp: DistributedDataParallel (it broadcasts rank 0's weights); fsdp: FSDP2 `fully_shard` on every block, then
    on the root (every rank must have built the same weights: oomtune seeds them alike)."""
    if sharding == "ddp" and d.backend == "fake":
        return _fake_ddp(model)
    if sharding == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        ids = [d.local_rank] if d.device.type == "cuda" else None
        # buffers are broadcast once, at construction, never in forward (a collective inside the agreed work)
        no_forward_sync = ({"forward_sync_buffers": False}
                           if "forward_sync_buffers" in inspect.signature(DistributedDataParallel).parameters
                           else {"broadcast_buffers": False})
        return DistributedDataParallel(model, device_ids=ids, **no_forward_sync)
    if sharding == "fsdp":
        if (why := fsdp_unsupported(d.device.type)) is not None:
            raise OomtuneError(f"cannot shard the model: {why} (use ddp, or a newer torch)")
        try:
            from torch.distributed.fsdp import fully_shard
        except ImportError:  # torch < 2.6: FSDP2 under its first name
            from torch.distributed._composable.fsdp import fully_shard

        mesh = d.mesh()
        for block in blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        return model
    raise OomtuneError(f"sharding {sharding!r}: expected ddp or fsdp")


DDP_FIRST_BUCKET_BYTES, DDP_BUCKET_BYTES = 1 << 20, 25 << 20  # DDP's defaults (bucket_cap_mb=25)


def _fake_ddp(model: nn.Module) -> nn.Module:
    """DDP cannot wrap fake tensors (the estimator's); what it costs in memory is its reducer's flat buckets, as
    large as the gradients, allocated when it is built: allocate those (parameters in reverse, a 1 MiB first
    bucket then 25 MiB ones, per dtype, as DDP buckets them) and keep them with the model."""
    buckets: list[torch.Tensor] = []
    open_: dict[torch.dtype, list[int]] = {}  # dtype -> [elements, cap bytes]
    for p in reversed([p for p in model.parameters() if p.requires_grad]):
        size, cap = open_.setdefault(p.dtype, [0, DDP_FIRST_BUCKET_BYTES])
        if size and (size + p.numel()) * p.element_size() > cap:
            buckets.append(torch.empty(size, dtype=p.dtype, device=p.device))
            size, cap = 0, DDP_BUCKET_BYTES
        open_[p.dtype] = [size + p.numel(), cap]
    for dtype, (size, _) in open_.items():
        if size:
            buckets.append(torch.empty(size, dtype=dtype, device=next(model.parameters()).device))
    model._oomtune_ddp_buckets = buckets  # lives as long as the model, like DDP's reducer
    return model


def unwrapped(model: nn.Module) -> nn.Module:
    return getattr(model, "module", model) if type(model).__name__ == "DistributedDataParallel" else model


def micro_step(model: nn.Module, sharding: str, last: bool) -> contextlib.AbstractContextManager:
    """The context of one micro-step: ddp never synchronises inside it (see the module doc); fsdp reduce-scatters
    gradients only in the last micro-step of an optimizer step."""
    if sharding == "ddp":
        return model.no_sync() if hasattr(model, "no_sync") else contextlib.nullcontext()
    if sharding == "fsdp":
        model.set_requires_gradient_sync(last)
    return contextlib.nullcontext()


def sync_gradients(model: nn.Module, sharding: str, d: Dist) -> None:
    """ddp: average the gradients over the ranks, once per optimizer step (after the agreement)."""
    if sharding != "ddp" or d.world_size == 1 or d.backend == "fake":
        return
    grads = []
    for p in model.parameters():
        if p.requires_grad:
            if p.grad is None:  # unused on this rank: its peers may have a gradient to average with
                p.grad = torch.zeros_like(p)
            grads.append(p.grad)
    works = [dist.all_reduce(g, async_op=True) for g in grads]
    for w in works:
        w.wait()
    torch._foreach_div_(grads, float(d.world_size))
