"""`oomtune probe` end to end on the cpu device (real compute, simulated memory budget)."""

import json

import pytest

from oomtune.config.loading import load_config
from oomtune.config.schema import Plan
from oomtune.memory.devices import CpuDevice
from oomtune.model_file import load_model_file
from oomtune.search.options import resolve_targets
from oomtune.search.probe import probe
from oomtune.search.trial import run_trial
from oomtune.units import format_bytes

from ..conftest import EXAMPLES, TINY_MODEL, run_cli

MiB = 1 << 20
B, T = 8, 64


@pytest.fixture(scope="module")
def tiny_gpt():
    return load_model_file(EXAMPLES / "tiny_gpt.py")


@pytest.fixture(scope="module")
def peaks(tiny_gpt):
    """Exhaustive truth: the measured peak of every micro-batch 1..B on every rung (device: cpu, no cap)."""
    device = CpuDevice("4GiB")
    table = {}
    for precision, ckpt in (("fp32", False), ("bf16", False), ("bf16", True)):
        for b in range(1, B + 1):
            r = run_trial(tiny_gpt, Plan(b, T, precision, ckpt), device)
            assert not r.oom
            table[(precision, ckpt, b)] = r.peak_bytes
    return table


@pytest.mark.parametrize("budget_mib", [6, 7, 9])
def test_each_rung_picks_the_largest_micro_batch_that_fits(tiny_gpt, peaks, budget_mib):
    """device: cpu. Every rung is searched (objective throughput); its micro-batch equals exhaustive search."""
    device = CpuDevice(f"{budget_mib}MiB")
    result = probe(tiny_gpt, device, resolve_targets(tiny_gpt, B, T, None), objective="throughput")
    limit = int(budget_mib * MiB * 0.9)
    assert result.limit_bytes == limit
    searched = {(r.rung.precision, r.rung.activation_checkpointing): r for r in result.ladder.rungs}
    assert len(searched) == 3
    for (precision, ckpt), r in searched.items():
        fitting = [b for b in range(1, B + 1) if peaks[(precision, ckpt, b)] <= limit]
        truth = max(fitting) if fitting else None
        assert r.micro_batch_size == truth, (precision, ckpt)
        # trials are counted per rung, and the count is what ran
        assert r.trials == sum(1 for t in result.records if t.rung == r.rung.name and t.grad_accum_steps == 1)
        assert r.trials <= 6  # exhaustive search would run B = 8
    plan = result.config.plan
    assert plan.global_batch_size == B and plan.micro_batch_size * plan.grad_accum_steps == B
    assert result.config.found_by.peak_bytes <= limit


CLASSIC = frozenset({"amp", "checkpointing", "accumulation"})  # no rung past accumulation

def test_when_only_accumulation_could_keep_the_batch_and_it_does_not_fit_the_reason_says_so(tiny_gpt):
    """device: cpu. At context 256 under 6.1 MiB, micro-batch 2 fits with checkpointing, but 8 = 4 x 2 (or 2 x 4,
    1 x 8) keeps the gradients alive through the next micro-step and none of those fits: no plan keeps the global
    batch at 8. (At context 64 the optimizer step's foreach temporaries outweigh the activations, so accumulation
    costs nothing there.) The classic ladder: with the levers past accumulation the climb goes on to bf16-true,
    whose plan fits (test_then_the_climb_goes_past_accumulation)."""
    t = 256
    result = probe(tiny_gpt, CpuDevice("6.1MiB"), resolve_targets(tiny_gpt, B, t, None), levers=CLASSIC)
    limit = int(6.1 * MiB * 0.9)
    best = max(r.micro_batch_size or 0 for r in result.ladder.rungs)
    assert 1 < best < B and result.config is None
    fits = [run_trial(tiny_gpt, Plan(b, t, "bf16", True), CpuDevice("4GiB")).peak_bytes <= limit
            for b in (best, best + 1)]
    assert fits == [True, False]  # the rung's answer is the true largest micro-batch
    accumulated = [(r.micro_batch_size, r.grad_accum_steps) for r in result.records if r.grad_accum_steps > 1]
    assert (1, 8) in accumulated and all(r.result != "fits" for r in result.records if r.grad_accum_steps > 1)
    assert result.why_nothing_fits.startswith(
        f"nothing fits in 5.49 MiB with the global batch kept at 8: micro-batch {best} fits (checkpointing")
    assert f"Lower --batch to {best}" in result.why_nothing_fits


