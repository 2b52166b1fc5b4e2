"""`oomtune estimate` and `oomtune check`: the ladder on fake tensors, the breakdown of the peak, the CI gate."""

import dataclasses
import json

import pytest

from oomtune.config.loading import load_config
from oomtune.config.schema import MemoryBreakdown, Plan
from oomtune.errors import ConfigError
from oomtune.memory.breakdown import breakdown, static_memory
from oomtune.memory.devices import CpuDevice, FakeDevice
from oomtune.memory.margin import Margin
from oomtune.model_file import load_model_file
from oomtune.search.estimate import estimate
from oomtune.search.options import resolve_targets
from oomtune.search.probe import probe
from oomtune.search.trial import run_trial

from ..conftest import EXAMPLES, ROOT, run_cli

# A model whose hidden width the check test widens; DEFAULTS are the ladder's targets.
WIDE_MODEL = '''
import torch
from torch import nn

WIDTH = {width}


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(16, WIDTH)
        self.blocks = nn.ModuleList(nn.Linear(WIDTH, WIDTH) for _ in range(2))
        self.out = nn.Linear(WIDTH, 4)

    def forward(self, x, y):
        x = self.inp(x)
        for b in self.blocks:
            x = torch.relu(b(x))
        return nn.functional.cross_entropy(self.out(x).mean(1), y)


def build_model():
    return Net()


def make_batch(batch_size, context_length, device):
    return (torch.randn(batch_size, context_length, 16, device=device),
            torch.randint(0, 4, (batch_size,), device=device))


DEFAULTS = {{"batch": 8, "context": 64}}
'''
NO_MARGIN = Margin()


@pytest.fixture(scope="module")
def tiny_gpt():
    return load_model_file(EXAMPLES / "tiny_gpt.py")


# -- the breakdown ---------------------------------------------------------------------------------

@pytest.mark.parametrize("plan", [
    Plan(4, 64, "fp32"),
    Plan(4, 64, "bf16"),
    Plan(4, 64, "bf16", activation_checkpointing=True, grad_accum_steps=2),
], ids=["fp32", "bf16", "bf16+ckpt x2"])
def test_the_breakdown_adds_up_to_the_trial_peak(tiny_gpt, plan):
    """The parts are the live set at the peak: they sum to it exactly, and it is the trial's own peak."""
    margin = Margin(fixed_bytes=1 << 20, fraction=0.05)
    device = FakeDevice("1GiB", margin=margin)
    bd = breakdown(tiny_gpt, plan, device)
    trial = run_trial(tiny_gpt, plan, device)
    assert sum(bd.part_bytes().values()) == bd.tensor_peak_bytes == trial.peak_allocated_bytes
    assert bd.margin_bytes == margin.overhead(bd.tensor_peak_bytes)
    assert bd.peak_bytes == bd.tensor_peak_bytes + bd.margin_bytes == trial.peak_bytes
    assert bd.phase in ("forward", "backward", "optimizer")
    assert bd.modelled_reserved_bytes >= bd.tensor_peak_bytes  # the allocator model: reported beside the peak
    # the parts are the right things: weights are the model's, autocast copies exist only under autocast
    static = static_memory(tiny_gpt)
    assert bd.parameters_bytes == static.weights_bytes
    assert bd.optimizer_state_bytes == static.optimizer_bytes  # the peak is in step 2: the state exists
    assert (bd.autocast_copies_bytes > 0) == (plan.precision != "fp32")
    assert bd.activations_bytes > 0
    # the cpu device (real compute, same accountant) sorts its tensors the same way
    assert breakdown(tiny_gpt, plan, CpuDevice("1GiB")) == dataclasses_replace_margin(bd, "0", 0)


def dataclasses_replace_margin(bd: MemoryBreakdown, margin: str, margin_bytes: int) -> MemoryBreakdown:
    import dataclasses

    return dataclasses.replace(bd, margin=margin, margin_bytes=margin_bytes, peak_bytes=0)


