"""The probe's tables of `make gpu-check` (scripts/gpu_check.py): the probe on the real GPU, from the estimate and with
`--no-prior`, next to the fake device's plan for the same targets. First the example models (tiny: a device trial
costs milliseconds there, less than a fake trial), last a realistic one, GPT-2 small at context 1024 (a device trial
costs real compute there: whether the prior pays in wall time on a GPU, issue 16's question, is read off its row).
Each takes a maker of the device to measure on, so a test can dry-run it on the CPU."""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from pathlib import Path

from gpu_tables import EXAMPLES, ROOT, Report, TimeBox, card_of, check_time, fake_device, md_table


@dataclass(frozen=True)
class ProbeCase:
    name: str
    path: Path
    batch: int  # the target global batch; the context is the model file's DEFAULTS context
    budget: str


EXAMPLE_CASES = tuple(ProbeCase(name, ROOT / "examples" / f"{name}.py", 4096, "4GiB") for name in EXAMPLES)
# 124M parameters, context 1024: fp32 fits ~8 of 32 in 16 GiB (fake, h200 rules), so the ladder climbs all three
# rungs and accumulates; ~2-3 s a fake trial on a 2-core host, about 60-90 s for its row
GPT2_SMALL = ProbeCase("gpt2_small", ROOT / "bench" / "models" / "gpt2_small.py", 32, "16GiB")
GPT2_NEEDS_S = 150  # run its row only with this much of the time box left
# a 1.1B LoRA model at context 1024 (issue 40: the prior's wall time against the search's for a LoRA fine-tune): its
# fake trials are made from fewer of its 22 layers; after GPT-2's row, where the time box leaves it this much
LLAMA_1B_LORA = ProbeCase("llama_1b_lora", ROOT / "bench" / "models" / "llama_1b_lora.py", 16, "16GiB")
LORA_NEEDS_S = 180

HEADER = ["model", "budget", "target", "real plan", "real peak", "device trials (per rung)", "wall s (estimate incl.)",
          "the prior's fake trials / s", "trials, --no-prior", "wall s, --no-prior", "a device trial, s (mean, "
          "--no-prior)", "same plan as --no-prior", "fake plan", "fake trials / wall", "same plan"]


def probe_table(rep: Report, deadline: float, context: int | None, make_real=None, cases=EXAMPLE_CASES,
                title: str = "the probe on the real GPU", key: str = "probe") -> None:
    """Each case probed on the real GPU (`make_real(budget)` -> the device; a test dry-runs it on another) from the
    estimate and with --no-prior, next to the fake device's plan for the same targets; rows in rep.data[key]."""
    from oomtune.units import format_bytes as fb

    rep.say(f"## {title} (headroom 10%)")
    rep.say("the fake device gets each budget plus this process's CUDA context "
            f"({fb(context) if context is not None else 'unknown without NVML: not added'})")
    rows, data = [], []
    for case in cases:
        try:
            row, datum = _probe_row(case, deadline, context, make_real)
        except TimeBox:
            rep.problem(f"time box hit in the probe table ({case.name})")
            rows.append([case.name, "time box"] + [""] * (len(HEADER) - 2))
            data.append({"model": case.name, "error": "time box"})
            break
        except Exception as e:  # noqa: BLE001
            rep.problem(f"probe {case.name}: {type(e).__name__}")
            rows.append([case.name, f"error: {type(e).__name__}: {str(e)[:80]}"] + [""] * (len(HEADER) - 2))
            data.append({"model": case.name, "error": f"{type(e).__name__}: {e}"})
            continue
        rows.append(row)
        data.append(datum)
    rep.say(md_table(HEADER, rows))
    rep.data[key] = data


def realistic_table(rep: Report, deadline: float, context: int | None, make_real=None, case: ProbeCase = GPT2_SMALL,
                    needs_s: float = GPT2_NEEDS_S, key: str = "probe_realistic") -> None:
    """The probe table's row for a realistic model, where the time box leaves it `needs_s`; otherwise it says so (a
    check that did not run: a problem, not a pass). Its row in rep.data[key]."""
    title = f"the probe on a realistic model: {case.name}"
    left = deadline - time.monotonic()
    if left < needs_s:
        rep.say(f"## {title}\nNOT RUN: {left:.0f} s of the time box left, it needs about {needs_s:.0f} s")
        rep.data[key] = [{"model": case.name, "error": f"not run: {left:.0f} s left"}]
        rep.problem(f"probe {case.name} not run (time)")
        return
    probe_table(rep, deadline, context, make_real, (case,), title, key)