def test_then_the_climb_goes_past_accumulation(tiny_gpt):
    """device: cpu. The same case with every lever: checkpointing fits micro-batch 2 at context 256 alone but no
    accumulated plan, so the ladder goes on to bf16-true, which keeps the batch at 8 (it used to stop there)."""
    result = probe(tiny_gpt, CpuDevice("6.1MiB"), resolve_targets(tiny_gpt, B, 256, None))
    plan = result.config.plan
    assert plan.precision == "bf16-true" and plan.global_batch_size == B and plan.context_length == 256
    assert result.ladder.rungs[2].rung.name == "checkpointing" and (result.ladder.rungs[2].micro_batch_size or 0) > 1


def test_cli_writes_a_config_that_round_trips_and_json_for_ci(tmp_path):
    """device: cpu."""
    out = tmp_path / "best.yaml"
    r = run_cli("probe", EXAMPLES / "conv_net.py", "--device", "cpu", "--budget", "8MiB", "--batch", "8",
                "--context", "64", "--out", out, "--json")
    assert r.exit_code == 0, r.output
    data = json.loads(r.stdout)  # stdout: the JSON alone; the header and a line per trial went to stderr
    assert r.stderr.startswith("probing conv_net.py on cpu") and r.stderr.count(" b=") == len(data["trials"])
    cfg = load_config(out)
    assert data["plan"] == {
        "micro_batch_size": cfg.plan.micro_batch_size, "context_length": 64, "precision": cfg.plan.precision,
        "activation_checkpointing": cfg.plan.activation_checkpointing,
        "grad_accum_steps": cfg.plan.grad_accum_steps, "world_size": 1, "sharding": "none",
        "optimizer_8bit": False, "offload_optimizer": False, "offload_activations": False,
        "nf4_frozen_weights": False, "chunked_loss": False, "optimizer_in_backward": False, "compile": False,
        "global_batch_size": 8,
    }
    assert data["peak_bytes"] == cfg.found_by.peak_bytes <= data["limit_bytes"] == int(8 * MiB * 0.9)
    assert len(data["trials"]) == len(cfg.found_by.trials) == sum(r["trials"] for r in data["rungs"]) + sum(
        1 for t in data["trials"] if t["grad_accum_steps"] > 1)
    assert {t["result"] for t in data["trials"]} <= {"fits", "oom", "over-headroom"}
    # what each trial's seconds went on: building the model (and its optimizer), then the steps
    assert all(0 < t["build_seconds"] < t["seconds"] for t in data["trials"])
    assert [t.build_seconds for t in cfg.found_by.trials] == [t["build_seconds"] for t in data["trials"]]
    assert cfg.model_path(out).resolve() == (EXAMPLES / "conv_net.py").resolve()
    assert cfg.found_by.device == "cpu" and cfg.found_by.estimated is False


def test_cli_table_and_nothing_fits_exit_code(tmp_path):
    """device: cpu. A budget that holds the floor (weights, gradients, AdamW state - fused, no step
    temporaries: 4.11 MiB) but not one example at context 512: exit 1, the reason, no file. The classic ladder (past
    accumulation, bf16-true fits it: tests/levers)."""
    out = tmp_path / "best.yaml"
    classic = ("--levers", "amp,checkpointing,accumulation")
    args = ("probe", EXAMPLES / "tiny_gpt.py", "--device", "cpu", "--budget", "4.9MiB", "--context", "512",
            "--out", out, *classic)
    r = run_cli(*args)
    assert r.exit_code == 1, r.output
    assert "nothing fits in 4.41 MiB" in r.stderr and "AdamW state" in r.stderr
    assert "AdamW state 2.07 MiB = 4.11 MiB" in r.stderr
    assert "trials" in r.stdout and "OOM" in r.stdout
    assert not out.exists()
    report = json.loads(run_cli(*args, "--json").stdout)
    assert report["fits"] is False and report["budget_bytes"] == int(4.9 * MiB)  # what it was given, fits or not
    under = run_cli("probe", EXAMPLES / "tiny_gpt.py", "--device", "cpu", "--budget", "4.5MiB", "--out", out, *classic)
    assert under.exit_code == 2  # 4.05 MiB allowed: under the floor, the weights alone (and their state) do not fit
    assert "too small for the weights alone" in under.stderr and "state 2.07 MiB = 4.11 MiB" in under.stderr


