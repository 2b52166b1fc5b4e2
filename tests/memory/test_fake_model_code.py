"""Model code published fine-tuning recipes run (issue 42's defects), measured on the fake device as on the cpu.
devices: fake (a FakeTensorMode with `real_code_paths`; FakeDevice) against cpu (CpuDevice), the same plan and
tracker: the tensor peak equal to the byte.

- torchtune's Llama 3.x builders make their scaled RoPE frequencies with `torch.tensor([...0-d tensors...])`, which
  crashed the build on fake tensors ("data is not allocated yet"), reported as the model file's error.
- Hooks a model file puts on its parameters (an optimizer stepped from post-accumulate-grad hooks, torchtune's
  optimizer_in_bwd) were dropped on fake tensors when bf16-true cast the model: the fake step kept every gradient.
- NF4 weights a model file makes itself (torchtune's QLoRA layers: `nn.Parameter(to_nf4(w))`) are counted at their
  NF4 layout's size, as on the cpu (a guard: this one measured right before the fixes above too)."""

from __future__ import annotations

import contextlib
import json
from importlib.util import find_spec
from pathlib import Path

import pytest
import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

from oomtune.config.schema import Plan
from oomtune.levers import build_model as build_for_plan
from oomtune.memory.breakdown import breakdown
from oomtune.memory.devices import CpuDevice, FakeDevice
from oomtune.memory.fakes import NeedsValues, real_code_paths, shadow_of
from oomtune.memory.margin import Margin
from oomtune.memory.tracker import rounded
from oomtune.model_file import load_model_file
from oomtune.search.trial import run_trial

from ..conftest import one_line_error, run_cli


@contextlib.contextmanager
def fake():
    with FakeTensorMode(allow_non_fake_inputs=True), real_code_paths(), torch.device("cpu"):
        yield


def test_a_tensor_made_from_known_fake_scalars_has_their_values_and_dtype():
    with fake():
        freqs = 1.0 / (500000 ** (torch.arange(0, 8, 2).float() / 8))
        scaled = torch.tensor([f if f > 0.5 else f / 8 for f in freqs], dtype=freqs.dtype)
        as_is = torch.tensor([f for f in freqs.to(torch.bfloat16)])  # no dtype: the tensors' own, as real torch's
        assert isinstance(scaled, FakeTensor) and scaled.shape == (4,) and as_is.dtype == torch.bfloat16
        expected = 1.0 / (500000 ** (torch.arange(0, 8, 2).float() / 8))
        expected = torch.where(expected > 0.5, expected, expected / 8)
        torch.testing.assert_close(shadow_of(scaled), expected.to(shadow_of(scaled).device), rtol=0, atol=0)
        mixed = torch.tensor([torch.arange(3)[1], 2.5])  # an integer tensor and a float: real torch's float32
        assert mixed.dtype == torch.float32 and shadow_of(mixed).tolist() == [1.0, 2.5]
        weight = nn.Linear(3, 1).weight[0]  # a weight's values: the fake device has none
        with pytest.raises(NeedsValues, match=r"torch\.tensor\(\) was given fake tensors' values"):
            torch.tensor([w for w in weight])


def test_as_tensor_of_known_fake_scalars_and_no_function_mode_runs():
    """torch.as_tensor(data, dtype=...) as torch.tensor; a wrong call fails as torch's own does. The known values are
    put in place by replacing the two functions on the torch module while inside (memory/known_data.py), not by a
    TorchFunctionMode, which would take every torch call of a fake step through Python: inside real_code_paths no
    function mode of its own is on, and outside it torch.tensor and torch.as_tensor are torch's own again."""
    from torch.overrides import _get_current_function_mode_stack

    own = torch.tensor, torch.as_tensor
    with fake():
        assert [type(m).__name__ for m in _get_current_function_mode_stack()] == ["DeviceContext"]  # (fake()'s)
        steps = torch.arange(4)
        made = torch.as_tensor([steps[1], steps[3]], dtype=torch.float64)
        assert made.dtype == torch.float64 and shadow_of(made).tolist() == [1.0, 3.0]
        with pytest.raises(TypeError, match="positional"):
            torch.as_tensor([steps[1]], torch.float64)
        assert torch.as_tensor(steps) is steps  # (no list: torch's own answer)
        scripted = torch.jit.script(_pair)  # TorchScript takes the replacements as torch's own
    assert (torch.tensor, torch.as_tensor) == own
    assert scripted(1.5).tolist() == [1.5, 2.0]  # (run outside: FakeTensorMode crashes on a scripted torch.tensor)


def _pair(x: float) -> torch.Tensor:
    return torch.tensor([x, 2.0])


