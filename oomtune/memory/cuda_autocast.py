"""CUDA autocast's policy on the cpu and fake devices, for an estimate that stands in for a CUDA card.

The simulated devices run `torch.autocast("cpu")`, and CPU autocast casts a different set of ops than CUDA autocast:
CUDA runs softmax, log_softmax, layer_norm, sum and the losses in fp32 and casts more ops to fp16/bf16, CPU does
neither for most of them. Which tensors an amp forward saves for backward, and in which dtype, follows from that.
Inside `cuda_autocast()` the AutocastCPU dispatch key runs CUDA's policy instead: a kernel per op of CUDA's lists
(below) does what PyTorch's CUDA autocast wrapper does (aten/src/ATen/autocast_mode.h), and every op CPU autocast
casts that CUDA's lists do not is made a fallthrough (left alone, as on CUDA). Nothing changes outside.

The kernels run where CUDA's do, above autograd, so a cast is recorded by autograd and the cast tensor is what a
backward saves. (softmax of fp16 into fp32 then runs as CUDA's one fused kernel: cuda_kernels.py.) Lower-precision
casts of fp32 leaf tensors that require grad (the weights) are cached until the
outermost autocast region exits, as CUDA's cached_cast does: those are the "autocast weight copies".

The lists are PyTorch's CUDA lists (AT_FORALL_LOWER_PRECISION_FP, AT_FORALL_FP32, AT_FORALL_FP32_SET_OPT_DTYPE,
AT_FORALL_DIFFERENT_REDISPATCH_SIGNATURE, AT_FORALL_PROMOTE in autocast_mode.h, plus the CUDA-only registrations in
autocast_mode.cpp) as registered in PyTorch LISTS_FROM; tests/memory/test_cuda_autocast.py checks them against
this torch's own AutocastCUDA registrations and runs every op under both to compare output dtypes."""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterator

import torch
from torch._C import DispatchKey, DispatchKeySet

from .overrides import overload, overriding

LISTS_FROM = "2.13.0"

LOWER_PRECISION = (
    "_convolution.deprecated", "_convolution", "conv1d", "conv2d", "conv3d", "conv_tbc", "conv_transpose1d",
    "conv_transpose2d.input", "conv_transpose3d.input", "convolution", "prelu", "addmm", "addmv", "addr", "matmul",
    "einsum", "mm", "mv", "linalg_vecdot", "linear", "addbmm", "baddbmm", "bmm", "chain_matmul", "linalg_multi_dot",
    "_thnn_fused_lstm_cell", "_thnn_fused_gru_cell", "lstm_cell", "gru_cell", "rnn_tanh_cell", "rnn_relu_cell",
    "_scaled_dot_product_flash_attention", "scaled_dot_product_attention", "cudnn_convolution",
    "cudnn_convolution_transpose",
)
FP32 = (
    "acos", "asin", "cosh", "erfinv", "exp", "expm1", "log", "log10", "log2", "log1p", "reciprocal", "rsqrt", "sinh",
    "tan", "pow.Tensor_Scalar", "pow.Tensor_Tensor", "pow.Scalar", "softplus", "layer_norm", "native_layer_norm",
    "group_norm", "rms_norm", "frobenius_norm.dim", "nuclear_norm", "nuclear_norm.dim", "cosine_similarity",
    "poisson_nll_loss", "cosine_embedding_loss", "nll_loss", "nll_loss2d", "hinge_embedding_loss", "kl_div",
    "l1_loss", "smooth_l1_loss", "huber_loss", "mse_loss", "margin_ranking_loss", "multilabel_margin_loss",
    "soft_margin_loss", "triplet_margin_loss", "multi_margin_loss", "binary_cross_entropy_with_logits", "dist",
    "pdist", "cdist", "renorm", "logsumexp", "upsample_nearest1d", "_upsample_nearest_exact1d", "upsample_nearest2d",
    "_upsample_nearest_exact2d", "upsample_nearest3d", "_upsample_nearest_exact3d", "upsample_linear1d",
    "upsample_bilinear2d", "_upsample_bilinear2d_aa", "upsample_trilinear3d", "upsample_bicubic2d",
    "_upsample_bicubic2d_aa",
)
FP32_SET_OPT_DTYPE = (
    "prod", "prod.dim_int", "softmax.int", "log_softmax.int", "cumprod", "cumsum", "linalg_vector_norm",
    "linalg_matrix_norm", "linalg_matrix_norm.str_ord", "sum", "sum.dim_IntList",
)
FP32_APPEND_DTYPE = {"norm.Scalar": "norm.ScalarOpt_dtype", "norm.ScalarOpt_dim": "norm.ScalarOpt_dim_dtype"}
PROMOTE = ("addcdiv", "addcmul", "atan2", "bilinear", "cross", "dot", "vdot", "grid_sampler", "index_put",
           "tensordot", "scatter_add")
BANNED = ("binary_cross_entropy",)  # CUDA autocast refuses it (use binary_cross_entropy_with_logits)