def test_checkpointing_trades_saved_activations_and_autocast_adds_weight_copies(tiny_gpt):
    device = FakeDevice("1GiB", margin=NO_MARGIN)
    fp32 = breakdown(tiny_gpt, Plan(8, 128, "fp32"), device)
    bf16 = breakdown(tiny_gpt, Plan(8, 128, "bf16"), device)
    ckpt = breakdown(tiny_gpt, Plan(8, 128, "bf16", activation_checkpointing=True), device)
    assert bf16.activations_bytes < fp32.activations_bytes  # half-width activations
    assert ckpt.activations_bytes < bf16.activations_bytes / 2  # only block inputs (and one block's recompute)
    assert fp32.autocast_copies_bytes == 0 < bf16.autocast_copies_bytes < bf16.parameters_bytes  # bf16 copies
    assert fp32.parameters_bytes == bf16.parameters_bytes  # autocast keeps the fp32 weights


def test_a_breakdown_that_does_not_add_up_is_rejected_and_old_configs_load_without_one():
    with pytest.raises(ConfigError, match="sum to 6"):
        MemoryBreakdown("forward", 1, 1, 1, 1, 1, 1, tensor_peak_bytes=7)
    for path in sorted((ROOT / "configs").glob("*.yaml")):  # written before the breakdown existed
        config = load_config(path)
        assert config.found_by is None or config.found_by.breakdown is None


# -- estimate ------------------------------------------------------------------------------------

def test_estimate_on_fake_climbs_the_same_ladder_as_probe_on_cpu(write_model):
    """Same accountant: with no margin, the fake device's ladder is the cpu device's, trial for trial (the probe's
    own search: no prior, which would be this very estimate), where the estimate runs every trial; by default it
    replays sizes and searches on a twin that reports the peak past the budget (fewer trials), to the same plan."""
    mf = load_model_file(write_model(WIDE_MODEL.format(width=32)))
    targets = resolve_targets(mf, None, None, None)
    on_cpu = probe(mf, CpuDevice("300KiB"), targets, prior=False)
    every = estimate(mf, FakeDevice("300KiB", margin=NO_MARGIN), targets, replays=False)
    est = estimate(mf, FakeDevice("300KiB", margin=NO_MARGIN), targets)
    seen = lambda records: [(r.rung, r.micro_batch_size, r.context_length, r.grad_accum_steps, r.result,  # noqa: E731
                             r.peak_bytes) for r in records]
    assert seen(every.search.records) == seen(on_cpu.records)
    assert len(every.search.records) >= 4  # it climbed: the target did not fit at fp32
    assert every.config.plan == est.config.plan and every.breakdown == est.breakdown
    assert est.config.plan == on_cpu.config.plan
    fb = est.config.found_by
    assert fb.command == "estimate" and fb.estimated is True and fb.device == "fake"
    assert fb.peak_bytes == on_cpu.config.found_by.peak_bytes == fb.breakdown.peak_bytes
    assert fb.breakdown == est.breakdown and est.breakdown_plan == est.config.plan
    # recorded during the trial that chose the plan: the breakdown of that plan run again on its own
    assert est.breakdown == breakdown(mf, est.config.plan, FakeDevice("300KiB", margin=NO_MARGIN))