def test_a_cast_keeps_the_hooks_on_a_fake_parameter():
    """bf16-true's `model.to(torch.bfloat16)` swaps each fake parameter's contents; the hooks stay with it."""
    called = []
    with fake():
        model = nn.Linear(4, 4)
        model.weight.register_post_accumulate_grad_hook(lambda p: called.append("post-accumulate"))
        model.bias.register_hook(lambda g: called.append("grad") or g)
        weight = model.weight
        model.to(torch.bfloat16)
        assert model.weight is weight and model.weight.dtype == torch.bfloat16
        model(torch.randn(2, 4, dtype=torch.bfloat16)).sum().backward()
    assert sorted(called) == ["grad", "post-accumulate"]


MODELS = Path(__file__).resolve().parent.parent / "finetune" / "models"
LLAMA3_ROPE = MODELS / "llama3_scaled_rope.py"  # torchtune's Llama 3 RoPE scaling: torch.tensor(list of 0-d tensors)
OPTIMIZER_IN_BACKWARD = MODELS / "optimizer_in_backward.py"  # built in fp32, a post-accumulate-grad hook a parameter


@pytest.mark.parametrize("path, plan", [
    (LLAMA3_ROPE, Plan(2, 32, "bf16")),
    (OPTIMIZER_IN_BACKWARD, Plan(2, 32, "bf16-true")),
], ids=["llama3-scaled-rope", "optimizer-in-backward-bf16-true"])
def test_the_fake_device_measures_the_model_code_as_the_cpu_does(path, plan):
    model_file = load_model_file(path)
    cpu = run_trial(model_file, plan, CpuDevice("1GiB"))
    steps_on_cpu = len(getattr(model_file.module, "STEPS", []))
    fake = run_trial(model_file, plan, FakeDevice("1GiB", margin=Margin()))
    assert not cpu.oom and not fake.oom
    assert fake.peak_allocated_bytes == cpu.peak_allocated_bytes  # to the byte
    if path == OPTIMIZER_IN_BACKWARD:  # every parameter stepped from its hook on both (a dropped hook: none on fake)
        assert steps_on_cpu > 0 and len(model_file.module.STEPS) == 2 * steps_on_cpu


def own_nf4_source(fp32_trained: bool = False) -> str:
    """torchtune's QLoRA way, on the Llama 3 model file: its attention's qkv projection a Linear whose frozen weight
    the model file itself stores as torchao's NF4Tensor. `fp32_trained`: beside it a trained fp32 scale, as PEFT
    keeps its adapters in fp32 over a bf16 base (so bf16-true casts the model, NF4 weights left as they are)."""
    scale = ("\n        self.scale = nn.Parameter(torch.ones(o, dtype=torch.float32))" if fp32_trained else "")
    return LLAMA3_ROPE.read_text().replace("self.qkv, self.out = nn.Linear(d, 3 * d), nn.Linear(d, d)", """\
self.qkv, self.out = FrozenNF4Linear(d, 3 * d), nn.Linear(d, d)""").replace("class Block(", '''\
from oomtune.levers.nf4 import library_to_nf4


class FrozenNF4Linear(nn.Linear):
    """As torchtune's QLoRA layers: the frozen weight parameter is itself torchao's NF4Tensor."""

    def __init__(self, i, o):
        super().__init__(i, o, bias=False)
        self.weight = nn.Parameter(library_to_nf4()(self.weight.detach(), 64, 256), requires_grad=False)SCALE

    def forward(self, x):
        return nn.functional.linear(x, self.weight) * getattr(self, "scale", 1)


class Block('''.replace("SCALE", scale)).replace("def __init__(self, d=32,", "def __init__(self, d=128,")


@pytest.mark.skipif(find_spec("torchao") is None, reason="torchao is not installed (pip install -e '.[dev]')")
@pytest.mark.parametrize("fp32_trained", [False, True])
def test_nf4_weights_a_model_file_makes_itself_count_at_their_layout_size(write_model, fp32_trained):
    source = own_nf4_source(fp32_trained)
    model_file = load_model_file(write_model(source))
    plan = Plan(48, 64, "bf16-true")  # its peak in the step, past the quantization's scratch
    cpu = run_trial(model_file, plan, CpuDevice("1GiB"))
    fake = run_trial(model_file, plan, FakeDevice("1GiB", margin=Margin()))
    assert fake.peak_allocated_bytes == cpu.peak_allocated_bytes
    measured = breakdown(model_file, plan, FakeDevice("1GiB", margin=Margin()))  # at the step's peak
    model = build_for_plan(model_file, plan, CpuDevice("1GiB"))  # real tensors, as the plan builds them
    nf4 = [m.weight for m in model.modules() if type(m).__name__ == "FrozenNF4Linear"]
    assert len(nf4) == 2 and type(nf4[0]).__name__ == "NF4Tensor"
    storages = {id(s): rounded(s.nbytes()) for t in  # (as the CUDA allocator rounds them)
                (*model.parameters(), *model.buffers()) for s in _storages(t)}
    assert measured.phase in ("forward", "backward") and measured.parameters_bytes == sum(storages.values())
    # 4 bits an element plus the blocks' scales: about a quarter of bf16's 2 bytes an element
    packed = sum(s.nbytes() for w in nf4 for s in _storages(w))
    assert packed < 0.6 * sum(w.numel() for w in nf4)


