"""The model on several ranks: wrapped by DDP or FSDP2 (`wrap`), each micro-step without a gradient sync except
where the plan's sharding needs one (`micro_step`), DDP's gradients averaged once per optimizer step, after the
ranks agreed nobody ran out of memory (`sync_gradients`). Why it is done this way: group.py's module doc."""

from __future__ import annotations

import contextlib
import inspect

import torch
import torch.distributed as dist
from torch import nn

from ..errors import OomtuneError
from .group import Dist

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