def test_estimate_cli_writes_an_estimated_config_with_the_breakdown(write_model, tmp_path):
    model = write_model(WIDE_MODEL.format(width=32))
    out = tmp_path / "best.yaml"
    r = run_cli("estimate", model, "--budget", "400KiB", "--margin", "16KiB+5%", "--out", out, "--json")
    assert r.exit_code == 0, r.output
    report = json.loads(r.stdout)
    assert report["estimated"] is True and report["fits"] is True and report["margin"] == "16KiB+5%"
    bd = report["breakdown"]
    parts = ("parameters", "gradients", "optimizer_state", "autocast_copies", "activations", "temporaries")
    assert sum(bd[f"{p}_bytes"] for p in parts) == bd["tensor_peak_bytes"]
    assert bd["peak_bytes"] == bd["tensor_peak_bytes"] + bd["margin_bytes"] == report["peak_bytes"]
    assert report["peak_bytes"] <= report["limit_bytes"]
    assert all(t["tokens_per_s"] is None for t in report["trials"])  # nothing computed, no speed claimed
    config = load_config(out)  # strict loading reads the new field back
    assert config.found_by.estimated is True
    assert config.found_by.breakdown.tensor_peak_bytes == bd["tensor_peak_bytes"]
    assert config.found_by.breakdown.modelled_reserved_bytes == bd["modelled_reserved_bytes"] > 0  # round trip
    assert config.plan.global_batch_size == 8
    # the table form shows the breakdown and the margin separately
    r = run_cli("estimate", model, "--budget", "400KiB", "--margin", "16KiB+5%", "--out", out)
    assert r.exit_code == 0
    for text in ("saved activations", "temporaries", "tensor peak", "margin 16KiB+5%", "peak in"):
        assert text in r.stdout


def test_nothing_fits_says_why_and_names_the_levers(tiny_gpt, tmp_path):
    static = static_memory(tiny_gpt)
    budget = static.total_bytes  # after 10% headroom the weights, gradients and AdamW state do not fit
    classic = ("--levers", "amp,checkpointing,accumulation")  # with the levers past accumulation, bf16-true fits
    r = run_cli("estimate", EXAMPLES / "tiny_gpt.py", "--budget", str(budget), "--margin", "0", "--json",
                "--out", tmp_path / "x.yaml", *classic)
    assert r.exit_code == 2  # a budget under the weights is bad input, as for probe (it still says what would help)
    report = json.loads(r.stdout)
    assert report["fits"] is False and report["trials"] == []  # known without a trial
    assert report["budget_bytes"] == budget and report["limit_bytes"] == int(budget * 0.9)
    assert report["why_nothing_fits"].startswith(f"{static.describe()} > ")  # the floor
    levers = " ".join(report["levers"])
    assert "8-bit" in levers and "shard" in levers and "offload" in levers
    bd = report["breakdown"]  # of the smallest plan: micro-batch 1 at the target context, last rung
    assert report["breakdown_plan"]["micro_batch_size"] == 1
    assert (bd["parameters_bytes"], bd["optimizer_state_bytes"]) == (static.weights_bytes, static.optimizer_bytes)
    assert bd["tensor_peak_bytes"] >= static.total_bytes  # (in backward: fused AdamW's step holds no scratch)
    assert not (tmp_path / "x.yaml").exists()
    r = run_cli("estimate", EXAMPLES / "tiny_gpt.py", "--budget", str(budget), "--margin", "0",
                "--out", tmp_path / "x.yaml", *classic)
    assert "AdamW state" in r.stderr and "the optimizer step's temporaries" not in r.stderr  # (fused: none)
    assert "what would help" in r.stdout


def test_what_if_one_plan(tmp_path):
    args = ("estimate", EXAMPLES / "tiny_gpt.py", "--micro-batch", "4", "--context", "64", "--precision", "bf16",
            "--checkpointing", "--margin", "0", "--json")
    r = run_cli(*args)  # no budget: the breakdown alone
    assert r.exit_code == 0, r.output
    report = json.loads(r.stdout)
    assert report["fits"] is None
    assert report["plan"]["activation_checkpointing"] is True and report["plan"]["precision"] == "bf16"
    peak = report["breakdown"]["peak_bytes"]
    fits = run_cli(*args, "--budget", str(int(peak / 0.9) + 1))
    assert fits.exit_code == 0 and json.loads(fits.stdout)["fits"] is True
    short = run_cli(*args, "--budget", str(int(peak / 0.9) - 512))
    assert short.exit_code == 1 and json.loads(short.stdout)["fits"] is False
    assert report["card"] == "a generic sm80 card"  # whose rules counted it, named: in the JSON and the table
    ladder = json.loads(run_cli("estimate", EXAMPLES / "tiny_gpt.py", "--gpu", "t4", "--json",
                                "--out", tmp_path / "t4.yaml").stdout)
    assert ladder["card"] == "Tesla T4" and ladder["card_profile"].startswith("card profile: Tesla T4")
    on_t4 = run_cli(*args[:-1], "--gpu", "t4")
    assert on_t4.exit_code == 0 and on_t4.stdout.startswith("estimate for Tesla T4:"), on_t4.output


