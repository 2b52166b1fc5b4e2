"""The fake device: the cpu device's accountant on FakeTensors, so it predicts a GPU's memory with no compute."""

import pytest
import torch
from torch import nn

from oomtune.config.schema import Plan
from oomtune.errors import OomtuneError
from oomtune.memory.breakdown import breakdown
from oomtune.memory.cards import GPUS, card_for, find_gpu
from oomtune.memory.devices import CpuDevice, FakeDevice, make_device
from oomtune.memory.margin import Margin, parse_margin
from oomtune.model_file import load_model_file
from oomtune.search.trial import run_trial

from ..conftest import EXAMPLES

MiB = 1 << 20
EXAMPLE_FILES = ("tiny_gpt.py", "mlp_dict.py", "conv_net.py")
# every rung of the ladder (fp32, amp, amp + checkpointing, + accumulation), at sizes that run in a blink
RUNGS = {
    "fp32": Plan(2, 32, "fp32"),
    "bf16": Plan(2, 32, "bf16"),
    "bf16+ckpt": Plan(2, 32, "bf16", activation_checkpointing=True),
    "bf16+ckpt x2": Plan(2, 32, "bf16", activation_checkpointing=True, grad_accum_steps=2),
}


@pytest.fixture(scope="module")
def model_files():
    return {name: load_model_file(EXAMPLES / name) for name in EXAMPLE_FILES}


@pytest.mark.parametrize("rung", RUNGS)
@pytest.mark.parametrize("example", EXAMPLE_FILES)
def test_fake_peak_equals_cpu_peak(model_files, example, rung):
    """fake (no compute) vs cpu (real compute), same plan, same tracker: the peaks agree (they are in fact
    equal to the byte), phase by phase. (The setup phase's peak only within 1%: on fake it does not hold the first
    step's batches, as the fake device makes the first step's optimizer state without that step.)"""
    plan = RUNGS[rung]
    cpu = run_trial(model_files[example], plan, CpuDevice("1GiB"))
    fake = run_trial(model_files[example], plan, FakeDevice("1GiB", margin=Margin()))
    assert not cpu.oom and not fake.oom
    assert fake.peak_allocated_bytes == pytest.approx(cpu.peak_allocated_bytes, rel=0.01)
    assert fake.phase_peaks.keys() == cpu.phase_peaks.keys()
    for phase, peak in cpu.phase_peaks.items():
        assert fake.phase_peaks[phase] == pytest.approx(peak, rel=0.01), phase
    # nothing was computed on fake: no loss to read, no speed to report
    assert cpu.loss is not None and fake.loss is None
    assert cpu.tokens_per_s is not None and fake.tokens_per_s is None


UNREACHED = """
import torch
from torch import nn


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.used = nn.Linear(64, 64)
        self.spare = nn.Linear(64, 64)  # trained, but backward never reaches it: a real step makes it no state

    def forward(self, x, y):
        # (not F.mse_loss: the CPU's returns its 0-dim loss in a storage of the unreduced elements, CUDA's and the
        # fake device's in one of its own, a 512-byte difference that is the peak where the step makes no scratch)
        return (self.used(x) - y).pow(2).mean()


def build_model():
    return Net()


def make_batch(batch_size, context_length, device):
    return torch.randn(batch_size, 64, device=device), torch.randn(batch_size, 64, device=device)
"""


def count_forwards(model_file, plan, device) -> tuple[int, object]:
    phases = []
    result = run_trial(model_file, plan, device, observe=lambda t, phase: phases.append(phase))
    return phases.count("forward"), result


def test_the_fake_device_makes_the_first_steps_state_without_it_unless_backward_misses_a_parameter(write_model):
    """On fake a trial's first step is replaced by the state it leaves (zero gradients, one optimizer step): one
    forward, not two, and the cpu device's two real steps' peak to the byte. Where backward gives a trained
    parameter no gradient, that state would hold a moment a real step never makes: the trial is run again with
    both steps, and the peaks still agree to the byte."""
    plan = Plan(4, 8, "fp32")
    tiny = load_model_file(EXAMPLES / "tiny_gpt.py")
    unreached = load_model_file(write_model(UNREACHED))
    for mf, fake_forwards in ((tiny, 1), (unreached, 1 + 2)):
        cpu_forwards, cpu = count_forwards(mf, plan, CpuDevice("1GiB"))
        forwards, fake = count_forwards(mf, plan, FakeDevice("1GiB", margin=Margin()))
        assert (cpu_forwards, forwards) == (2, fake_forwards), mf.label
        assert fake.peak_allocated_bytes == cpu.peak_allocated_bytes, mf.label
        # a breakdown records the trial it keeps: the rerun, not the discarded primed run
        assert breakdown(mf, plan, FakeDevice("1GiB", margin=Margin())) == breakdown(mf, plan, CpuDevice("1GiB"))


