"""The fake device follows the CPU's own kernels where PyTorch's meta kernels differ (memory/cpu_kernels.py): an
LSTM's oneDNN workspace, transformers' fp32 grouped matmul. device: fake against cpu."""

from __future__ import annotations

import contextlib

import pytest
import torch
from torch import nn

from oomtune.config.schema import Plan
from oomtune.memory.devices import CpuDevice, FakeDevice
from oomtune.memory.margin import Margin
from oomtune.model_file import load_model_file
from oomtune.search.trial import run_trial


@pytest.mark.parametrize("plan, bidirectional", [
    (Plan(3, 24, "fp32"), False), (Plan(3, 24, "bf16-true"), False), (Plan(2, 24, "bf16", grad_accum_steps=2), False),
    (Plan(3, 24, "fp32"), True), (Plan(2, 24, "bf16", activation_checkpointing=True), True)],
    ids=["fp32", "bf16-true", "bf16 x2", "bidirectional fp32", "bidirectional bf16 ckpt"])  # (blocks(): the LSTM)
def test_an_lstm_counts_onednns_workspace_on_fake_as_on_cpu(write_model, plan, bidirectional):
    """nn.LSTM runs oneDNN on the CPU, whose workspace for the backward the meta kernel leaves empty: without
    cpu_kernels.cpu_kernel_call the fake device's saved activations read a third of the cpu device's. An autocast
    plan on a CPU whose oneDNN has no 16-bit RNN (AVX2) runs on neither device: skipped there, with the reason."""
    from oomtune.memory.host_kernels import lstm_autocast_fails

    cannot = lstm_autocast_fails(plan.precision)
    if cannot:
        pytest.skip(f"this CPU cannot run an LSTM under {plan.precision} autocast: {cannot}")
    path = write_model('''
        import torch
        from torch import nn

        class LSTMLM(nn.Module):
            def __init__(self):
                super().__init__()
                self.emb = nn.Embedding(100, 32)
                self.lstm = nn.LSTM(32, 48, num_layers=2, batch_first=True, bidirectional=BI)
                self.head = nn.Linear(96 if BI else 48, 100)

            def forward(self, x):
                h, _ = self.lstm(self.emb(x))
                return nn.functional.cross_entropy(self.head(h).flatten(0, 1), x.flatten())

        BI = False

        def build_model():
            return LSTMLM()

        def blocks(model):
            return [model.lstm]

        def make_batch(batch_size, context_length, device):
            return torch.randint(0, 100, (batch_size, context_length), device=device)
    ''')
    mf = load_model_file(path)
    mf.module.BI = bidirectional
    cpu = run_trial(mf, plan, CpuDevice("1GiB"))
    fake = run_trial(mf, plan, FakeDevice("1GiB", margin=Margin()))
    assert not cpu.oom and not fake.oom
    assert fake.phase_peaks["forward"] == cpu.phase_peaks["forward"]  # (without it: 57% of the cpu's in fp32)
    # the backward within a 512-byte block a layer: autograd copies the LSTM's bias gradients on fake, not on cpu
    assert abs(fake.peak_allocated_bytes - cpu.peak_allocated_bytes) <= 2 * 512