def test_what_if_of_a_compiled_model_says_how_it_was_traced():
    """device: fake. A build_model() returning torch.compile(model) is traced on the fake device as --compile traces
    (Dynamo runs nothing under the tracker); the ladder notes it (measurement_notes), and README promises "the output
    says so". The what-if (--micro-batch) said nothing."""
    model = ROOT / "tests" / "finetune" / "models" / "compiled.py"
    r = run_cli("estimate", model, "--micro-batch", "2", "--budget", "1GiB", "--margin", "0", "--json")
    assert r.exit_code == 0, r.output
    notes = json.loads(r.stdout)["notes"]
    assert any("compiles its model (torch.compile)" in n and "traced as --compile traces" in n for n in notes), notes


def test_what_if_one_plan_with_levers_past_accumulation():
    """device: fake. --levers with --micro-batch puts those levers on the one plan (they were ignored): the 8-bit
    state is a quarter of AdamW's and more (a scale per 256), offload leaves no optimizer state on the device and
    holds it on the host; bf16-true is the plan's precision. The usual levers are the plan's own options."""
    base = ("estimate", EXAMPLES / "tiny_gpt.py", "--micro-batch", "2", "--context", "64", "--margin", "0", "--json")
    plain, eight, off = (json.loads(run_cli(*base, *extra).stdout) for extra in
                         ((), ("--levers", "8bit"), ("--levers", "bf16-true,8bit,offload")))
    assert eight["plan"]["optimizer_8bit"] and not plain["plan"]["optimizer_8bit"]
    assert plain["breakdown"]["optimizer_state_bytes"] / 4 < eight["breakdown"]["optimizer_state_bytes"] < \
        plain["breakdown"]["optimizer_state_bytes"] / 2
    assert off["plan"]["precision"] == "bf16-true" and off["plan"]["offload_optimizer"]
    assert off["breakdown"]["optimizer_state_bytes"] == 0 and off["breakdown"]["host_bytes"] > 0
    for bad, why in ((("--levers", "amp"), "amp is the plan's own"),
                     (("--levers", "bf16-true", "--precision", "fp16"), "cannot go with --precision fp16")):
        r = run_cli(*base, *bad)
        assert r.exit_code == 2 and why in json.loads(r.stdout)["error"]


# -- check ---------------------------------------------------------------------------------------

def test_check_passes_unchanged_and_fails_after_a_wider_layer(write_model, tmp_path):
    model = write_model(WIDE_MODEL.format(width=32))
    config = tmp_path / "best.yaml"
    r = run_cli("estimate", model, "--budget", "400KiB", "--margin", "0", "--out", config)
    assert r.exit_code == 0, r.output
    ok = run_cli("check", "--config", config, "--json")
    assert ok.exit_code == 0, ok.output
    report = json.loads(ok.stdout)
    assert report["fits"] is True and report["new_peak_bytes"] == report["old_peak_bytes"]
    assert all(v == 0 for v in report["difference"].values())

    write_model(WIDE_MODEL.format(width=128))  # a wider layer, same file
    grown = run_cli("check", "--config", config, "--json")
    assert grown.exit_code == 1
    report = json.loads(grown.stdout)
    assert report["fits"] is False and report["new_peak_bytes"] > report["limit_bytes"]
    diff = report["difference"]
    assert diff["parameters"] > 0 and diff["activations"] > 0
    assert diff["peak"] == report["new_peak_bytes"] - report["old_peak_bytes"]
    # the human form prints the old and new peak and the difference by part
    text = run_cli("check", "--config", config)
    assert text.exit_code == 1
    for phrase in ("old peak", "new peak", "difference", "parameters", "no longer fits"):
        assert phrase in text.output
    # a bigger budget makes it fit again
    assert run_cli("check", "--config", config, "--budget", "10MiB").exit_code == 0


