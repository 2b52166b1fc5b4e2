"""A compiled call's memory against inductor's own plan (memory/kernel_lives.py). device: cpu, and inductor for
real on this machine's CPU (its C++ backend): the wrapper code it generates allocates each buffer
(`empty_strided_cpu`), writes a result over a dying input (`reinterpret_tensor(...); del x  # reuse`) and frees
each input and buffer after its last kernel (`del`). Read as a timeline, its peak above the graph's inputs is what
graph_runner's must be, forward and backward, to the cpu device's 512-byte rounding of each storage.

Failed before: inputs freed at their last fused op, not after the kernel (cross-entropy's backward: the logits
gone before their gradient was written, half the peak); no result written over a dying input (the MLP's residual
add); kernels that share reads not run together (its backward); the partition not inductor's (the Llama layer's
attention: softmax inputs kept where inductor keeps its output); iota written out; a kernel written over an input it
reads at another place (a transpose, a rotation, a gather) or that a kernel fused with it reads too."""

from __future__ import annotations

import re
import shutil

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from oomtune.memory import compiled
from oomtune.memory.devices import CpuDevice

NEEDS_GXX = pytest.mark.skipif(shutil.which("g++") is None, reason="inductor's CPU backend needs a C++ compiler")
ITEM = {"float32": 4, "bfloat16": 2, "int64": 8, "float16": 2, "bool": 1, "int32": 4}


def _bytes(size: str, stride: str, dtype: str) -> int:
    sizes = [int(x) for x in size.split(",") if x.strip()]
    strides = [int(x) for x in stride.split(",") if x.strip()]
    raw = 0 if 0 in sizes else (1 + sum((a - 1) * b for a, b in zip(sizes, strides, strict=True))) * ITEM[dtype]
    return -(-raw // 512) * 512  # (the cpu device's rounding)


def _inductor_peak(code: str) -> int:
    """The generated `call`'s peak of live bytes above its inputs."""
    inputs = re.findall(r"(\w+) = rand_strided\(\(([^)]*)\), \(([^)]*)\), device='cpu', dtype=torch\.(\w+)\)",
                        code[code.index("def get_args"):])
    owner = {name: name for name, *_ in inputs}
    size = {name: _bytes(*rest) for name, *rest in inputs}
    refs = dict.fromkeys(owner, 1)
    live = peak = base = sum(size.values())
    for line in code[code.index("def call("):code.index("def get_args")].splitlines():
        line = line.strip()
        if m := re.match(r"(\w+) = empty_strided_cpu\(\(([^)]*)\), \(([^)]*)\), torch\.(\w+)\)", line):
            name = m.group(1)
            owner[name], size[name], refs[name] = name, _bytes(*m.groups()[1:]), 1
            live += size[name]
            peak = max(peak, live)
        elif m := re.match(r"(\w+) = (?:reinterpret_tensor\()?(\w+)[,;]", line):
            if m.group(2) in owner:
                owner[m.group(1)] = owner[m.group(2)]
                refs[owner[m.group(1)]] += 1
        for gone in re.findall(r"del (\w+)", line):
            storage = owner.pop(gone)
            refs[storage] -= 1
            live -= size[storage] if refs[storage] == 0 else 0
    return peak - base


def _our_peaks(fn, args, module) -> list[int]:
    runners = []
    real = compiled.graph_runner

    def keep(gm, example_inputs=None, backward=False):
        runners.append((gm, real(gm, example_inputs, backward)))
        return runners[-1][1]

    compiled.graph_runner = keep
    try:
        compiled.CompiledCall("f", fn, module)(*args).sum().backward()
    finally:
        compiled.graph_runner = real
    assert compiled.compile_notes() == ()
    peaks = []
    for gm, run in runners:
        device = CpuDevice("1GiB")
        with device.measure():
            vals = [n.meta["val"] for n in gm.graph.nodes if n.op == "placeholder"]
            inputs = [torch.zeros(tuple(v.shape), dtype=v.dtype).as_strided(tuple(v.shape), tuple(v.stride()))
                      if isinstance(v, torch.Tensor) else v for v in vals]
            before = device.live_bytes()
            device.tracker.reset_peak()
            run(inputs)
            peaks.append(device.tracker.peak_bytes - before)
    return peaks


def _inductor_peaks(fn, args) -> list[int]:
    from torch._inductor.utils import run_fw_bw_and_get_code

    torch._dynamo.reset()
    _, codes = run_fw_bw_and_get_code(lambda: torch.compile(fn)(*args))
    return [_inductor_peak(code) for code in codes]


class _Mlp(nn.Module):
    def __init__(self, d: int = 64, h: int = 128):
        super().__init__()
        self.w1, self.w3 = nn.Linear(d, h, bias=False), nn.Linear(d, h, bias=False)
        self.w2, self.g = nn.Linear(h, d, bias=False), nn.Parameter(torch.ones(d))

    def forward(self, x):
        xf = x.float()
        n = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6)).to(x.dtype) * self.g
        return x + self.w2(F.silu(self.w1(n)) * self.w3(n))