def test_a_large_lstms_workspace_is_read_at_a_smaller_shape_and_scaled(monkeypatch):
    """A shape whose real call would allocate more than the cap (an H=4096 LSTM at context 1024 would be 16 GB of
    host RAM and minutes of compute) is read from smaller calls, scaled: here with a 1 MiB cap, against the exact
    size of a 130 MB workspace."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from oomtune.memory import cpu_kernels

    seen = []

    class Grab(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if func is cpu_kernels._LSTM_LAYER:
                seen.append((args, out[3].numel()))
            return out

    with Grab():
        nn.LSTM(256, 256, batch_first=True)(torch.zeros(16, 512, 256, requires_grad=True))
    (args, exact), = seen
    real_call, shapes = cpu_kernels._real_call, []

    def spied(args, steps, batch, hidden, width):
        shapes.append((steps, batch, hidden, width))
        return real_call(args, steps, batch, hidden, width)

    monkeypatch.setattr(cpu_kernels, "_REAL_BYTES", 1 << 20)
    monkeypatch.setattr(cpu_kernels, "_real_call", spied)
    scaled = cpu_kernels._workspace_bytes(args)
    assert abs(scaled - exact) < 0.05 * exact and scaled % 4096 == 0
    assert len(shapes) == 2 and all(t * b * h < 512 * 16 * 256 / 64 for t, b, h, _ in shapes), shapes


@pytest.mark.parametrize("dtype, out_dtype", [(torch.float32, None), (torch.float32, torch.float32)])
def test_a_grouped_matmul_the_cpu_takes_is_shaped_on_fake_tensors_as_the_cpu_makes_it(dtype, out_dtype):
    """The meta kernel takes bf16 alone (CUDA's rule); the CPU's kernel fp32 too (not bf16 into fp32: "output dtype
    must match mat_a dtype", as the meta kernel says)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from oomtune.memory.cpu_kernels import cpu_kernel_call
    from oomtune.memory.fakes import Values

    def grouped(a, b, offs):
        return torch._grouped_mm(a, b, offs=offs, out_dtype=out_dtype)

    args = lambda: (torch.randn(12, 8, dtype=dtype), torch.randn(3, 8, 16, dtype=dtype),  # noqa: E731
                    torch.tensor([4, 8, 12], dtype=torch.int32))
    real = grouped(*args())
    with FakeTensorMode(allow_non_fake_inputs=True), Values(cpu_kernel_call):  # (as the fake device runs it)
        fake = grouped(*args())
    assert (fake.shape, fake.dtype, fake.stride()) == (real.shape, real.dtype, real.stride())


GROUP_NORM_CNN = '''
    import torch
    from torch import nn

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv, self.norm = nn.Conv2d(16, 16, 3, padding=1), nn.GroupNorm(4, 16)

        def forward(self, x):
            return x + torch.relu(self.norm(self.conv(x)))

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.stem, self.blocks, self.head = nn.Conv2d(3, 16, 3, padding=1), nn.ModuleList(
                Block() for _ in range(3)), nn.Linear(16, 10)

        def forward(self, x, y):
            x = self.stem(x)
            for b in self.blocks:
                x = b(x)
            return nn.functional.cross_entropy(self.head(x.mean((2, 3))), y)

    DEFAULTS = {"batch": 4, "context": 1}

    def build_model():
        return Net()

    def make_batch(batch_size, context_length, device):
        return torch.randn(batch_size, 3, 16, 16, device=device), torch.randint(0, 10, (batch_size,), device=device)
'''


@pytest.mark.parametrize("precision", ["bf16", "fp32", "bf16-true"])
def test_group_norm_under_cpu_autocast_counts_atens_dtypes_on_fake_as_on_cpu(write_model, precision):
    """CPU autocast leaves GroupNorm's input in bf16 beside its fp32 weights: ATen keeps the statistics in fp32 and
    the input's gradient in bf16, the meta kernel the other way round (+64 KiB in backward on fake before, and
    `check` refused the plan `probe` wrote). Every phase that holds activations now reads the same, to the byte;
    fp32 and bf16-true, with no mixing, were equal before and stay so."""
    mf = load_model_file(write_model(GROUP_NORM_CNN))
    plan = Plan(4, 1, precision)
    cpu = run_trial(mf, plan, CpuDevice("1GiB"))
    fake = run_trial(mf, plan, FakeDevice("1GiB", margin=Margin()))
    for phase in ("forward", "backward", "optimizer"):
        assert fake.phase_peaks[phase] == cpu.phase_peaks[phase], phase
    assert fake.peak_allocated_bytes == cpu.peak_allocated_bytes


def test_group_norms_input_gradient_keeps_a_channels_last_layout_on_fake_tensors():
    """The input's gradient is made like the input, its layout too (a channels-last bf16 input: channels-last)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from oomtune.memory.cpu_kernels import cpu_kernel_call
    from oomtune.memory.fakes import Values

    def grads(fake: bool) -> list[tuple]:
        with FakeTensorMode() if fake else contextlib.nullcontext(), Values(cpu_kernel_call) if fake else \
                contextlib.nullcontext():
            x = torch.zeros(2, 16, 4, 2, dtype=torch.bfloat16).contiguous(memory_format=torch.channels_last)
            w = torch.ones(16)
            _, mean, rstd = torch.ops.aten.native_group_norm(x, w, w, 2, 16, 8, 4, 1e-5)
            out = torch.ops.aten.native_group_norm_backward(x, x, mean, rstd, w, 2, 16, 8, 4, [True, True, True])
            return [(t.dtype, t.stride()) for t in (mean, rstd, *out)]

    assert grads(fake=True) == grads(fake=False)
