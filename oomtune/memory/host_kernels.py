"""What this host's CPU cannot compute where the cpu and fake devices account CPU semantics (no `--gpu`).

Under CPU autocast nn.LSTM runs oneDNN's RNN in the autocast dtype, and oneDNN builds a bf16 or fp16 RNN only on
CPUs that have those instructions (AVX-512 and up): on an AVX2 host every forward raises "could not create a
primitive descriptor for the LSTM forward propagation primitive", on the cpu device (which computes) and on the
fake device alike (which reads the workspace's size from one real call, cpu_kernels.py). Measured on torch 2.13,
AMD EPYC with AVX2: LSTM fails in bf16 and fp16; GRU and RNN run; a bf16 LSTM without autocast (bf16-true) runs
ATen's own kernel. With a card (`--gpu`) CUDA autocast's rules apply and the LSTM runs.

`lstm_autocast_fails(dtype)` answers by running a one-unit LSTM once a dtype; the ladder then has no amp rung for
a model with an nn.LSTM on such a host, and says so (search/probe.py), instead of stopping at the first amp trial
with the library's error blamed on the model file.
"""

from __future__ import annotations

import functools

import torch
from torch.utils._python_dispatch import _disable_current_modes

_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


@functools.cache
def lstm_autocast_fails(precision: str) -> str | None:
    """The error an nn.LSTM's forward under CPU autocast in `precision` ("bf16" / "fp16") raises on this host, in
    a few words; None where it runs (or `precision` is not an autocast dtype)."""
    dtype = _DTYPES.get(precision)
    if dtype is None:
        return None
    with _disable_current_modes(), torch.inference_mode(False):
        lstm = torch.nn.LSTM(1, 1)
        try:
            with torch.autocast("cpu", dtype=dtype):
                lstm(torch.zeros(1, 1, 1))
        except RuntimeError as e:
            return str(e).split(". ")[0]
    return None


def has_lstm(model: torch.nn.Module) -> bool:
    return any(isinstance(m, torch.nn.LSTM) for m in model.modules())


def amp_cannot_run(lstm: bool, device, amp: str) -> str | None:
    """Why an amp rung (--amp: auto, bf16, fp16) cannot run on `device` on this host, as a note's words (None: it
    can): a model with an nn.LSTM (`lstm`), on a simulated device that accounts CPU semantics (no card)."""
    if not lstm or device.kind == "cuda" or device.card is not None:
        return None
    precision = device.amp_dtype() if amp == "auto" else amp
    reason = lstm_autocast_fails(precision)
    if reason is None:
        return None
    return (f"has an nn.LSTM, which this CPU cannot run under {precision} autocast (oneDNN: {reason}; it needs "
            f"AVX-512), and the {device.kind} device runs it on this CPU: the ladder has no amp rung here. On a GPU "
            "it runs: add --gpu NAME to account as that card would (CUDA autocast)")


def _cpu_autocast_dtype() -> str:
    return {d: name for name, d in _DTYPES.items()}.get(torch.get_autocast_dtype("cpu"), "16-bit")


def lstm_hint(error: BaseException) -> str:
    """A hint for `error` where it is oneDNN's failure to build an LSTM under CPU autocast (check and train run the
    plan they are given, and a model file may autocast by itself), else ''."""
    if "could not create a primitive descriptor for the LSTM" not in str(error):
        return ""
    if not torch.is_autocast_enabled("cpu"):
        return ""
    dtype = _cpu_autocast_dtype()
    return (f" (this CPU cannot run an nn.LSTM under {dtype} autocast, which needs AVX-512: on the cpu and fake "
            "devices give it an fp32 plan, or --gpu NAME to account as that card would)")


DTYPE_CLASHES = ("must have the same scalar type", "expected scalar type", "must have the same dtype",
                 "to have the same dtype")  # torch's words where two operands' dtypes differ


def dtype_clash_hint(error: BaseException) -> str:
    """A hint for `error` where it is two dtypes that met under CPU autocast, else '': CPU autocast keeps fewer ops
    in fp32 than CUDA's (softmax among them), so a model that adds such an op's output into an fp32 tensor
    (index_add_ in a mixture of experts) fails there, and runs under CUDA autocast."""
    if not any(s in str(error) for s in DTYPE_CLASHES) or not torch.is_autocast_enabled("cpu"):
        return ""
    dtype = _cpu_autocast_dtype()
    return (f" (under CPU {dtype} autocast, which keeps fewer ops in fp32 than CUDA's, softmax among them: --gpu "
            "NAME accounts by that card's CUDA rules; without it, an fp32 plan: leave amp out of --levers)")


def host_hint(error: BaseException) -> str:
    """What this host adds to a model error's line ('' where nothing): its CPU autocast, or bitsandbytes' 4-bit
    loading, which cannot run on the simulated devices' tensors (levers/nf4_bnb.py)."""
    from ..levers.nf4_bnb import loading_hint

    return lstm_hint(error) or dtype_clash_hint(error) or loading_hint(error)


__all__ = ["amp_cannot_run", "dtype_clash_hint", "has_lstm", "host_hint", "lstm_autocast_fails", "lstm_hint"]
