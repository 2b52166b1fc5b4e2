"""What a backward that raised leaves alive, let go.

Autograd's engine runs a backward's CPU work from a queue that belongs to the calling thread and outlives the
backward. When a backward raises (an out-of-memory error in a trial), the tasks still queued stay there, each with
its node and the gradients handed to it, until the next backward on that thread pops them: an expired task comes
first, and is dropped. Under non-reentrant activation checkpointing those nodes hold checkpoint's hooks, and the hooks
hold the block's recompute (its module and inputs) and the tensors it recomputed: measured, after an OOM in a PEFT
LoRA Mistral's recompute (2 layers, micro-batch 1, context 64, bf16), 2.5 MB of weights, autocast copies and
activations stayed alive, and the next trial's peak read 1.0 MB higher. torch alone does it (a 2-block model whose
backward raises after a recompute); a backward with no checkpointed block left nothing behind in the same test.

`drop_failed_backward` runs one backward of a scalar on the CPU, outside every mode, which drains the queue. A
device's release calls it after every trial.
"""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import _disable_current_modes


def drop_failed_backward() -> None:
    """Run one trivial backward on this thread (see the module doc): a failed backward's queued tasks are dropped."""
    with _disable_current_modes(), torch.inference_mode(False), torch.enable_grad():
        leaf = torch.zeros((), device="cpu", requires_grad=True)
        (leaf * 1.0).backward()