def _timed(run):
    start = time.perf_counter()
    result = run()
    return result, time.perf_counter() - start


def _probe_row(case: ProbeCase, deadline: float, context: int | None, make_real) -> tuple[list, dict]:
    from oomtune.memory.devices import make_device
    from oomtune.model_file import load_model_file
    from oomtune.search.options import Targets
    from oomtune.search.probe import probe
    from oomtune.units import format_bytes as fb
    from oomtune.units import parse_budget

    # on cuda the budget caps the caching allocator (the context is outside it); the fake device's budget is a
    # whole card whose margin includes the context: give it the context on top, so both mean the same memory
    make_real = make_real or (lambda b: make_device("cuda", b))
    fake_budget = f"{parse_budget(case.budget) + (context or 0)}B"
    card = card_of(make_real(case.budget))  # its rules, with the context this process measured (0 where unknown)
    card = dataclasses.replace(card, context_bytes=context or 0) if card is not None else None
    mf = load_model_file(case.path)
    t = mf.defaults.get("context", 512)
    targets = Targets(case.batch, t, t)
    check_time(deadline)
    real, real_s = _timed(lambda: probe(mf, make_real(case.budget), targets))  # from the estimate (fake trials incl.)
    check_time(deadline)
    plain, plain_s = _timed(lambda: probe(mf, make_real(case.budget), targets, prior=False))
    fake, fake_missing = fake_device(fake_budget, card)
    est, est_s = None, None
    if fake is not None:
        check_time(deadline)
        est, est_s = _timed(lambda: probe(mf, fake, targets, command="estimate"))
    plan = real.config.plan.describe() if real.config else "nothing fits"
    per_rung = ", ".join(f"{k} {v}" for k, v in real.trials_per_rung.items())
    fake_plan, same = fake_missing, "n/a"
    if est is not None:
        fake_plan = est.config.plan.describe() if est.config else "nothing fits"
        same = "yes" if (est.config and real.config and est.config.plan == real.config.plan) else "no"
    prior = real.prior.to_json() if real.prior is not None else {}
    same_plain = "yes" if (plain.config and real.config and plain.config.plan == real.config.plan) else "no"
    device_s = [r.seconds for r in plain.records]
    trial_s = sum(device_s) / len(device_s) if device_s else None
    fell = f", fell back: {prior['fell_back_rungs']}" if prior.get("fell_back_rungs") else ""
    row = [case.name, case.budget, f"{case.batch}x{t}", plan, fb(real.config.found_by.peak_bytes) if real.config
           else "-", f"{len(real.records)} ({per_rung})", f"{real_s:.1f}",
           f"{prior.get('fake_trials')} + {prior.get('replayed_trials')} replayed / {prior.get('fake_seconds')} s"
           + fell, f"{len(plain.records)}", f"{plain_s:.1f}", f"{trial_s:.2f}" if trial_s is not None else "-",
           same_plain, fake_plan, f"{len(est.records)} / {est_s:.1f} s" if est is not None else "n/a", same]
    datum = {"model": case.name, "batch": case.batch, "context": t, "budget": case.budget,
             "plan": real.config.plan.describe() if real.config else None,
             "peak_bytes": real.config.found_by.peak_bytes if real.config else None,
             "trials": len(real.records), "trials_per_rung": real.trials_per_rung,
             "wall_seconds": round(real_s, 2), "prior": prior,
             "no_prior_trials": len(plain.records), "no_prior_trials_per_rung": plain.trials_per_rung,
             "no_prior_wall_seconds": round(plain_s, 2), "no_prior_same_plan": same_plain,
             "no_prior_device_trial_seconds": round(trial_s, 3) if trial_s is not None else None,
             "fake_plan": est.config.plan.describe() if est is not None and est.config else None,
             "fake_trials": len(est.records) if est is not None else None,
             "fake_wall_seconds": round(est_s, 2) if est_s is not None else None, "fake_missing": fake_missing,
             "same_plan": same}
    return row, datum