@pytest.mark.parametrize("make", [
    lambda ps: torch.optim.AdamW(ps, lr=0.1),
    lambda ps: torch.optim.Adam(ps, lr=0.1, amsgrad=True),
    lambda ps: torch.optim.AdamW(ps, lr=0.1, foreach=True),  # as the simulated devices run it (step.as_on_cuda)
], ids=["adamw", "adam-amsgrad", "adamw-foreach"])
def test_the_primed_adam_state_is_the_one_its_first_step_makes_without_the_update(make):
    """device: none (plain cpu tensors). torch's Adam and AdamW are primed by their own lazy initialization
    (step._init_adam_state): the same state tensors (names, shapes, dtypes, devices) a real first step leaves, and
    no parameter moved; any other optimizer is left to step."""
    from oomtune.step import _init_adam_state

    def params():
        torch.manual_seed(0)
        ps = [nn.Parameter(torch.randn(3, 4)), nn.Parameter(torch.randn(4))]
        for p in ps:
            p.grad = torch.ones_like(p)
        return ps

    stepped, primed = params(), params()
    by_step, by_init = make(stepped), make(primed)
    by_step.step()
    assert _init_adam_state(by_init)
    for a, b, start in zip(stepped, primed, params(), strict=True):
        got = {k: (v.shape, v.dtype, v.device) for k, v in by_init.state[b].items()}
        assert got == {k: (v.shape, v.dtype, v.device) for k, v in by_step.state[a].items()}
        assert torch.equal(b, start) and not torch.equal(a, start)  # the update did not run
    sgd = torch.optim.SGD(params(), lr=0.1, momentum=0.9)
    subclass = type("MyAdam", (torch.optim.Adam,), {})(params())
    assert not _init_adam_state(sgd) and not sgd.state and not _init_adam_state(subclass) and not subclass.state


def test_fp16_with_gradscaler_runs_on_fake_and_matches_cpu(model_files):
    """GradScaler reads a found-inf flag with .item(); on fake it reads 0 (finite: the step is taken)."""
    plan = Plan(2, 32, "fp16", activation_checkpointing=True, grad_accum_steps=2)
    mf = model_files["tiny_gpt.py"]
    cpu = run_trial(mf, plan, CpuDevice("1GiB"))
    fake = run_trial(mf, plan, FakeDevice("1GiB", margin=Margin()))
    assert not fake.oom
    assert fake.peak_allocated_bytes == cpu.peak_allocated_bytes
    assert fake.phase_peaks["optimizer"] == cpu.phase_peaks["optimizer"]  # the optimizer step did run


def test_the_fake_budget_raises_a_cuda_shaped_oom(model_files):
    mf = model_files["tiny_gpt.py"]
    need = run_trial(mf, RUNGS["fp32"], FakeDevice("1GiB", margin=Margin())).peak_allocated_bytes
    r = run_trial(mf, RUNGS["fp32"], FakeDevice(str(need - 1), margin=Margin()))
    assert r.oom and r.oom_message.startswith("CUDA out of memory. Tried to allocate")
    assert "fake device" in r.oom_message
    assert not run_trial(mf, RUNGS["fp32"], FakeDevice(str(need), margin=Margin())).oom


