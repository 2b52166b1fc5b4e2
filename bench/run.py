"""`make bench`: oomtune against Lightning, Accelerate and exhaustive truth on the same model files, the same
simulated-memory `cpu` device and the same budgets; writes bench/results.json and bench/RESULTS.md.

    .venv/bin/python -m bench.run [--out bench/RESULTS.md] [--json bench/results.json] [--no-others]

Every figure in the written files comes from this run. The trainer-overhead and estimate sections come from the
`bench-train` / `bench-estimate` Makefile targets, run here when the Makefile has them (they write their own
sections between markers; this script keeps what they wrote and puts a TODO line where a target is missing).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from oomtune.model_file import load_model_file
from oomtune.search.ladder import extrapolate
from oomtune.units import parse_budget, utc_now

from . import report
from .ours import run_oomtune
from .peers import oom_recognised, run_accelerate, run_lightning
from .sections import OTHER_SECTIONS, has_make_target
from .truth import PeakTable, peak_table, plan_label, time_plans, verify_boundary

ROOT = Path(__file__).resolve().parent.parent
THREADS = 1  # see RESULTS.md: 2 shared cores; two intra-op threads under contention made a step up to 40x slower
HEADROOM = 0.0  # "fits" = runs without OOM in the budget, for every contender (justified in RESULTS.md)


@dataclass(frozen=True)
class Case:
    name: str
    path: str  # relative to the repository root
    batch: int  # target global batch B
    context: int  # T (= T_min: context is never cut here)
    budgets: tuple[str, ...]
    ladder: bool = True  # False: the fp32 batch search only (no amp / checkpointing rungs, no full-ladder tables)


# budgets chosen so that B does not fit at fp32 under any of them (the run checks and says so if it does)
CASES = (
    Case("tiny_gpt", "examples/tiny_gpt.py", 16, 128, ("9MiB", "16MiB", "30MiB")),
    Case("mlp_dict", "examples/mlp_dict.py", 20, 64, ("10MiB", "16MiB", "24MiB")),
    Case("parallel_gpt", "bench/models/parallel_gpt.py", 16, 64, ("10MiB", "20MiB", "28MiB")),
)
# Realistic batch sizes: target 256, budgets picked (from the fake device's fp32 peaks) so the true max lands near
# 30, 100 and 200. A short context keeps a real CPU step at batch 256 well under a second; the exhaustive truth
# costs about the same per fake trial at any batch size, so 256 sizes per model is a few minutes.
LARGE_CASES = (
    Case("mlp_dict", "examples/mlp_dict.py", 256, 16, ("14MiB", "33MiB", "60MiB"), ladder=False),
    Case("tiny_gpt", "examples/tiny_gpt.py", 256, 16, ("12MiB", "34MiB", "64MiB"), ladder=False),
)
GROUPS = {"cases": CASES, "large_cases": LARGE_CASES}  # results.json key -> its cases


def log(msg: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# -- one budget ----------------------------------------------------------------------------------------------

def _peer_row(r, truth: int, table: PeakTable, limit: int) -> dict:
    """A peer's result, and how many of its attempts ended differently from oomtune's step at that size."""
    differ = [i for i, (b, ok) in enumerate(r.attempts) if b <= table.batch and ok != table.fits("fp32", b, 1, limit)]
    return {"contender": r.contender, "trials": r.trials, "steps": r.steps, "seconds": round(r.seconds, 2),
            "found": r.found, "ratio": _ratio(r.found, truth), "attempts": [[b, ok] for b, ok in r.attempts],
            "attempts_differing_from_truth": len(differ),
            "differing": [{"batch": r.attempts[i][0], "ran": r.attempts[i][1], "oom_where": r.oom_where.get(i)}
                          for i in differ]}


def _ratio(found: int | None, truth: int | None) -> float | None:
    return round(found / truth, 3) if found is not None and truth else None


def first_line(probe, table: PeakTable, truth: int | None) -> dict | None:
    """The first line oomtune drew on its fp32 rung, read off its own trials (not re-derived): through micro-batch 1
    and its second point, the first size after 1 that fit (see `LadderSearch.largest_batch`: the geometric middle
    of what is still unknown, again if that runs out of memory). The forward/backward peaks oomtune measured at both
    (what its line is fitted to), their growth per sample, the size the line predicts (`extrapolate`, the search's
    own function, under the probe's limit), the size oomtune tried next and whether it ran, and the growth per
    sample where it matters (true max to the size above it, from the exhaustive table). None when oomtune never
    had two fitting sizes (an answer of 1, or a target that fit)."""
    runs = [t for t in probe.ladder.trials if t.point.rung.name == "fp32" and t.point.grad_accum_steps == 1
            and t.point.context_length == table.context]
    fit = [i for i, t in enumerate(runs) if t.fits and t.measurement.predictor_bytes is not None]
    if len(fit) < 2 or runs[fit[0]].point.micro_batch_size != 1 or truth is None:
        return None
    one, second = runs[fit[0]], runs[fit[1]]
    s = second.point.micro_batch_size
    p1, p2 = one.measurement.predictor_bytes, second.measurement.predictor_bytes
    after = runs[fit[1] + 1] if fit[1] + 1 < len(runs) else None
    at_max = table.batch_peaks.get(("fp32", truth + 1, 1)), table.batch_peaks.get(("fp32", truth, 1))
    return {"second_point": s,
            "tried_before": [t.point.micro_batch_size for t in runs[fit[0] + 1:fit[1]]],  # middles that ran out
            "batch_peak_1": p1, "batch_peak_second": p2, "per_sample": round((p2 - p1) / (s - 1)),
            "predicts": extrapolate(1, p1, s, p2, probe.limit_bytes),
            "next_tried": after.point.micro_batch_size if after else None,
            "next_ran": after.fits if after else None,
            "per_sample_at_true_max": at_max[0] - at_max[1] if None not in at_max else None}


def bench_budget(case: Case, mf, table: PeakTable, budget: str) -> dict:
    limit = int(parse_budget(budget) * (1 - HEADROOM))
    truth = table.true_max("fp32", limit)
    out = {"model": case.name, "budget": budget, "budget_bytes": limit, "batch": case.batch,
           "context": case.context, "true_max": {r.name: table.true_max(r.name, limit) for r in table.rungs}}
    out["target_fits_fp32"] = truth == case.batch
    out["truth_boundary_verified"] = verify_boundary(mf, table, "fp32", budget)

    log(f"{case.name} B={case.batch} {budget}: oomtune " + ("(fit, throughput)" if case.ladder else "(fp32 rung)"))
    only = None if case.ladder else ["fp32"]
    fit = run_oomtune(mf, case.batch, case.context, budget, "fit", HEADROOM, rungs=only)
    thr = run_oomtune(mf, case.batch, case.context, budget, "throughput", HEADROOM) if case.ladder else None
    fp32 = fit.rung("fp32")
    out["first_line"] = first_line(fit.probe, table, truth)
    rows = [{"contender": "oomtune", "trials": fp32.trials, "steps": fit.steps_per_rung["fp32"],
             "seconds": round(fit.rung_seconds("fp32"), 2), "found": fp32.micro_batch_size,
             "ratio": _ratio(fp32.micro_batch_size, truth),
             "attempts": [[t.micro_batch_size, t.result == "fits"] for t in fit.probe.records
                          if t.rung == "fp32" and t.grad_accum_steps == 1],
             "stages": [t.stage for t in fit.probe.records if t.rung == "fp32" and t.grad_accum_steps == 1]}]
    log(f"{case.name} B={case.batch} {budget}: accelerate")
    rows.append(_peer_row(run_accelerate(mf, case.batch, case.context, budget), truth, table, limit))
    for mode in ("power", "binsearch"):
        log(f"{case.name} B={case.batch} {budget}: lightning {mode}")
        rows.append(_peer_row(run_lightning(mf, case.context, budget, mode), truth, table, limit))
    rows.append({"contender": "exhaustive", "trials": case.batch, "steps": table.search_steps["fp32"],
                 "seconds": round(table.search_seconds("fp32"), 2), "found": truth, "ratio": 1.0})
    log(f"{case.name} B={case.batch} {budget}: oomtune from the estimate (prior)")
    truth_plans = {r.name: table.largest_plan(r.name, limit) for r in table.rungs}
    out["prior"] = prior_runs(mf, case, budget, fit, only, truth_plans)
    row = out["prior"]["fp32"]
    # a rung certified by its plan found the plan's micro-batch: measured against the largest plan that fits
    accum = out["prior"]["with"]["certified_plans"].get("fp32", 1)
    row_truth = truth_plans["fp32"] if accum > 1 else truth
    rows.insert(1, {"contender": "oomtune-prior", **row, "accum": accum, "truth": row_truth,
                    "ratio": _ratio(row["found"], row_truth),
                    "seconds": round(row["seconds_rung"] + (row["prior"] or {}).get("fake_seconds", 0), 2)})
    out["batch_search"] = rows

    # cpu (oomtune's trials) against fake (the table): every fitting trial's peak, to the byte
    same = total = 0
    for probe_run in (fit, thr) if thr else (fit,):
        for t in probe_run.probe.records:
            key = (t.rung, t.micro_batch_size, t.grad_accum_steps)
            if t.result == "fits" and key in table.peaks:
                total += 1
                same += table.peaks[key] == t.peak_bytes
    out["cpu_fake_agree"] = [same, total]
    if not case.ladder:
        return out

    best_fit = table.best_fit_plan(limit)
    out["ladder_fit"] = {"oomtune": _plan_json(fit.probe.config.plan if fit.probe.config else None),
                         "trials": len(fit.probe.records), "steps": fit.steps, "seconds": round(fit.seconds, 2),
                         "exhaustive": _plan_json(best_fit)}
    out["ladder_throughput"] = {"oomtune": _plan_json(thr.probe.config.plan if thr.probe.config else None),
                                "trials": len(thr.probe.records), "steps": thr.steps,
                                "seconds": round(thr.seconds, 2),
                                "candidates": [_plan_json(p) for _, p in table.fitting_plans(limit)]}
    return out


# what the cpu device counts on top of its tensors, unseen by the prior's estimate: a fixed part and a proportion
HIDDEN = ((512 << 10, 0.05), (2 << 20, 0.10))


def same_answers(with_prior, without, truth_plans: dict | None) -> dict:
    """Did the probe from the estimate find what the search alone did? Per rung: one certified alone, the search's
    largest micro-batch; one certified by its plan (it will accumulate), the largest plan micro-batch that fits on
    that rung, from the exhaustive table (`truth_plans`), or where there is none (memory the table cannot see), the
    search's own plan where it chose that rung (else unchecked). And the same plan."""
    w, o = with_prior.probe, without.probe
    alone = {r.rung.name: r.micro_batch_size for r in o.ladder.rungs}
    chose = o.ladder.choice
    differ, unchecked = [], []
    for r in w.ladder.rungs:
        name = r.rung.name
        if r.grad_accum_steps == 1:
            want = alone.get(name)
        elif truth_plans is not None and name in truth_plans:
            want = truth_plans[name]
        elif chose is not None and chose.rung.name == name:
            want = chose.micro_batch_size
        else:
            unchecked.append(name)
            continue
        if want != r.micro_batch_size:
            differ.append(name)
    plan = (w.config.plan if w.config else None) == (o.config.plan if o.config else None)
    return {"same": plan and not differ, "plan_same": plan, "rungs_differing": differ, "rungs_unchecked": unchecked}


def _probe_summary(run, rung: str | None = None) -> dict:
    """Device trials (all, and per searched rung), answers per rung, seconds (the prior's estimate included), and
    what the prior cost and did; `rung`: that rung's row (trials, steps, seconds, found) for the batch tables."""
    p = run.probe
    rungs = {r.rung.name: r.micro_batch_size for r in p.ladder.rungs}
    accum = {r.rung.name: r.grad_accum_steps for r in p.ladder.rungs if r.grad_accum_steps > 1}
    out = {"device_trials": len(p.records), "rungs_searched": len(p.ladder.rungs),
           "trials_per_rung": round(len(p.records) / max(len(p.ladder.rungs), 1), 2), "answers": rungs,
           "certified_plans": accum,
           "seconds": round(run.seconds, 2), "plan": _plan_json(p.config.plan if p.config else None),
           "prior": p.prior.to_json() if p.prior is not None else None}
    if rung is not None:
        r = run.rung(rung)
        out |= {"trials": r.trials, "steps": run.steps_per_rung[rung], "found": r.micro_batch_size,
                "attempts": [[t.micro_batch_size, t.result == "fits"] for t in p.records
                             if t.rung == rung and t.grad_accum_steps == 1],
                "stages": [t.stage for t in p.records if t.rung == rung and t.grad_accum_steps == 1]}
    return out


def prior_runs(mf, case: Case, budget: str, no_prior, only, truth_plans: dict) -> dict:
    """oomtune with the prior next to without it (`no_prior`, already run); on the realistic cases, both again on a
    cpu device with memory the estimate cannot see (HIDDEN). `truth_plans`: each rung's largest plan micro-batch
    from the exhaustive table (same_answers)."""
    from oomtune.memory.margin import Margin

    with_prior = run_oomtune(mf, case.batch, case.context, budget, "fit", HEADROOM, rungs=only, prior=True)
    out = {"fp32": _probe_summary(with_prior, "fp32") | {"seconds_rung": round(with_prior.rung_seconds("fp32"), 2)},
           "with": _probe_summary(with_prior) | {"same": same_answers(with_prior, no_prior, truth_plans)},
           "without": _probe_summary(no_prior), "hidden": []}
    if case.ladder:
        return out
    for fixed, pct in HIDDEN:
        hidden = Margin(fixed, pct)
        runs = [run_oomtune(mf, case.batch, case.context, budget, "fit", HEADROOM, rungs=only, prior=p,
                            hidden=hidden) for p in (False, True)]
        out["hidden"].append({"hidden": hidden.describe(), "without": _probe_summary(runs[0]),
                              "with": _probe_summary(runs[1]) | {"same": same_answers(runs[1], runs[0], None)}})
    return out


def _plan_json(plan) -> dict | None:
    if plan is None:
        return None
    return {"label": plan_label(plan), "micro_batch_size": plan.micro_batch_size,
            "grad_accum_steps": plan.grad_accum_steps, "precision": plan.precision,
            "activation_checkpointing": plan.activation_checkpointing, "context_length": plan.context_length}


def _plan_from_json(d: dict):
    from oomtune.config.schema import Plan

    return Plan(d["micro_batch_size"], d["context_length"], d["precision"], d["activation_checkpointing"],
                d["grad_accum_steps"])


def bench_case(case: Case) -> dict:
    mf = load_model_file(ROOT / case.path)
    log(f"{case.name}: exhaustive peak table on the fake device (B={case.batch}, T={case.context}"
        + ("" if case.ladder else ", fp32 only") + ")")
    table = peak_table(mf, case.batch, case.context, only=None if case.ladder else ["fp32"])
    log(f"{case.name}: {table.trials} trials in {table.seconds:.0f}s on {table.device_kind}")
    budgets = [bench_budget(case, mf, table, b) for b in case.budgets]
    out = {"model": case.name, "path": case.path, "batch": case.batch, "context": case.context,
           "ladder": case.ladder, "truth_device": table.device_kind, "truth_rungs": [r.name for r in table.rungs],
           "truth_trials": table.trials, "truth_seconds": round(table.seconds, 1), "budgets": budgets}
    if not case.ladder:
        return out

    # throughput: every plan that fits some budget (and oomtune's picks), timed once with real compute
    plans = {}
    for b in budgets:
        for p in b["ladder_throughput"]["candidates"] + [b["ladder_throughput"]["oomtune"]]:
            if p is not None:
                plans[p["label"]] = _plan_from_json(p)
    log(f"{case.name}: timing {len(plans)} plans on the cpu device")
    start = time.perf_counter()
    speed = time_plans(mf, plans.values())
    timing_seconds = time.perf_counter() - start
    tps = {plan_label(p): round(v, 1) for p, v in speed.items()}
    for b in budgets:
        lt = b["ladder_throughput"]
        cands = [p["label"] for p in lt["candidates"]]
        lt["tokens_per_s"] = {label: tps[label] for label in cands}
        lt["exhaustive"] = max(cands, key=lambda label: tps[label]) if cands else None
        pick = lt["oomtune"]["label"] if lt["oomtune"] else None
        lt["oomtune_tokens_per_s"] = tps.get(pick)
        lt["oomtune_pick_fits_per_truth"] = pick in cands
        lt["ratio"] = _ratio_f(tps.get(pick), tps.get(lt["exhaustive"]))
    return {**out, "amp_precision": table.rungs[1].precision, "timing_seconds": round(timing_seconds, 1),
            "timed_plans": len(plans)}


def _ratio_f(a: float | None, b: float | None) -> float | None:
    return round(a / b, 3) if a and b else None


# -- the machine and the other engineers' sections ------------------------------------------------------------

def machine() -> dict:
    cpu = platform.processor() or platform.machine()
    ram = None
    try:
        text = Path("/proc/cpuinfo").read_text()
        m = re.search(r"^model name\s*:\s*(.+)$", text, re.M)
        cpu = m.group(1).strip() if m else cpu
        m = re.search(r"^MemTotal:\s*(\d+) kB", Path("/proc/meminfo").read_text(), re.M)
        ram = int(m.group(1)) * 1024 if m else None
    except OSError:
        pass
    versions = {"python": platform.python_version(), "torch": torch.__version__}
    for name in ("lightning", "accelerate"):
        try:
            versions[name] = __import__(name).__version__
        except ImportError:
            versions[name] = None
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    # the files this run writes do not make the code it measured any different
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no", "--", ".",
                            ":(exclude)bench/RESULTS.md", ":(exclude)bench/results.json"],
                           cwd=ROOT, capture_output=True, text=True)
    return {"cores": os.cpu_count(), "ram_bytes": ram, "cpu": cpu, "os": platform.platform(),
            "torch_threads": torch.get_num_threads(), "versions": versions,
            "git_commit": commit.stdout.strip() or None, "git_dirty": bool(dirty.stdout.strip()),
            "load_average_start": list(os.getloadavg())}