def test_check_compares_no_peak_recorded_for_another_plan(write_model, tmp_path):
    """train's out-of-memory fallback rewrites the plan and keeps found_by: check printed found_by's peak, another
    plan's, as the old peak (and its breakdown as the difference)."""
    from oomtune.config.writing import rewrite_plan

    model = write_model(WIDE_MODEL.format(width=32))
    config = tmp_path / "best.yaml"
    assert run_cli("estimate", model, "--budget", "400KiB", "--margin", "0", "--out", config).exit_code == 0
    loaded = load_config(config)
    plan = loaded.plan
    assert plan.micro_batch_size > 1, "a plan the fallback can halve"
    halved = dataclasses.replace(plan, micro_batch_size=plan.micro_batch_size // 2,
                                 grad_accum_steps=plan.grad_accum_steps * 2)
    rewrite_plan(config, plan, halved, "plan updated by `oomtune train` at step 3")
    report = json.loads(run_cli("check", "--config", config, "--json").stdout)
    assert report["old_peak_bytes"] is None and report["difference"] is None
    assert report["new_peak_bytes"] < loaded.found_by.peak_bytes
    assert "none recorded in the config for this plan" in run_cli("check", "--config", config).output


def test_check_on_the_cpu_device_agrees(write_model, tmp_path):
    model = write_model(WIDE_MODEL.format(width=32))
    config = tmp_path / "best.yaml"
    assert run_cli("estimate", model, "--budget", "400KiB", "--margin", "0", "--out", config).exit_code == 0
    r = run_cli("check", "--config", config, "--device", "cpu", "--json")
    assert r.exit_code == 0, r.output
    report = json.loads(r.stdout)
    assert report["device"] == "cpu" and report["new_peak_bytes"] == report["old_peak_bytes"]


def test_bad_input_exits_2(write_model, tmp_path):
    model = write_model(WIDE_MODEL.format(width=32))
    flat = write_model(WIDE_MODEL.format(width=32).replace(  # no ModuleList: nothing for checkpointing to wrap
        "nn.ModuleList(nn.Linear(WIDTH, WIDTH) for _ in range(2))", "nn.Sequential(nn.Linear(WIDTH, WIDTH))"),
        "flat.py")
    bad_yaml = tmp_path / "bad.yaml"
    bad_yaml.write_text("model: model.py\nplan: {micro_batch_size: 1, context_length: 8}\nbogus: 1\n")
    no_model = tmp_path / "nomodel.yaml"
    no_model.write_text("model: missing.py\nplan: {micro_batch_size: 1, context_length: 8}\n")
    no_budget = tmp_path / "nobudget.yaml"
    no_budget.write_text("model: model.py\nplan: {micro_batch_size: 1, context_length: 8}\n")
    cases = {
        "missing config": ("check", "--config", tmp_path / "nope.yaml"),
        "unknown key": ("check", "--config", bad_yaml),
        "missing model": ("check", "--config", no_model),
        "no budget anywhere": ("check", "--config", no_budget),
        "bad device": ("check", "--config", no_budget, "--budget", "1MiB", "--device", "tpu"),
        "estimate without budget": ("estimate", model),
        "unknown gpu": ("estimate", model, "--gpu", "voodoo2"),
        "bad margin": ("estimate", model, "--budget", "1GiB", "--margin", "lots"),
        "throughput needs compute": ("estimate", model, "--budget", "1GiB", "--objective", "throughput"),
        "plan flag without --micro-batch": ("estimate", model, "--precision", "bf16"),
        "budget under the margin": ("estimate", model, "--budget", "100MiB", "--margin", "1GiB"),
        "checkpointing without blocks": ("estimate", flat, "--micro-batch", "1", "--checkpointing"),
    }
    for name, args in cases.items():
        r = run_cli(*args)
        assert r.exit_code == 2, (name, r.output)
        assert "error:" in r.stderr and "Traceback" not in r.output, name
    assert "define blocks(model)" in run_cli("estimate", flat, "--micro-batch", "1", "--checkpointing").stderr
    assert run_cli("estimate", flat, "--micro-batch", "1", "--margin", "0").exit_code == 0  # the file itself is fine


