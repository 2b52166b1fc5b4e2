"""SDPA and dropout as a CUDA card runs them, on the cpu device (memory/cuda_attention.py, cuda_kernels.py): the
backend PyTorch's sdp_utils would pick, the values and gradients PyTorch's own ops compute, and the memory the
chosen kernel keeps."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from oomtune.memory.cards import GpuSpec, find_gpu
from oomtune.memory.cuda_attention import Call, choose_backend, gemm_alignment
from oomtune.memory.cuda_kernels import cuda_kernels
from oomtune.memory.tracker import MemoryTracker, rounded

H100, RTX4090, A100, T4 = (find_gpu(n) for n in ("h100", "rtx4090", "a100-80", "t4"))
BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32


def qkv(b=2, h=4, t=64, d=64, dtype=BF16, kv_heads=None, tk=None, grad=True):
    """(B, H, T, D) views of a (B, T, H, D) projection, as a transformer makes them."""
    def one(heads, steps):
        return torch.randn(b, steps, heads, d, dtype=dtype).transpose(1, 2).requires_grad_(grad)
    return one(h, t), one(kv_heads or h, tk or t), one(kv_heads or h, tk or t)


def call(q, k, v, **kw) -> Call:
    return Call(q, k, v, **kw)


@pytest.mark.parametrize(("card", "kw", "inputs", "want"), [
    (A100, {"causal": True}, {}, "flash"),  # bf16, no mask: flash
    (H100, {}, {"dtype": FP16, "d": 128}, "flash"),
    (A100, {}, {"dtype": FP32}, "efficient"),  # flash is fp16/bf16 only; efficient takes fp32 on sm80
    (T4, {}, {"dtype": FP16}, "efficient"),  # no flash below sm80
    (T4, {}, {"dtype": BF16}, "math"),  # nor bf16 in the efficient kernel below sm80
    (A100, {"mask": torch.zeros(64, 64, dtype=BF16)}, {}, "efficient"),  # flash takes no mask
    (A100, {}, {"d": 320}, "efficient"),  # flash: head dim at most 256
    (A100, {}, {"d": 66, "dtype": FP32}, "math"),  # efficient: fp32 head dim a multiple of 4 on sm80 (66 is not)
    (A100, {"causal": True}, {"tk": 32}, "efficient"),  # flash: causal only with as many keys as queries
    (RTX4090, {}, {"d": 200}, "efficient"),  # sm89 training: flash refuses head dims in (192, 224]
    (RTX4090, {}, {"d": 200, "grad": False}, "flash"),  # ... but not without a backward
    (H100, {}, {"d": 200}, "flash"),  # sm90 has no such rule
    (A100, {"gqa": True}, {"kv_heads": 2}, "flash"),  # grouped query heads with enable_gqa
    (A100, {}, {"kv_heads": 2}, "math"),  # ... without it the heads must be equal
    (H100, {"gqa": True, "causal": True}, {"kv_heads": 2, "dtype": FP32}, "math"),  # efficient: never grouped heads
    (H100, {"gqa": True, "mask": torch.zeros(64, 64, dtype=BF16)}, {"kv_heads": 2}, "math"),  # flash: no mask
])
def test_the_backend_is_the_one_sdp_utils_picks(card, kw, inputs, want):
    assert choose_backend(card, call(*qkv(**inputs), **kw)) == want


def test_the_efficient_kernels_alignment_follows_minimum_gemm_alignment():
    assert gemm_alignment((8, 0), half=True) == 8 and gemm_alignment((8, 0), half=False) == 4
    assert gemm_alignment((7, 5), half=True) == 8 and gemm_alignment((7, 5), half=False) == 1
    assert gemm_alignment((6, 1), half=True) == 1


def test_3d_inputs_run_the_math_backend():
    q = torch.randn(4, 16, 8, dtype=FP16)
    assert choose_backend(A100, call(q, q, q)) == "math"


@pytest.mark.parametrize(("card", "dtype", "mask"), [(A100, BF16, False), (A100, FP32, True), (T4, FP32, True),
                                                     (T4, BF16, False)])
def test_values_and_gradients_are_pytorchs_own(card, dtype, mask):
    """flash, efficient (a bool mask), efficient and math: the same output and gradients as F.sdpa on the cpu (bf16:
    within bf16's rounding, as the CPU's kernel and the math backend round at different steps)."""
    torch.manual_seed(0)
    q, k, v = qkv(t=16, d=8, dtype=dtype)
    m = torch.rand(16, 16) > 0.3 if mask else None
    ref = F.scaled_dot_product_attention(q, k, v, attn_mask=m, is_causal=not mask)
    ref_grads = torch.autograd.grad(ref.float().square().sum(), (q, k, v))
    with cuda_kernels(card):
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=m, is_causal=not mask)
        grads = torch.autograd.grad(out.float().square().sum(), (q, k, v))
    tol = {"atol": 5e-2, "rtol": 2e-2} if dtype != FP32 else {"atol": 1e-5, "rtol": 1e-4}
    torch.testing.assert_close(out, ref, **tol)
    for g, r in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(g, r, **tol)


def _saved_bytes(card, q, k, v, **kw) -> int:
    """Bytes the forward leaves alive besides its inputs (what it saved for backward, and the output)."""
    with cuda_kernels(card), MemoryTracker() as tracker:
        out = F.scaled_dot_product_attention(q, k, v, **kw)
        live = tracker.live_bytes
    del out
    return live


def test_flash_keeps_the_output_and_its_logsumexp_and_math_the_attention_matrix():
    b, h, t, d = 2, 4, 64, 64
    q, k, v = qkv(b, h, t, d)
    out = rounded(b * h * t * d * 2)
    assert _saved_bytes(A100, q, k, v, is_causal=True) == out + rounded(b * h * t * 4)  # + (B, H, T) fp32
    q60, k60, v60 = qkv(b, h, 60, d)  # efficient: (B, H, T32) fp32, and a copy of the mask padded to 16 columns
    assert _saved_bytes(A100, q60, k60, v60, attn_mask=torch.zeros(60, 60, dtype=BF16)) == \
        rounded(b * h * 60 * d * 2) + rounded(b * h * 64 * 4) + rounded(60 * 64 * 2)
    math_saved = _saved_bytes(T4, q, k, v, is_causal=True)  # bf16 on sm75: math, computed in fp32
    assert math_saved > out + b * h * t * t * 4  # at least the (B, H, T, T) fp32 softmax


def test_the_backward_holds_flashs_scratch():
    b, h, t, d = 1, 2, 100, 40
    q, k, v = qkv(b, h, t, d)
    with cuda_kernels(A100), MemoryTracker() as tracker:
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        before = tracker.live_bytes
        tracker.reset_peak()
        grads = torch.autograd.grad(out.float().sum(), (q, k, v))
        extra = tracker.peak_bytes - before
    scratch = rounded(b * h * 128 * 4) + rounded(b * 128 * h * 64 * 4)  # softmax_d (B,H,T128), dq_accum (B,T128,H,D32)
    assert extra >= scratch + 3 * rounded(b * h * t * d * 2)  # and dq, dk, dv
    del grads


def test_checkpointing_recomputes_through_the_same_kernel():
    lin = torch.nn.Linear(16, 48)

    def block(x):
        q, k, v = (t.transpose(1, 2) for t in lin(x).view(2, 8, 3, 2, 8).unbind(2))
        return F.scaled_dot_product_attention(q, k, v, is_causal=True).float().sum()

    x = torch.randn(2, 8, 16, requires_grad=True)
    with cuda_kernels(A100), torch.autocast("cpu", dtype=BF16):
        checkpoint(block, x, use_reentrant=False).backward()  # a different kernel in the recompute raises
    assert x.grad is not None and torch.isfinite(x.grad).all()


def test_dropout_keeps_cudas_bool_mask_not_the_cpus_float_noise():
    x = torch.randn(64, 256, requires_grad=True)
    with MemoryTracker() as tracker:
        y = F.dropout(x, 0.1)
        cpu_kept = tracker.live_bytes
    with cuda_kernels(A100), MemoryTracker() as tracker:
        z = F.dropout(x, 0.1)
        cuda_kept = tracker.live_bytes
    assert cpu_kept == 2 * rounded(64 * 256 * 4)  # output + fp32 noise
    assert cuda_kept == rounded(64 * 256 * 4) + rounded(64 * 256)  # output + bool mask
    kept = (z != 0).float().mean().item()
    assert 0.85 < kept < 0.95 and torch.allclose(z[z != 0], x[z != 0] / 0.9)  # the same op: scaled by 1/(1-p)
    z.sum().backward()
    assert torch.equal(x.grad, (z != 0).float() / 0.9)
    del y
    with cuda_kernels(A100):
        assert F.dropout(x, 0.1, training=False) is x


def test_the_switches_of_sdpa_kernel_turn_backends_off_as_on_cuda():
    from torch.nn.attention import SDPBackend, sdpa_kernel

    q, k, v = qkv()
    with sdpa_kernel(SDPBackend.MATH):
        assert choose_backend(A100, call(q, k, v)) == "math"
    with sdpa_kernel(SDPBackend.EFFICIENT_ATTENTION):
        assert choose_backend(A100, call(q, k, v)) == "efficient"
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION), pytest.raises(RuntimeError, match="No available kernel"):
        choose_backend(A100, call(q, k, v, mask=torch.zeros(64, 64, dtype=BF16)))


def test_a_mask_whose_last_stride_is_not_1_needs_the_math_backend():
    q, k, v = qkv()
    mask = torch.zeros(64, 64, dtype=BF16).t()  # a transposed view: last stride 64
    assert choose_backend(A100, call(q, k, v, mask=mask)) == "math"
    assert choose_backend(A100, call(q, k, v, mask=mask.contiguous())) == "efficient"


def test_the_efficient_backward_accumulates_grad_q_in_fp32_from_sm70_for_fp32_too():
    def backward_extra(card):
        q, k, v = qkv(1, 2, 64, 16, dtype=FP32)
        with cuda_kernels(card), MemoryTracker() as tracker:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=torch.zeros(64, 64))
            before = tracker.live_bytes
            tracker.reset_peak()
            grads = torch.autograd.grad(out.sum(), (q, k, v))
            return tracker.peak_bytes - before, grads

    on_a100, _ = backward_extra(A100)  # split keys: a (B, H, T, D) fp32 accumulator
    on_maxwell, _ = backward_extra(GpuSpec("a Maxwell card", None, (5, 2)))  # sm52: keys not split
    assert on_a100 - on_maxwell == rounded(1 * 2 * 64 * 16 * 4)


def test_flash_pads_a_head_dim_that_is_not_a_multiple_of_8():
    b, h, t = 1, 2, 64
    q, k, v = qkv(b, h, t, 12)  # padded to 16
    assert _saved_bytes(A100, q, k, v, is_causal=True) == rounded(b * h * t * 16 * 2) + rounded(b * h * t * 4)
    with cuda_kernels(A100):
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        grads = torch.autograd.grad(out.float().sum(), (q, k, v))
    assert out.shape[-1] == 12 and all(g.shape == t_.shape for g, t_ in zip(grads, (q, k, v), strict=True))
    ref = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    torch.testing.assert_close(out, ref, atol=5e-2, rtol=2e-2)


def test_math_taken_for_grouped_heads_alone_leaves_a_note_and_other_choices_none():
    """fp32 grouped heads on a card: math (efficient takes no grouped heads, flash no fp32), and a note says why the
    (B, H, T, T) matrix is kept; bf16 without a mask is flash's (no note); equal heads are efficient's (no note);
    bf16 with a mask and grouped heads is math again, the note without the fp16/bf16 clause."""
    from oomtune.memory.cuda_attention import kernel_notes

    def run(dtype, kv_heads, **kw):
        q, k, v = qkv(t=16, d=8, dtype=dtype, kv_heads=kv_heads, grad=False)
        with cuda_kernels(H100):
            F.scaled_dot_product_attention(q, k, v, enable_gqa=kv_heads is not None, **kw)
        return kernel_notes()

    kernel_notes()
    (note,) = run(FP32, 2, is_causal=True)
    assert note.startswith("on H100 80GB, fp32 attention with grouped query heads (4 query, 2 key/value) runs "
                           "PyTorch's math kernel") and "and flash only fp16/bf16 (the amp rung). In a transformers " \
        "model a padded batch" in note and note.endswith("so an unpadded batch is the worst case")
    assert run(FP32, 2, is_causal=True) == (note,) and kernel_notes() == ()  # once per choice, then forgotten
    for precision, said in (("bf16", ()), ("bf16-true", ()), ("fp32", (note,))):  # a plan's own attention only
        with cuda_kernels(H100):
            F.scaled_dot_product_attention(*qkv(t=16, d=8, dtype=FP32, kv_heads=2, grad=False), enable_gqa=True)
        assert kernel_notes(precision) == said
    assert run(BF16, 2, is_causal=True) == () and run(FP32, None) == ()
    (masked,) = run(BF16, 2, attn_mask=torch.zeros(16, 16, dtype=BF16))
    assert "bf16 attention" in masked and masked.endswith("the memory-efficient kernel takes no grouped heads")