def _storages(t: torch.Tensor) -> list:
    if type(t).__name__ == "NF4Tensor":
        return [getattr(t, n).untyped_storage() for n in t.__tensor_flatten__()[0]]
    return [t.untyped_storage()]


def test_a_model_stepping_its_optimizer_in_backward_is_probed_alike_on_cpu_and_fake(tmp_path):
    """PyTorch's optimizer-in-backward (a post-accumulate-grad hook per parameter, closing over its optimizer) makes
    a reference cycle through autograd that the garbage collector cannot see: before, each trial's model stayed
    alive and the cpu probe stopped with "keeps tensors alive from one trial to the next". Now both devices climb
    the same ladder, trial for trial, with no accumulation (it would update at every micro-batch) and no 8-bit or
    offload rung (the trainer's optimizer never sees a gradient), each said in a note."""
    model = OPTIMIZER_IN_BACKWARD
    common = ("--batch", "16", "--context", "64", "--budget", "600KiB", "--json")
    cpu = run_cli("probe", model, "--device", "cpu", *common, "--out", tmp_path / "cpu.yaml")
    fake = run_cli("estimate", model, "--margin", "0", *common, "--out", tmp_path / "fake.yaml")
    assert cpu.exit_code == 1 and fake.exit_code == 1, cpu.output + fake.output  # 16 at once: nothing fits
    cpu, fake = json.loads(cpu.stdout), json.loads(fake.stdout)
    measured = [{(t["rung"], t["micro_batch_size"]): (t["result"], t["peak_bytes"] if t["result"] != "oom" else None)
                 for t in r["trials"]} for r in (cpu, fake)]
    # the same result and peak at every size both tried (the estimate predicts a few sizes the cpu ran, from a line)
    assert {k: measured[0][k] for k in measured[1]} == measured[1] and len(measured[1]) > 12
    assert [{**r, "trials": 0} for r in cpu["rungs"]] == [{**r, "trials": 0} for r in fake["rungs"]]
    assert not any(t["grad_accum_steps"] > 1 for t in cpu["trials"])
    assert "(the model steps its optimizer in backward): at most micro-batch 4 fits" in cpu["why_nothing_fits"]
    for result in (cpu, fake):
        assert any(n.startswith("no accumulation rung: 11 of optimizer_in_backward.py's trained parameters have ")
                   for n in result["notes"])
        assert set(result["levers_not_used"]) == {"chunked-loss", "step-in-backward", "8bit", "nf4", "offload"}
        assert "with its own hooks already" in result["levers_not_used"]["step-in-backward"]
        assert "never sees their gradients" in result["levers_not_used"]["offload"]


def test_no_model_outlives_its_search_and_the_offload_levers_hooks_are_not_the_model_files(tmp_path):
    """The probe's last model (kept for its rung's trials) is let go of with its hooks emptied when the search ends:
    before, the hooks' cycle through autograd kept it alive after the probe. And the offload lever's own
    post-accumulate-grad hooks are not taken for a model file stepping in backward (the fake device primes the
    optimizer state for an offload trial, as it did before)."""
    import gc

    from oomtune.search.options import resolve_targets
    from oomtune.search.probe import probe
    from oomtune.step import build_training

    model_file = load_model_file(OPTIMIZER_IN_BACKWARD)
    probe(model_file, CpuDevice("600KiB"), resolve_targets(model_file, 16, 64, None), prior=False)
    gc.collect()
    assert len(model_file.module.BUILT) == 0
    tiny = load_model_file(Path(__file__).resolve().parents[2] / "examples" / "tiny_gpt.py")
    t = build_training(tiny, Plan(2, 32, "bf16", offload_optimizer=True), FakeDevice("1GiB", margin=Margin()), 1e-3)
    assert any(p._post_accumulate_grad_hooks for p in t.module.parameters()) and t.steps_in_backward == 0


def test_accumulation_with_a_model_stepping_in_backward_is_one_line(tmp_path):
    """A what-if (or a config edited by hand) with accumulation on such a model: each micro-batch's backward would
    update the weights, which is not the plan's step. One line, exit 2, before any step."""
    r = run_cli("estimate", OPTIMIZER_IN_BACKWARD, "--micro-batch", "2", "--grad-accum", "2", "--context", "32")
    one_line_error(r, "plan.grad_accum_steps is 2, but optimizer_in_backward.py steps 11 trained parameters in "
                      "backward")