def test_an_existing_config_survives_a_failed_probe(tmp_path, write_model):
    out = tmp_path / "best.yaml"
    out.write_text("precious: true\n")
    r = run_cli("probe", write_model("def build_model(:\n"), "--device", "cpu", "--out", out)
    assert r.exit_code == 2
    assert out.read_text() == "precious: true\n"


def test_targets_fall_back_to_the_model_files_defaults(tiny_gpt):
    t = resolve_targets(tiny_gpt, None, None, None)
    assert (t.batch, t.context, t.min_context) == (16, 128, 128)
    t = resolve_targets(tiny_gpt, 4, None, 32)
    assert (t.batch, t.context, t.min_context) == (4, 128, 32)


def test_help_lists_every_option():
    r = run_cli("probe", "--help")
    for opt in ("--batch", "--context", "--min-context", "--device", "--budget", "--headroom", "--steps",
                "--objective", "--out", "--json", "--debug"):
        assert opt in r.stdout


def test_a_global_batch_with_no_divisor_near_what_fits_gets_a_note(tmp_path):
    """device: cpu. 13 is prime: every rung's plan is 1 x 13, so the earliest rung runs it (fp32, where 4 fits; 7
    fits with checkpointing, which would only recompute), and the CLI says so: the largest micro-batch any rung fits
    (it said fp32's 4, and '--batch 12 would run as 4 x 3', where 12 ran as 2 x 6), and a batch with a divisor
    there, whose accumulation no trial measured (14 runs as 2 x 7 here: 7 x 2 does not fit)."""
    out = tmp_path / "best.yaml"
    r = run_cli("probe", EXAMPLES / "conv_net.py", "--device", "cpu", "--budget", "4MiB", "--batch", "13",
                "--context", "64", "--out", out, "--json")
    assert r.exit_code == 0, r.output
    data = json.loads(r.stdout)
    fitting = {x["rung"]: x["micro_batch_size"] for x in data["rungs"]}
    assert (fitting["fp32"], fitting["checkpointing"]) == (4, 7)
    plan = data["plan"]
    assert (plan["precision"], plan["activation_checkpointing"]) == ("fp32", False)
    assert (plan["micro_batch_size"], plan["grad_accum_steps"]) == (1, 13)
    assert data["divisor_note"] == (
        "micro-batch 7 fits (bf16, checkpointing), but the global batch 13 has no divisor between 2 and 7: it runs as "
        "1 x 13; --batch 14 as 7 x 2 may fit, where its accumulation does: probe it to know")  # (the cpu device)
    plain = run_cli("probe", EXAMPLES / "conv_net.py", "--device", "cpu", "--budget", "8MiB", "--batch", "8",
                    "--context", "64", "--out", out, "--json")
    assert json.loads(plain.stdout)["divisor_note"] is None


CONTEXT_ONE_MODEL = '''
import torch
from torch import nn

class Spread(nn.Module):  # 84 weights, 1 MiB of fp32 activations per example (autocast leaves `*` in fp32)
    def __init__(self):
        super().__init__()
        self.scale = nn.Parameter(torch.ones(16))
        self.head = nn.Linear(16, 4)

    def forward(self, x):
        h = torch.relu(x * self.scale.view(1, 16, 1, 1))
        return self.head(h.mean(dim=(2, 3)))

def build_model():
    return Spread()

def make_batch(batch_size, context_length, device):
    return torch.randn(batch_size, 1, 128, 128, device=device), torch.randint(0, 4, (batch_size,), device=device)

def loss(model, batch):
    x, y = batch
    return nn.functional.cross_entropy(model(x), y)

DEFAULTS = {"batch": 8, "context": 1}
'''


