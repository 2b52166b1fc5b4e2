"""CUDA autocast's policy on the cpu device (memory/cuda_autocast.py), checked against PyTorch's own CUDA autocast.

Device: cpu, and PyTorch's real AutocastCUDA kernels run on fake tensors placed on a cuda device (no GPU is touched:
fake tensors hold no memory, and autocast only casts)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode

from oomtune.memory.cards import find_gpu
from oomtune.memory.cuda_autocast import BANNED, LISTS_FROM, POLICIES, cuda_autocast, overload
from oomtune.memory.cuda_kernels import cuda_kernels
from oomtune.memory.recorder import Recorder
from oomtune.memory.tracker import MemoryTracker


def _samples(t):
    """op -> (args, kwargs) built by `t(*shape)` (a float32 tensor) for every op whose dtype the test compares."""
    x, y, m, v8, v4 = t(4, 8), t(4, 8), t(8, 8), t(8), t(4)  # (no indexing: fake cuda tensors cannot be sliced)
    b3, c3 = t(2, 4, 8), t(2, 8, 4)
    img, w2 = t(1, 2, 6, 6), t(3, 2, 3, 3)
    idx = torch.zeros(4, dtype=torch.long, device=x.device)
    unary = ("acos", "asin", "cosh", "erfinv", "exp", "expm1", "log", "log10", "log2", "log1p", "reciprocal",
             "rsqrt", "sinh", "tan", "softplus", "logsumexp", "cumsum", "cumprod", "prod", "sum", "linalg_vector_norm",
             "frobenius_norm.dim", "renorm", "pdist", "nuclear_norm", "linalg_matrix_norm", "norm.Scalar")
    out = {name: ((x,), {}) for name in unary}
    out.update({
        "logsumexp": ((x, [1]), {}), "cumsum": ((x, 1), {}), "cumprod": ((x, 1), {}), "prod.dim_int": ((x, 1), {}),
        "sum.dim_IntList": ((x, [1]), {}), "frobenius_norm.dim": ((x, [1]), {}), "renorm": ((x, 2.0, 0, 1.0), {}),
        "nuclear_norm.dim": ((x, [0, 1]), {}), "norm.ScalarOpt_dim": ((x, 2.0, [1]), {}),
        "linalg_matrix_norm.str_ord": ((x,), {"ord": "fro"}), "linalg_matrix_norm": ((x, 1.0), {}),
        "softmax.int": ((x, -1), {}),
        "log_softmax.int": ((x, -1), {}), "pow.Tensor_Scalar": ((x, 2.0), {}), "pow.Tensor_Tensor": ((x, y), {}),
        "pow.Scalar": ((2.0, x), {}), "linear": ((x, m), {}), "matmul": ((x, m), {}), "mm": ((x, m), {}),
        "mv": ((m, v8), {}), "addmm": ((x, x, m), {}), "addmv": ((v8, m, v8), {}),
        "addr": ((m, v8, v8), {}), "bmm": ((b3, c3), {}), "baddbmm": ((t(2, 4, 4), b3, c3), {}),
        "addbmm": ((t(4, 4), b3, c3), {}), "einsum": (("ij,jk->ik", [x, m]), {}), "chain_matmul": (([m, m, m],), {}),
        "linalg_multi_dot": (([x, m, m],), {}), "linalg_vecdot": ((x, y), {}), "prelu": ((x, t(1)), {}),
        "conv1d": ((t(1, 2, 6), t(3, 2, 3)), {}), "conv2d": ((img, w2), {}),
        "conv3d": ((t(1, 2, 4, 4, 4), t(3, 2, 3, 3, 3)), {}),
        "conv_transpose1d": ((t(1, 2, 6), t(2, 3, 3)), {}), "conv_transpose2d.input": ((img, t(2, 3, 3, 3)), {}),
        "layer_norm": ((x, [8]), {}), "native_layer_norm": ((x, [8], None, None, 1e-5), {}),
        "group_norm": ((t(2, 4, 3), 2), {}), "rms_norm": ((x, [8]), {}), "cosine_similarity": ((x, y), {}),
        "nll_loss": ((x, idx), {}), "mse_loss": ((x, y), {}), "l1_loss": ((x, y), {}), "smooth_l1_loss": ((x, y), {}),
        "huber_loss": ((x, y), {}), "kl_div": ((x, y), {}), "soft_margin_loss": ((x, y), {}),
        "binary_cross_entropy_with_logits": ((x, y), {}), "poisson_nll_loss": ((x, y, True, False, 1e-8, 1), {}),
        "hinge_embedding_loss": ((x, y), {}), "margin_ranking_loss": ((v8, v8, v8), {}),
        "cosine_embedding_loss": ((x, y, v4), {}), "multi_margin_loss": ((x, idx), {}),
        "multilabel_margin_loss": ((x, torch.zeros(4, 8, dtype=torch.long, device=x.device)), {}),
        "triplet_margin_loss": ((x, y, x), {}), "dist": ((x, y), {}), "cdist": ((b3, b3), {}),
        "upsample_nearest2d": ((img, [12, 12]), {}), "upsample_bilinear2d": ((img, [12, 12], False), {}),
        "addcmul": ((x, y, x), {}), "addcdiv": ((x, y, x), {}), "atan2": ((x, y), {}), "dot": ((v8, v8), {}),
        "vdot": ((v8, v8), {}), "cross": ((t(4, 3), t(4, 3)), {}), "tensordot": ((x, m, [1], [0]), {}),
        "scatter_add": ((x, 1, torch.zeros(4, 8, dtype=torch.long, device=x.device), y), {}),
        "bilinear": ((x, y, t(3, 8, 8)), {}),
        "scaled_dot_product_attention": ((t(1, 2, 4, 8), t(1, 2, 4, 8), t(1, 2, 4, 8)), {}),
        "convolution": ((img, w2, None, [1, 1], [0, 0], [1, 1], False, [0, 0], 1), {}),
        "conv_tbc": ((t(5, 1, 2), t(3, 2, 4), t(4), 1), {}),
        "conv_transpose3d.input": ((t(1, 2, 4, 4, 4), t(2, 3, 3, 3, 3)), {}),
        "upsample_nearest1d": ((t(1, 2, 6), [12]), {}), "upsample_linear1d": ((t(1, 2, 6), [12], False), {}),
        "upsample_nearest3d": ((t(1, 2, 4, 4, 4), [8, 8, 8]), {}), "upsample_bicubic2d": ((img, [12, 12], False), {}),
        "upsample_trilinear3d": ((t(1, 2, 4, 4, 4), [8, 8, 8], False), {}),
        "_upsample_nearest_exact2d": ((img, [12, 12]), {}), "_upsample_bilinear2d_aa": ((img, [12, 12], False), {}),
        "rnn_tanh_cell": ((x, t(4, 8), m, m), {}), "rnn_relu_cell": ((x, t(4, 8), m, m), {}),
        "index_put": ((x, [idx], y), {}),
        "nll_loss2d": ((t(1, 3, 4, 4), torch.zeros(1, 4, 4, dtype=torch.long, device=x.device)), {}),
    })
    return out


def _dtypes(out) -> tuple:
    return tuple(o.dtype for o in (out if isinstance(out, (tuple, list)) else (out,)) if isinstance(o, torch.Tensor))


def _mixed(args, kwargs, low):
    """Each op once with its tensors fp32, once with its first tensor in the lower precision (promote, eligibility)."""
    yield args, kwargs
    first = next((i for i, a in enumerate(args) if isinstance(a, torch.Tensor) and a.is_floating_point()), None)
    if first is not None:
        yield (*args[:first], args[first].to(low), *args[first + 1:]), kwargs


def _cuda_reference(name: str, low: torch.dtype) -> list[tuple]:
    """Output dtypes under PyTorch's own CUDA autocast, on fake cuda tensors."""
    with FakeTensorMode():
        samples = _samples(lambda *s: torch.randn(*s, device="cuda"))
        if name not in samples:
            return []
        args, kwargs = samples[name]
        prev = torch.is_autocast_enabled("cuda"), torch.get_autocast_dtype("cuda")
        torch.set_autocast_enabled("cuda", True)
        torch.set_autocast_dtype("cuda", low)
        try:
            return [_dtypes(overload(name)(*a, **k)) for a, k in _mixed(args, kwargs, low)]
        finally:
            torch.set_autocast_enabled("cuda", prev[0])
            torch.set_autocast_dtype("cuda", prev[1])
            torch.clear_autocast_cache()


