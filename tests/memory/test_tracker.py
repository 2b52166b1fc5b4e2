"""The memory accountant behind the cpu (and fake) device: bytes counted like the CUDA allocator counts them."""

import gc

import pytest
import torch

from oomtune.config.schema import Plan
from oomtune.memory.devices import CpuDevice, is_oom
from oomtune.memory.tracker import MemoryTracker, rounded
from oomtune.model_file import load_model_file
from oomtune.search.trial import run_trial

from ..conftest import EXAMPLES


def test_rounds_each_storage_up_to_512_bytes():
    assert [rounded(n) for n in (0, 1, 512, 513, 4096)] == [0, 512, 512, 1024, 4096]
    tr = MemoryTracker()
    with tr:
        a = torch.zeros(1, dtype=torch.uint8)  # 1 byte -> one 512-byte block
        b = torch.zeros(1000)  # 4000 bytes -> 4096
    assert tr.live_bytes == 512 + 4096
    del a, b


def test_a_storage_counts_once_however_many_views_share_it_and_leaves_with_the_last():
    tr = MemoryTracker()
    with tr:
        t = torch.zeros(256)  # 1024 bytes
        views = [t[:10], t.view(16, 16), t.t() if t.dim() == 2 else t[::2]]
    assert tr.live_bytes == 1024
    del t
    gc.collect()
    assert tr.live_bytes == 1024  # views keep the storage alive
    del views
    gc.collect()
    assert tr.live_bytes == 0
    assert tr.peak_bytes == 1024


def test_tensors_made_before_tracking_are_counted_with_track():
    model = torch.nn.Linear(100, 100)  # 40000 + 400 bytes -> 40448 + 512
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 100)).sum().backward()
    opt.step()
    tr = MemoryTracker()
    added = tr.track(model, opt)
    weights = rounded(100 * 100 * 4) + rounded(100 * 4)
    # weights + grads + exp_avg + exp_avg_sq (+ two 0-dim `step` tensors, one block each)
    assert added == 4 * weights + 2 * 512


def test_over_budget_raises_cuda_shaped_oom_in_forward_and_backward():
    model = torch.nn.Sequential(torch.nn.Linear(64, 4096), torch.nn.ReLU(), torch.nn.Linear(4096, 64))
    tr = MemoryTracker(budget_bytes=3 * 1024 * 1024)
    tr.track(model)
    with pytest.raises(torch.cuda.OutOfMemoryError, match=r"^CUDA out of memory\. Tried to allocate"):
        with tr:
            model(torch.randn(512, 64)).sum()  # forward: 512 x 4096 x 4 = 8 MiB of activations
    tr2 = MemoryTracker()
    tr2.track(model)
    with tr2:
        loss = model(torch.randn(64, 64)).sum()
    tr2.budget_bytes = tr2.live_bytes + 4096  # the forward fits; the gradients cannot
    with pytest.raises(torch.OutOfMemoryError):
        with tr2:
            loss.backward()


def test_is_oom_recognises_real_and_simulated_ooms_but_not_bugs():
    assert is_oom(torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 MiB"))
    assert is_oom(RuntimeError("CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling cublasCreate"))
    assert is_oom(RuntimeError("cuDNN error: CUDNN_STATUS_ALLOC_FAILED"))
    assert is_oom(RuntimeError("CUDA error: out of memory\nCUDA kernel errors might be asynchronously reported"))
    assert not is_oom(RuntimeError("mat1 and mat2 shapes cannot be multiplied (4x8 and 16x4)"))
    assert not is_oom(ValueError("CUDA out of memory"))


def test_twenty_ooms_in_a_row_leave_live_memory_at_baseline():
    """device: cpu. Each trial OOMs mid-step; cleanup happens outside the except block."""
    model_file = load_model_file(EXAMPLES / "tiny_gpt.py")
    device = CpuDevice("3MiB")  # the weights fit; a step at micro-batch 8, context 64 does not
    baseline = device.live_bytes()
    for _ in range(20):
        result = run_trial(model_file, Plan(micro_batch_size=8, context_length=64), device, steps=1)
        assert result.oom and result.oom_message.startswith("CUDA out of memory")
        assert device.live_bytes() == baseline
    ok = run_trial(model_file, Plan(micro_batch_size=1, context_length=8), CpuDevice("64MiB"), steps=1)
    assert not ok.oom  # and the same model still trains when it fits


def test_peak_is_split_by_phase_and_the_whole_step_is_counted():
    """device: cpu. The peak of a step is at least weights + grads + AdamW state, and lies in a named phase."""
    model_file = load_model_file(EXAMPLES / "tiny_gpt.py")
    r = run_trial(model_file, Plan(micro_batch_size=2, context_length=32), CpuDevice("1GiB"), steps=2)
    params = sum(rounded(p.numel() * 4) for p in model_file.build().parameters())
    assert r.peak_bytes >= 4 * params  # weights, gradients, exp_avg, exp_avg_sq
    assert set(r.phase_peaks) == {"setup", "forward", "backward", "optimizer"}
    assert r.peak_bytes == max(r.phase_peaks.values())
    assert r.batch_peak_bytes == max(r.phase_peaks["forward"], r.phase_peaks["backward"])