def _llama_layer():
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

    config = LlamaConfig(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                         num_hidden_layers=1, vocab_size=100, attn_implementation="eager")
    layer = LlamaDecoderLayer(config, 0)
    h = torch.randn(2, 32, 64, requires_grad=True)
    cos, sin = LlamaRotaryEmbedding(config)(h, torch.arange(32)[None].expand(2, -1))

    def call(h, cos, sin):
        return layer(h, position_embeddings=(cos, sin), attention_mask=None)

    return call, (h, cos.detach(), sin.detach()), layer


class _Head(nn.Module):
    """x @ w (a matmul's buffer, dying in the kernel that reads it), then `body`, then a small matmul out."""

    def __init__(self, body, n: int = 128, frozen: bool = False):
        super().__init__()
        w = torch.randn(4, n) / n
        if frozen:
            self.register_buffer("w", w)
        else:
            self.w = nn.Parameter(w)
        self.w2, self.w3, self.body = nn.Parameter(torch.randn(n, 4) / n), nn.Parameter(torch.randn(n, 4) / n), body
        self.register_buffer("idx", torch.randint(0, n, (n, n)))

    def forward(self, x):
        return self.body(self, x @ self.w)


def _head(body, frozen: bool = False):
    module = _Head(body, frozen=frozen)
    return module, (torch.randn(128, 4),), module


def _rotate(h):
    return torch.cat((-h[..., 64:], h[..., :64]), -1)


HEADS = {  # (each wrote over the matmul's buffer where inductor does not: the estimate under inductor's by it)
    "two kernels read it": lambda: _head(lambda m, h: torch.sin(h) @ m.w2 + torch.cos(h) @ m.w3, frozen=True),
    "read at two places": lambda: _head(lambda m, h: (h * 0.5 + _rotate(h) * 0.25) @ m.w2),
    "read transposed": lambda: _head(lambda m, h: (h.t().contiguous() * 2.0) @ m.w2),
    "read through an index": lambda: _head(lambda m, h: (torch.gather(h, 1, m.idx) * 2.0) @ m.w2),
}


def _cases():
    mlp = _Mlp()
    return {
        "cross-entropy": (lambda x, t: F.cross_entropy(x, t),
                          (torch.randn(64, 1000, requires_grad=True), torch.randint(0, 1000, (64,))), None),
        "upcast logits": (lambda x, t: F.cross_entropy(x.float().view(-1, 100), t.view(-1)),
                          (torch.randn(2, 32, 100, dtype=torch.bfloat16, requires_grad=True),
                           torch.randint(0, 100, (2, 32))), None),
        "mlp": (mlp, (torch.randn(4, 32, 64, requires_grad=True),), mlp),
        "llama layer": _llama_layer(),
    }


@NEEDS_GXX
@pytest.mark.parametrize("case", ["cross-entropy", "upcast logits", "mlp", "llama layer"])
def test_a_compiled_calls_peaks_are_inductors_own(case):
    torch.manual_seed(0)
    fn, args, _ = _cases()[case]
    inductors = _inductor_peaks(fn, args)
    torch.manual_seed(0)
    fn, args, module = _cases()[case]
    assert _our_peaks(fn, args, module) == inductors  # [forward, backward]


def test_cross_entropys_backward_holds_the_logits_while_it_writes_their_gradient():
    """device: cpu. One fused kernel reads the fp32 logits (saved: forward's input) and writes their gradient; the
    logits are not inductor's to write over (a graph input), so both exist at once."""
    x = torch.randn(64, 1000, requires_grad=True)
    _, backward = _our_peaks(lambda x, t: F.cross_entropy(x, t), (x, torch.randint(0, 1000, (64,))), None)
    assert backward >= 64 * 1000 * 4  # the gradient written while the logits (inputs) still live


@NEEDS_GXX
@pytest.mark.parametrize("case", list(HEADS))
def test_a_kernel_writes_over_an_input_only_where_inductor_does(case):
    """Inductor writes a kernel's result over a dying input only where the kernel reads it at the place it writes
    and no kernel fused with it reads it too: forward's peak is inductor's (and no graph's is under it: a gather's
    backward, whose index ops are not modelled as fused, is over)."""
    torch.manual_seed(0)
    fn, args, _ = HEADS[case]()
    inductors = _inductor_peaks(fn, args)
    torch.manual_seed(0)
    fn, args, module = HEADS[case]()
    ours = _our_peaks(fn, args, module)
    assert ours[0] == inductors[0] and all(o >= i for o, i in zip(ours, inductors, strict=True))