def _emulated(name: str, low: torch.dtype) -> list[tuple]:
    args, kwargs = _samples(lambda *s: torch.randn(*s).abs() + 0.5)[name]
    with cuda_autocast(), torch.autocast("cpu", dtype=low):
        return [_dtypes(overload(name)(*a, **k)) for a, k in _mixed(args, kwargs, low)]


def test_the_lists_are_this_torchs_cuda_autocast_registrations():
    registered = {r.removeprefix("aten::") for r in torch._C._dispatch_get_registrations_for_dispatch_key(
        "AutocastCUDA") if r.startswith("aten::")}
    assert set(POLICIES) == registered, (LISTS_FROM, sorted(set(POLICIES) ^ registered))


@pytest.mark.parametrize("low", [torch.float16, torch.bfloat16])
def test_each_op_has_cuda_autocasts_output_dtype(low):
    compared = []
    for name in sorted(POLICIES):
        if name in BANNED:
            continue
        try:
            want = _cuda_reference(name, low)
        except (RuntimeError, NotImplementedError, AssertionError):  # a fake cuda kernel that needs a real GPU
            continue
        if want:
            assert _emulated(name, low) == want, name
            compared.append(name)
    # the ops an LLM or a CNN forward meets are all among the compared ones (a reference that cannot run is skipped)
    must = {"linear", "matmul", "bmm", "baddbmm", "addmm", "softmax.int", "log_softmax.int", "layer_norm",
            "group_norm", "rms_norm", "sum", "nll_loss", "exp", "pow.Tensor_Scalar", "mse_loss", "einsum", "cumsum",
            "conv2d", "addcmul", "norm.Scalar", "binary_cross_entropy_with_logits", "scaled_dot_product_attention"}
    assert must <= set(compared), sorted(must - set(compared))
    assert len(compared) >= 100  # of 118 (105 on torch 2.13: the rest have no sample or need a GPU)