POLICIES = {
    **{op: "lower_precision_fp" for op in LOWER_PRECISION}, **{op: "fp32" for op in FP32},
    **{op: "fp32_set_opt_dtype" for op in FP32_SET_OPT_DTYPE}, **{op: "fp32_append_dtype" for op in FP32_APPEND_DTYPE},
    **{op: "promote" for op in PROMOTE}, **{op: "banned" for op in BANNED},
}

_NO_AUTOCAST = DispatchKeySet(DispatchKey.AutocastCPU)


class _Casts:
    """The cast cache (CUDA's cached_cast): lower-precision copies of fp32 leaves that require grad, kept until the
    outermost autocast region exits (torch.clear_autocast_cache)."""

    def __init__(self):
        self.cached: dict[int, tuple[weakref.ref, torch.Tensor]] = {}

    def clear(self) -> None:
        self.cached.clear()

    def cast(self, to: torch.dtype, x):
        """One argument as cached_cast treats it: eligible tensors (floating, not fp64) cast; lists element-wise."""
        if isinstance(x, (list, tuple)):
            return type(x)(self.cast(to, a) for a in x)
        if not _eligible(x) or x.dtype == to:
            return x
        if (to == torch.get_autocast_dtype("cpu") and x.dtype == torch.float32 and x.requires_grad and x.is_leaf
                and not x._is_view() and torch.is_autocast_cache_enabled()):
            hit = self.cached.get(id(x))
            if hit is not None and hit[0]() is x:
                return hit[1]
            out = x.to(to)
            self.cached[id(x)] = (weakref.ref(x), out)
            return out
        return x.to(to)


def _exists(name: str) -> bool:
    try:
        overload(name)
    except AttributeError:
        return False
    return True


def _eligible(x) -> bool:
    return isinstance(x, torch.Tensor) and x.is_floating_point() and x.dtype != torch.float64 \
        and x.device.type == "cpu"


def _widest(args, kwargs) -> torch.dtype:
    """promote: fp32 if any eligible input is fp32, else the lower precision (doubles ignored)."""
    for a in (*args, *kwargs.values()):
        for t in (a if isinstance(a, (list, tuple)) else (a,)):
            if _eligible(t) and t.dtype == torch.float32:
                return torch.float32
    return torch.get_autocast_dtype("cpu")


def _kernel(name: str, policy: str, casts: _Casts):
    op = overload(name)
    if policy == "fp32_append_dtype":
        with_dtype = overload(FP32_APPEND_DTYPE[name])
    if policy == "fp32_set_opt_dtype":
        dtype_at = [a.name for a in op._schema.arguments].index("dtype")

    def kernel(*args, **kwargs):
        with torch._C._ExcludeDispatchKeyGuard(_NO_AUTOCAST):
            if policy == "banned":
                raise RuntimeError(f"torch.nn.functional.{name} is unsafe to autocast on CUDA: use "
                                   "binary_cross_entropy_with_logits (CUDA autocast's own refusal)")
            if policy in ("lower_precision_fp", "fp32", "promote"):
                to = {"lower_precision_fp": torch.get_autocast_dtype("cpu"), "fp32": torch.float32}.get(
                    policy) or _widest(args, kwargs)
                return op(*(casts.cast(to, a) for a in args), **{k: casts.cast(to, v) for k, v in kwargs.items()})
            if policy == "fp32_append_dtype":  # the overload that takes a dtype, every argument spelled out
                dtype = torch.float32 if _eligible(args[0]) else args[0].dtype
                full = [*args, *(a.default_value for a in op._schema.arguments[len(args):])]
                return with_dtype(*full, **kwargs, dtype=dtype)
            if _eligible(args[0]):  # fp32_set_opt_dtype: an output dtype the caller left open becomes fp32
                if len(args) > dtype_at:
                    if args[dtype_at] is None:
                        args = (*args[:dtype_at], torch.float32, *args[dtype_at + 1:])
                elif kwargs.get("dtype") is None:
                    kwargs = {**kwargs, "dtype": torch.float32}
            return op(*args, **kwargs)

    return kernel


@contextlib.contextmanager
def cuda_autocast() -> Iterator[None]:
    """Inside, `torch.autocast("cpu", dtype)` follows CUDA autocast's policy with that dtype (see the module doc)."""
    casts = _Casts()
    clear = torch.clear_autocast_cache

    def clear_both() -> None:
        clear()
        casts.clear()

    kernels = {name: _kernel(name, policy, casts) for name, policy in POLICIES.items()
               if _exists(name)}  # (an op an older torch has not got: nothing to cast)
    cpu_only = {r.removeprefix("aten::") for r in torch._C._dispatch_get_registrations_for_dispatch_key(
        "AutocastCPU") if r.startswith("aten::")} - set(POLICIES)
    kernels.update((name, torch.library.fallthrough_kernel) for name in sorted(cpu_only))
    try:
        with overriding("AutocastCPU", kernels):
            torch.clear_autocast_cache = clear_both  # torch.autocast.__exit__ calls it when the outermost region exits
            yield
    finally:
        torch.clear_autocast_cache = clear
        casts.clear()