def test_the_priors_fake_device_never_runs_out_and_reports_the_peak_past_its_budget(model_files):
    """device: fake. What the probe's prior runs on: a plan past the budget reports its peak instead of running out
    (the search judges it against the limit as before), lowering the budget keeps it so, and it never computes;
    with a card, its allocator model still frees the cached segments at the card's capacity before going past."""
    mf = model_files["tiny_gpt.py"]
    need = run_trial(mf, RUNGS["fp32"], FakeDevice("1GiB", margin=Margin())).peak_allocated_bytes
    fake = FakeDevice(str(need // 2), margin=Margin(), never_runs_out=True)
    fake.lower_budget(need // 3)
    r = run_trial(mf, RUNGS["fp32"], fake)
    assert not r.oom and r.peak_allocated_bytes == need and fake.budget_bytes == need // 3
    assert not fake.may_compute
    t4 = find_gpu("t4")
    from oomtune.memory.margin import CardMargin

    room = t4.context + CardMargin(t4).seeded_bytes + need // 2  # the context, the workspaces' segment, half the need
    card = FakeDevice(str(room), gpu=t4, never_runs_out=True)
    r = run_trial(mf, RUNGS["fp32"], card)
    assert not r.oom and r.modelled_reserved_bytes > card.margin.allocator_capacity(card.budget_bytes)


def test_the_allocator_model_that_overflows_frees_its_cache_first():
    """The caching allocator model at its capacity frees the cached segments and retries, as the card's does; one
    that overflows then reserves past the capacity instead of running out."""
    from oomtune.memory.allocator import CachingAllocatorModel, OutOfMemory

    for overflows in (False, True):
        model = CachingAllocatorModel(100 * MiB, overflows=overflows)
        model.malloc("a", 60 * MiB)
        model.free("a")
        model.malloc("b", 70 * MiB)  # the 60 MiB segment is freed first: 70 MiB reserved, not 130
        assert model.peak_reserved_bytes == 70 * MiB
        if overflows:
            model.malloc("c", 60 * MiB)
            assert model.reserved_bytes == 130 * MiB
        else:
            with pytest.raises(OutOfMemory):
                model.malloc("c", 60 * MiB)


def test_the_margin_is_added_to_the_tensor_peak_and_moves_the_oom(model_files):
    mf = model_files["mlp_dict.py"]
    margin = Margin(fixed_bytes=3 * MiB, fraction=0.25)
    r = run_trial(mf, RUNGS["bf16"], FakeDevice("1GiB", margin=margin))
    tensors = r.peak_allocated_bytes
    assert r.peak_bytes == tensors + 3 * MiB + -(-tensors // 4)  # ceil(25%)
    # a budget that holds the tensors but not tensors + margin runs out of memory
    assert run_trial(mf, RUNGS["bf16"], FakeDevice(str(tensors), margin=Margin())).oom is False
    assert run_trial(mf, RUNGS["bf16"], FakeDevice(str(tensors), margin=margin)).oom is True
    assert run_trial(mf, RUNGS["bf16"], FakeDevice(str(r.peak_bytes), margin=margin)).oom is False


def test_tied_weights_are_counted_once(write_model):
    """The model is built straight into fake tensors (not meta + .to(), which unties and refuses fake tensors)."""
    path = write_model('''
        import torch
        from torch import nn

        class Tied(nn.Module):
            def __init__(self, tie):
                super().__init__()
                self.emb = nn.Embedding(1000, 64)
                self.head = nn.Linear(64, 1000, bias=False)
                if tie:
                    self.head.weight = self.emb.weight

            def forward(self, x):
                return nn.functional.cross_entropy(self.head(self.emb(x)).flatten(0, 1), x.flatten())

        TIE = True

        def build_model():
            return Tied(TIE)

        def make_batch(batch_size, context_length, device):
            return torch.randint(0, 1000, (batch_size, context_length), device=device)
    ''')
    mf = load_model_file(path)
    plan = Plan(1, 8, "fp32")
    tied = breakdown(mf, plan, FakeDevice("1GiB", margin=Margin()))
    assert tied.tensor_peak_bytes == run_trial(mf, plan, CpuDevice("1GiB")).peak_allocated_bytes
    mf.module.TIE = False
    untied = breakdown(mf, plan, FakeDevice("1GiB", margin=Margin()))
    # untied: one more 1000x64 fp32 matrix, and AdamW keeps two moments and a step count (one block) for it
    assert untied.parameters_bytes - tied.parameters_bytes == 1000 * 64 * 4
    assert untied.optimizer_state_bytes - tied.optimizer_state_bytes == 2 * 1000 * 64 * 4 + 512  # + a step count


def test_make_device_fake_needs_a_budget():
    with pytest.raises(OomtuneError, match="--budget"):
        make_device("fake", None)
    dev = make_device("fake", "24GiB")
    assert isinstance(dev, FakeDevice) and dev.computes is False and dev.budget_bytes == 24 << 30
    assert dev.margin == parse_margin(None)  # the default margin applies
    assert dev.tracker.budget_bytes < dev.budget_bytes


def test_gpu_table_lookup_and_percent_budgets():
    assert find_gpu("A100-80").name == "A100 80GB"
    assert find_gpu("NVIDIA H100").name == find_gpu("h100").name
    assert find_gpu("rtx 4090").memory_bytes == find_gpu("RTX4090").memory_bytes
    assert find_gpu("t4").bf16 is False  # so `--amp auto` means fp16 there
    with pytest.raises(OomtuneError, match="not in the table"):
        find_gpu("voodoo2")
    names = {g.name for g in GPUS}
    for want in ("Tesla T4", "GeForce RTX 3060", "GeForce RTX 3090", "GeForce RTX 4090", "L4", "A10", "A100 40GB",
                 "A100 80GB", "H100 80GB", "H200"):
        assert want in names
    t4 = find_gpu("t4")
    dev = FakeDevice("50%", gpu=t4)
    assert dev.budget_bytes == t4.memory_bytes // 2 and dev.amp_dtype() == "fp16"


def test_parse_margin():
    assert parse_margin("0") == Margin()
    assert parse_margin("1GiB+8%") == Margin(1 << 30, 0.08)
    assert parse_margin("5%") == Margin(0, 0.05)
    m = parse_margin(None)
    assert parse_margin(m.describe()) == m  # what the config records parses back
    assert m.tensor_budget(m.total(10 << 30)) >= 10 << 30 > m.tensor_budget(m.total(10 << 30) - 1)
    for bad in ("lots", "5%%", "1GiB+x"):
        with pytest.raises(OomtuneError, match="--margin"):
            parse_margin(bad)


def test_item_on_fake_tensors_reads_zero_except_for_known_constants():
    dev = FakeDevice("1GiB", margin=Margin())
    with dev.measure():
        x = torch.randn(256)  # (weight-sized: a draw of a few numbers for a branch has values, test_fakes.py)
        assert x.sum().item() == 0.0 and bool(x.max() > 1) is False
        step = torch.tensor(0.0)
        step += 1  # a small constant the fake mode follows, as an optimizer's step count
        assert step.item() == 1.0


def test_cards_sold_in_two_sizes_are_refused_by_model_alone_and_found_by_size_or_driver_name():
    for model, sizes in (("v100", ("v100-16", "v100-32")), ("a100", ("a100-40", "a100-80"))):
        with pytest.raises(OomtuneError, match=f"names more than one card: {sizes[0]} .* or {sizes[1]}"):
            find_gpu(model)
    assert find_gpu("V100-32GB").compute_capability == (7, 0) and find_gpu("v100-16").bf16 is False
    assert card_for("Tesla V100-SXM2-32GB", 32510 * 2**20, (7, 0)) is find_gpu("v100-32")
    assert card_for("Tesla V100-PCIE-16GB", 16160 * 2**20, (7, 0)) is find_gpu("v100-16")
    assert card_for("NVIDIA RTX A6000", 49140 * 2**20, (8, 6)) is find_gpu("a6000")
    assert find_gpu("NVIDIA L40S").memory_bytes == 46068 * 2**20


def test_a_breakdown_frees_the_allocators_cache_at_the_budget_as_the_trial_does(write_model):
    """A card's caching allocator gives back its cached segments before it runs out. The breakdown (check's, with
    the budget lifted to measure a plan that does not fit) kept them: a plan estimate had just written at
    --headroom 0 read 8 MiB over its budget in check (exit 1). A 20 MiB temporary, freed, then a 30 MiB one that
    cannot reuse its segment: at a budget 20 MiB under the uncapped peak the trial fits, and the breakdown agrees."""
    path = write_model('''
        import torch
        from torch import nn

        class Spiky(nn.Module):
            def __init__(self):
                super().__init__()
                self.lin = nn.Linear(8, 8)

            def forward(self, x):
                first = torch.zeros(20 << 18, device=x.device)  # 20 MiB of fp32
                del first
                second = torch.zeros(30 << 18, device=x.device)
                return self.lin(x).sum() + second[0]

        def build_model():
            return Spiky()

        def make_batch(batch_size, context_length, device):
            return torch.randn(batch_size, context_length, 8, device=device)
    ''')
    mf, plan, card = load_model_file(path), Plan(1, 4, "fp32"), find_gpu("generic")
    uncapped = run_trial(mf, plan, FakeDevice("80GiB", gpu=card)).peak_bytes
    budget = f"{uncapped - 20 * MiB}B"
    capped = run_trial(mf, plan, FakeDevice(budget, gpu=card))
    assert not capped.oom and capped.peak_bytes <= uncapped - 20 * MiB
    assert breakdown(mf, plan, FakeDevice(budget, gpu=card)).peak_bytes == capped.peak_bytes
    assert breakdown(mf, plan, FakeDevice("80GiB", gpu=card)).peak_bytes == uncapped


def test_the_breakdown_says_the_steps_peak_apart_from_the_builds(write_model):
    """A model file whose build makes a 16 MiB scratch tensor (quantizing on the device, say): the peak is in setup;
    step_peak_bytes is the step's phases' own peak (what torchtune logs: it resets the peak once the model is
    built), the trial's forward/backward/optimizer peaks, on the fake and the cpu device alike."""
    path = write_model('''
        import torch
        from torch import nn

        def build_model():
            scratch = torch.zeros(4 << 20)  # 16 MiB of fp32, freed before the step
            del scratch
            return nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 1))

        def make_batch(batch_size, context_length, device):
            return torch.randn(batch_size, context_length, 8, device=device)

        def loss(model, batch):
            return model(batch).mean()
    ''')
    model_file = load_model_file(path)
    plan = Plan(4, 8)
    for device in (CpuDevice("1GiB"), FakeDevice("1GiB", margin=Margin())):
        bd = breakdown(model_file, plan, device)
        trial = run_trial(model_file, plan, device)
        step = max(n for phase, n in trial.phase_peaks.items() if phase != "setup")
        assert bd.phase == "setup" and bd.tensor_peak_bytes >= 16 << 20, bd
        assert bd.step_peak_bytes == step < 1 << 20, (device.kind, bd.step_peak_bytes, trial.phase_peaks)