class _Casts(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.weight_casts = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._to_copy.default and tuple(args[0].shape) == (8, 8):
            self.weight_casts += 1
        return func(*args, **(kwargs or {}))


def test_weights_are_cast_once_a_region_and_cpu_autocast_is_back_outside():
    x = torch.randn(4, 8)
    w = torch.nn.Parameter(torch.randn(8, 8))
    with cuda_autocast():
        for _ in range(2):  # the cache is emptied when the outermost region exits: once a region
            with _Casts() as seen, torch.autocast("cpu", dtype=torch.bfloat16):
                a, b = F.linear(x, w), F.linear(x, w)
                assert F.layer_norm(a, (8,)).dtype == torch.float32  # CUDA's policy: fp32
            assert a.dtype == b.dtype == torch.bfloat16 and seen.weight_casts == 1
    with _Casts() as seen, torch.autocast("cpu", dtype=torch.bfloat16):
        assert F.layer_norm(F.linear(x, w), (8,)).dtype == torch.bfloat16  # CPU autocast leaves layer_norm alone


def test_binary_cross_entropy_is_refused_as_cuda_autocast_refuses_it():
    x = torch.rand(4)
    with cuda_autocast(), torch.autocast("cpu", dtype=torch.float16), pytest.raises(RuntimeError, match="unsafe"):
        F.binary_cross_entropy(x, x)


A100 = find_gpu("a100-80")


def _births(fn, args) -> list[int]:
    """The bytes of each storage `fn` makes, in order, as the memory tracker counts them."""
    with MemoryTracker() as tracker:
        tracker.recorder = Recorder(tracker)
        fn(*args)
        return [r.nbytes for r in tracker.recorder.records]


COMPOSITES = {  # functions whose ops decompose below the autocast key: each piece meets the policy on its own
    "cross_entropy": lambda x, m, v, p: F.cross_entropy(x, torch.zeros(4, dtype=torch.long, device=x.device)),
    "cross_entropy, soft labels, smoothing": lambda x, m, v, p: F.cross_entropy(x, p, label_smoothing=0.1),
    "layer_norm with an affine": lambda x, m, v, p: F.layer_norm(x, (8,), v, v),
    "softmax then matmul": lambda x, m, v, p: F.softmax(x, -1) @ m,
    "gelu of a linear": lambda x, m, v, p: F.gelu(F.linear(x, m, v)),
    "normalize": lambda x, m, v, p: F.normalize(x, dim=-1),
}


@pytest.mark.parametrize("name", COMPOSITES)
def test_composite_functions_make_the_same_tensors_as_on_cuda(name):
    """The storages each makes, in order, as PyTorch's own CUDA autocast makes them. cross_entropy on CUDA: log_softmax
    in fp16 (its dtype is given, so autocast keeps it), then nll_loss in fp32; softmax of fp16 into fp32: one fused
    kernel, no fp32 copy of the input (the CPU makes one).
    (No tensor requires grad and none is sliced: a fake cuda tensor can do neither in a build without CUDA.)"""
    fn, low = COMPOSITES[name], torch.float16

    def inputs(device):
        return (torch.randn(4, 8, device=device).to(low), torch.randn(8, 8, device=device),
                torch.randn(8, device=device), torch.rand(4, 8, device=device))

    with FakeTensorMode():
        args = inputs("cuda")
        torch.set_autocast_enabled("cuda", True)
        try:
            cuda = _births(fn, args)
        finally:
            torch.set_autocast_enabled("cuda", False)
            torch.clear_autocast_cache()
    with cuda_autocast(), cuda_kernels(A100), torch.autocast("cpu", dtype=low):  # (as a card's device runs them)
        emulated = _births(fn, inputs("cpu"))
    assert emulated == cuda


def test_fp16_softmax_into_fp32_is_one_fused_kernel_with_or_without_autocast():
    """F.softmax(x, dtype=torch.float32) of an fp16 x: CUDA reads fp16 and writes fp32 in one kernel; the CPU would
    make an fp32 copy of x first."""
    def run(x):
        return F.softmax(x, -1, dtype=torch.float32), F.log_softmax(x, -1, dtype=torch.float32)

    with FakeTensorMode():
        cuda = _births(run, (torch.randn(64, 256, device="cuda", dtype=torch.float16),))
    x = torch.randn(64, 256, dtype=torch.float16, requires_grad=True)
    with cuda_kernels(A100):
        assert _births(run, (x,)) == cuda == [64 * 256 * 4] * 2
        out = F.softmax(x, -1, dtype=torch.float32)
    torch.testing.assert_close(out, F.softmax(x.float(), -1))
    out.square().sum().backward()
    assert x.grad.dtype == torch.float16