def test_what_nothing_fitting_says_names_what_happened_and_only_levers_that_apply(write_model, tmp_path):
    """device: cpu. A model with no blocks and a context of 1: the probe says the checkpointing rung was left out and
    why; when micro-batch 1 runs but goes over the limit (the headroom is what it ate), the reason says so, not
    "runs out of memory"; and it suggests no shorter --min-context for a context of 1."""
    model = write_model(CONTEXT_ONE_MODEL)
    mf = load_model_file(model)
    peaks = [run_trial(mf, Plan(1, 1, p), CpuDevice("4GiB")).peak_bytes for p in ("fp32", "bf16")]
    assert max(peaks) < 1.2 * min(peaks)  # alike on both rungs
    peak = max(peaks)
    classic = ("--levers", "amp,checkpointing,accumulation")  # (past accumulation: tests/levers)
    # allowed: under 0.9 x either peak; the budget holds it
    over = run_cli("probe", model, "--device", "cpu", "--budget", str(int(peak * 1.5)), "--headroom", "0.5",
                   "--out", tmp_path / "a.yaml", "--json", "--no-prior", *classic)
    assert over.exit_code == 1, over.output
    report = json.loads(over.stdout)
    assert {t["result"] for t in report["trials"] if t["micro_batch_size"] == 1} == {"over-headroom"}  # it ran, but
    assert "oom" in {t["result"] for t in report["trials"]}  # into the headroom (the target batch of 8 ran out)
    assert "goes over the limit (the budget less the headroom) on every rung (fp32, amp)" in report["why_nothing_fits"]
    least = min(t["peak_bytes"] for t in report["trials"] if t["micro_batch_size"] == 1)  # what micro-batch 1 took,
    assert f"; the least it took was {format_bytes(least)} (" in report["why_nothing_fits"]  # not just the floor
    assert "(the model as built) before activations" in report["why_nothing_fits"]
    assert "runs out of memory" not in report["why_nothing_fits"] and "--min-context" not in report["why_nothing_fits"]
    own = [n for n in report["notes"] if not n.startswith("threads: ")]
    assert own == ["no activation checkpointing rung: model.py has no blocks to wrap (no nn.ModuleList "
                               "of same-type modules, no gradient_checkpointing_enable); define blocks(model) to add "
                               "it"]
    oom = run_cli("probe", model, "--device", "cpu", "--budget", str(int(peak * 0.5)), "--headroom", "0",
                  "--out", tmp_path / "b.yaml", "--json", *classic)
    assert oom.exit_code == 1, oom.output
    assert "runs out of memory on every rung" in json.loads(oom.stdout)["why_nothing_fits"]


def test_a_prior_asked_for_where_it_cannot_run_is_one_line_and_exit_2(tmp_path):
    """device: fake. The fake device's probe is the estimate itself: --prior there is refused, not ignored, and no
    config is written."""
    r = run_cli("probe", EXAMPLES / "mlp_dict.py", "--device", "fake", "--budget", "700MiB", "--prior",
                "--out", tmp_path / "best.yaml")
    assert r.exit_code == 2 and "not on the fake device" in " ".join(r.output.split()), r.output
    assert not (tmp_path / "best.yaml").exists()