MLP = """
import torch
from torch import nn

def build_model():
    return nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 64))

def make_batch(batch_size, context_length, device):
    return torch.randn(batch_size, context_length, 64, device=device)

def loss(model, batch):
    return model(batch).square().mean()
"""


def test_bf16_on_a_card_without_it_gets_a_note_and_the_same_memory(tmp_path, write_model):
    """The note changes nothing of the estimate: the same bytes as on a card with bf16 (a model with no attention,
    whose kernels differ by card: a T4 has no flash attention)."""
    args = ("estimate", write_model(MLP), "--micro-batch", "2", "--context", "32", "--precision", "bf16")
    t4, a100 = run_cli(*args, "--gpu", "t4", "--json"), run_cli(*args, "--gpu", "a100-80", "--json")
    assert t4.exit_code == 0 and a100.exit_code == 0, t4.output + a100.output
    t4_out, a100_out = json.loads(t4.stdout), json.loads(a100.stdout)
    assert "no native bf16" in t4_out["note"] and "note" not in a100_out
    assert t4_out["breakdown"]["tensor_peak_bytes"] == a100_out["breakdown"]["tensor_peak_bytes"]
    ladder = run_cli("estimate", EXAMPLES / "tiny_gpt.py", "--gpu", "t4", "--amp", "bf16", "--batch", "2",
                     "--context", "32", "--out", tmp_path / "best.yaml")
    assert ladder.exit_code == 0 and "note: Tesla T4 has no native bf16" in ladder.stderr


ROUTED = """
import torch
from torch import nn

class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.wide = nn.Linear(64, 4096)
        self.out = nn.Linear(64, 1)

    def forward(self, x):
        h = torch.relu(self.wide(x))  # most of a trial's memory, before the routing reads values
        keep = (h[:, :64] > 0).any(1).nonzero().squeeze(1)  # data-dependent: the fake device cannot
        return self.out(x[keep] + h[keep, :64]).square().mean()

def build_model():
    return Net()

def make_batch(batch_size, context_length, device):
    return torch.randn(batch_size, 64, device=device)

def loss(model, batch):
    return model(batch)
"""


def test_an_estimate_that_computes_instead_tells_each_trial_once(write_model):
    """devices: fake, then the cpu computing. The target (64) runs out of memory on fake tensors before the routing;
    micro-batch 1 meets nonzero, and the estimate reruns on computed tensors, repeating the target's trial: the
    progress printed it twice."""
    import oomtune

    told = []
    result = oomtune.estimate(write_model(ROUTED), budget="1MiB", margin="0", batch=64, context=1,
                              on_trial=told.append)
    keys = [(r.rung, r.micro_batch_size, r.context_length, r.grad_accum_steps) for r in told]
    assert any("computed on the cpu" in n for n in result.search.notes)
    assert told[0].micro_batch_size == 64 and told[0].result == "oom"
    assert len(keys) == len(set(keys)) == len(result.search.records)