def run_other_sections(out: Path) -> dict[str, str]:
    """Run `make bench-train` / `make bench-estimate` where they exist; return each one's section as it wrote
    it into `out` (between its markers), or a TODO/failure line. Never a number of ours."""
    sections = {}
    ran: dict[str, tuple] = {}  # target -> (its process, seconds): a target that writes two sections runs once
    for name, target, _ in OTHER_SECTIONS:
        if not has_make_target(target):
            sections[name] = (f"TODO: this section is missing: the Makefile has no `{target}` target yet, so this "
                              "run did not measure it.")
            continue
        if target not in ran:
            log(f"running make {target}")
            start = time.perf_counter()
            ran[target] = (subprocess.run(["make", "--no-print-directory", target], cwd=ROOT, capture_output=True,
                                          text=True), time.perf_counter() - start)
        proc, took = ran[target]
        body = report.read_section(out.read_text(), name) if out.exists() else None
        if proc.returncode != 0:
            tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["(no output)"]
            sections[name] = (f"TODO: `make {target}` failed in this run (exit {proc.returncode} after {took:.0f} s: "
                              f"{tail[0][:200]}); no figures from it are shown.")
        elif not body or report.PLACEHOLDER in body:
            sections[name] = f"TODO: `make {target}` ran ({took:.0f} s) but wrote nothing between its markers."
        else:
            sections[name] = body
    return sections


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "RESULTS.md")
    ap.add_argument("--json", type=Path, default=ROOT / "bench" / "results.json")
    ap.add_argument("--no-others", action="store_true", help="skip the bench-train / bench-estimate targets")
    ap.add_argument("--command", default="make bench", help="the command recorded in RESULTS.md")
    ap.add_argument("--only", choices=sorted(GROUPS), help="run one group of cases (for development: the file "
                    "written then lacks the other group's tables)")
    args = ap.parse_args(argv)

    torch.set_num_threads(THREADS)
    started = time.perf_counter()
    date = utc_now()
    info = machine()
    recognised = oom_recognised()
    if not all(recognised.get(k) for k in ("lightning", "accelerate")):
        raise SystemExit(f"a peer is missing or does not recognise the simulated OOM: {recognised} "
                         "(install the bench extra: pip install -e '.[bench]')")

    # their sections first, into a fresh skeleton (so no stale figure survives), then ours
    args.out.write_text(report.skeleton())
    others = {name: "TODO: skipped (--no-others)." for name, _, _ in OTHER_SECTIONS} if args.no_others \
        else run_other_sections(args.out)

    groups = {key: [bench_case(c) for c in cases] if args.only in (None, key) else []
              for key, cases in GROUPS.items()}
    info["load_average_end"] = list(os.getloadavg())
    data = {"command": args.command, "argv": [sys.executable, "-m", "bench.run", *(argv or sys.argv[1:])],
            "date": date, "machine": info, "oom_recognised": recognised, "headroom": HEADROOM,
            **groups, "wall_seconds": round(time.perf_counter() - started, 1)}
    args.json.write_text(json.dumps(data, indent=1) + "\n")
    args.out.write_text(report.render(data, others))
    log(f"wrote {args.out} and {args.json} in {data['wall_seconds']:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