def test_the_probe_from_the_estimate_runs_the_same_plan_in_two_device_trials_a_rung():
    """device: cpu (its prior on fake). B = 64 fits only with checkpointing; fp32 and amp would accumulate, so each is
    certified by its plan, and the probe runs the same plan as the search alone, in 5 device trials against 13.
    fp32 fits 32 alone, but not 32 x 2: accumulation keeps the gradients alive through the next micro-step. The
    estimate predicted 32 x 2 (its own ladder stopped at checkpointing without trying fp32's plan), so the plan steps
    down to 16 x 4. The estimate chose checkpointing, so no divisor note will speak of fp32: its plan is not checked
    against what fits alone."""
    mf = load_model_file(EXAMPLES / "mlp_dict.py")
    targets = resolve_targets(mf, 64, 16, None)
    searched = probe(mf, CpuDevice("16MiB"), targets, prior=False)
    certified = probe(mf, CpuDevice("16MiB"), targets, prior=True)
    assert certified.config.plan == searched.config.plan
    alone = {r.rung.name: r.micro_batch_size for r in searched.ladder.rungs}
    plans = {r.rung.name: (r.micro_batch_size, r.grad_accum_steps) for r in certified.ladder.rungs}
    assert alone == {"fp32": 32, "amp": 52, "checkpointing": 64}
    assert plans == {"fp32": (16, 4), "amp": (32, 2), "checkpointing": (64, 1)}
    ran = [(t.rung, t.micro_batch_size, t.grad_accum_steps, t.result) for t in certified.records]
    assert ran[:2] == [("fp32", 32, 2, "oom"), ("fp32", 16, 4, "fits")]
    assert [r.trials for r in certified.ladder.rungs] == [2, 2, 1]
    assert (len(certified.records), len(searched.records)) == (5, 13)
    # the estimate ran 5 fake trials (per rung: the target and micro-batch 1, which line up; then the plan) and
    # replayed the other 6 sizes its search tried (memory/replay.py)
    assert (certified.prior.trials, certified.prior.replayed) == (5, 6)
    assert certified.prior.to_json()["replayed_trials"] == 6


def test_the_prior_knows_the_models_blocks_from_its_static_build(monkeypatch):
    """device: cpu (its prior on fake). The prior is told the model's repeated blocks by the probe's static build
    (3 alike layers of mlp_dict.py, too few to make trials from fewer of them): none of its fake trials runs a model
    cut to fewer blocks. Before, its first trial measured the model cut to 2 of them only to learn how many there
    were, threw that away, and ran the trial again whole (6 traced trials for 5)."""
    import oomtune.search.prior as prior
    from oomtune.search.fewer_blocks import FewerBlocks

    ran = []
    real = prior.run_trial
    monkeypatch.setattr(prior, "run_trial", lambda mf, *a, **k: ran.append(type(mf)) or real(mf, *a, **k))
    mf = load_model_file(EXAMPLES / "mlp_dict.py")
    certified = probe(mf, CpuDevice("16MiB"), resolve_targets(mf, 64, 16, None), prior=True)
    assert certified.prior.trials == 5 and len(ran) == 5 and FewerBlocks not in ran, ran


PADDED = """
import torch
from torch import nn

class Padded(nn.Module):  # pads the batch up to a multiple of 8: activations grow in steps of 8 samples
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(512, 512) for _ in range(3))
        self.out = nn.Linear(512, 4)

    def forward(self, x, y):
        n = x.shape[0]
        x = nn.functional.pad(x, (0, 0, 0, 0, 0, -n % 8))
        for b in self.blocks:
            x = torch.relu(b(x))
        return nn.functional.cross_entropy(self.out(x).mean(1)[:n], y)

def build_model():
    return Padded()

def make_batch(batch_size, context_length, device):
    return (torch.randn(batch_size, context_length, 512, device=device),
            torch.randint(0, 4, (batch_size,), device=device))
"""


def test_a_model_whose_memory_is_not_a_line_in_the_batch_misleads_a_replay_not_the_probe(write_model):
    """devices: fake (the estimate, with and without replays) and cpu. Padding the batch to a multiple of 8 makes
    memory a staircase: the traces at 50 and 46 (padded to 56 and 48) line up, and the replay at 48 reads 56's
    memory, so the prior says 47 where the fake device's own trial says 48. A prior is only where the device's
    trials start: the probe from this one runs the plan the search alone finds (fp32 is certified by its plan,
    32 x 2, and amp fits 64 at once)."""
    from oomtune.search.prior import ReplayingTrials, prior_device

    mf = load_model_file(write_model(PADDED))
    targets = resolve_targets(mf, 64, 64, None)
    answers = {}
    for trial in (run_trial, ReplayingTrials()):
        est = probe(mf, prior_device(CpuDevice("60MiB")), targets, amp="bf16", command="estimate", trial=trial,
                    prior=False)
        answers[trial is run_trial] = est.ladder.rungs[0].micro_batch_size
    assert answers == {True: 48, False: 47}
    plans = {prior: probe(mf, CpuDevice("60MiB"), targets, amp="bf16", prior=prior).config.plan
             for prior in (False, True)}
    assert plans[True] == plans[False]


@pytest.mark.parametrize("dtype", ["half", "bfloat16", "float"])
def test_a_model_built_in_16_bits_has_no_amp_rung_and_a_note_saying_what_it_trains(dtype, write_model):
    """device: cpu. build_model() returning `.half()` / `.bfloat16()`: autocast would only copy the weights (and
    on the CPU mixes fp16 weights with bf16 activations), so the ladder has no amp rung. A bf16 model's rungs are
    bf16-true, named and labelled so (they were 'fp32' over bf16 weights, gradients and AdamW state), and an explicit
    --amp bf16 adds no amp rung either (bf16-true runs under bf16 autocast already); an fp16 model's plans say
    'fp32' (no autocast; no precision names fp16 weights without one), explained. An fp32 model keeps its amp rung,
    and an explicit --amp fp16 keeps it for a bf16 model."""
    from ..conftest import TINY_MODEL

    source = (TINY_MODEL.replace("return Net()", f"return Net().{dtype}()")
              .replace("16, device=device)", f"16, device=device).{dtype}()"))
    mf = load_model_file(write_model(source))
    targets = resolve_targets(mf, 8, 4, None)
    result = probe(mf, CpuDevice("64MiB"), targets, levers=CLASSIC, objective="throughput")  # every rung searched
    names = [r.rung.name for r in result.ladder.rungs]
    notes = " ".join(result.notes)
    if dtype == "float":
        assert "amp" in names and "trained weights are" not in notes
        return
    wanted, first = {"half": ("float16", "fp32"), "bfloat16": ("bfloat16", "bf16-true")}[dtype]
    assert "amp" not in names and names[0] == first and len(names) >= 2, names
    assert {r.rung.precision for r in result.ladder.rungs} == {first} and result.config.plan.precision == first
    assert f"trained weights are {wanted}" in notes and "no amp rung" in notes
    if dtype == "half":  # (autocast to bf16 over fp16 weights: the CPU's autocast mixes the two)
        assert "its precision 'fp32' means no autocast, and no GradScaler" in notes
        return
    same = probe(mf, CpuDevice("64MiB"), targets, levers=CLASSIC, objective="throughput", amp="bf16")
    assert "amp" not in [r.rung.name for r in same.ladder.rungs] and "no amp rung" in " ".join(same.notes)
    explicit = probe(mf, CpuDevice("64MiB"), targets, levers=CLASSIC, objective="throughput", amp="fp16")
    assert "amp" in [r.rung.name for r in explicit.ladder.rungs] and "no amp rung" not in " ".join(explicit.notes)

@pytest.mark.parametrize("norm, noted", [("nn.BatchNorm1d(16)", True), ("nn.GroupNorm(4, 16)", False)])
def test_a_batchnorm_model_that_accumulates_gets_a_note(norm, noted, write_model, tmp_path):
    """device: cpu. The YAML says accumulation is "the same step"; with BatchNorm it is not: each micro-batch
    normalises over itself. A probe that chose micro-batch 1 x 64 for a BatchNorm CNN said nothing."""
    source = TINY_MODEL.replace("        self.out = nn.Linear(16, 4)\n",
                                f"        self.out = nn.Linear(16, 4)\n        self.norm = {norm}\n").replace(
        "        return nn.functional.cross_entropy(", "        x = self.norm(x.transpose(1, 2)).transpose(1, 2)\n"
                                                      "        return nn.functional.cross_entropy(")
    assert source.count("self.norm") == 2
    said = "model.py has BatchNorm layers: with accumulation or ranks each normalises over its micro-batch of"
    for batch, accumulates in (("64", True), ("1", False)):
        r = run_cli("probe", write_model(source), "--device", "cpu", "--budget", "120KiB", "--batch", batch,
                    "--context", "8", "--levers", "accumulation", "--out", tmp_path / f"{batch}.yaml", "--json")
        assert r.exit_code == 0, r.output
        out = json.loads(r.stdout)
        assert (out["plan"]["grad_accum_steps"] > 1) is accumulates, out["plan"]
        assert any(said in n for n in out["notes"]) is (noted and accumulates), out["notes"]
