"""Render bench/results.json as bench/RESULTS.md: tables and figures only, each with a caption that says what it is
and how it was measured. Every number comes from the data passed in. What the numbers show is written by a person
in docs/benchmarks.md."""

from __future__ import annotations

from statistics import mean

from oomtune.units import format_bytes

from .report_format import (  # noqa: F401 - read_section, skeleton: run.py's
    PLACEHOLDER,
    SMALL,
    _attempts,
    _cases,
    _ratio,
    _row,
    _section,
    _table,
    _whole,
    read_section,
    skeleton,
)
from .report_prior import prior_section
from .sections import OTHER_SECTIONS

CONTENDERS = ("oomtune", "oomtune-prior", "accelerate", "lightning-power", "lightning-binsearch", "exhaustive")
PEERS = ("accelerate", "lightning-power", "lightning-binsearch")
NAMES = {
    "oomtune": "oomtune (fp32 rung)",
    "oomtune-prior": "oomtune from the estimate (fp32 rung; the estimate's seconds included) ²",
    "accelerate": "Accelerate `find_executable_batch_size`",
    "lightning-power": "Lightning `scale_batch_size` power",
    "lightning-binsearch": "Lightning `scale_batch_size` binsearch",
    "exhaustive": "exhaustive (fake device)",
}
HEADLINE_BEGIN, HEADLINE_END = "<!-- headline:begin -->", "<!-- headline:end -->"
LARGE = "large_cases"  # results.json key of the realistic batch sizes (SMALL: the small-batch cases, full ladder)
FLOOR = 5  # oomtune's fp32 trials at the least: target, micro-batch 1, second point, prediction, the size above


def _third_check(b: dict) -> dict:
    ours, bins = _row(b, "oomtune"), _row(b, "lightning-binsearch")
    exact = ours["found"] == b["true_max"]["fp32"]
    met = exact and 3 * ours["trials"] <= bins["trials"]
    return {"ours": ours["trials"], "bins": bins["trials"], "exact": exact, "met": met}


def _present(b: dict) -> list[str]:
    """The contenders this case ran (results from before a contender was added lack its rows)."""
    ran = {r["contender"] for r in b["batch_search"]}
    return [c for c in CONTENDERS if c in ran]


def _found(r: dict, truth: int, long: bool = True) -> str:
    """What a contender found against the true max; a plan certified with accumulation (the probe from the estimate,
    where the rung accumulates: its micro-batch x accumulation) against the largest plan that fits."""
    truth = r.get("truth", truth)
    found = f"{r['found']} x{r['accum']} (plan)" if r.get("accum", 1) > 1 else f"{r['found']}"
    if r["found"] == truth:
        return found
    side = "below" if (r["found"] or 0) < truth else "above"
    what = " the largest plan" if r.get("accum", 1) > 1 else " the true max"
    return f"{found} (**{side}**{what if long else ''})"


# -- batch-size search ----------------------------------------------------------------------------------------

def headline(data: dict, group: str = SMALL) -> str:
    n = sum(1 for _ in _cases(data, group))
    rows = []
    for c in (c for c in CONTENDERS if all(c in _present(b) for _, b in _cases(data, group))):
        pairs = [(_row(b, c).get("truth", b["true_max"]["fp32"]), _row(b, c)) for _, b in _cases(data, group)]
        rs = [r for _, r in pairs]
        exact = sum(1 for truth, r in pairs if r["found"] == truth)
        ratios = [r["ratio"] for r in rs if r["ratio"] is not None]
        paid = rs
        if c == "exhaustive":  # one table per model serves all its budgets: count its cost once per model
            paid = [_row(case["budgets"][0], c) for case in data[group]]
        rows.append([NAMES[c] + (" ¹" if c == "exhaustive" else ""), f"{exact}/{n}",
                     _ratio(mean(ratios)) if ratios else "-", f"{mean(r['trials'] for r in rs):.1f}",
                     sum(r["trials"] for r in paid), sum(r["steps"] for r in paid),
                     f"{sum(r['seconds'] for r in paid):.1f}"])
    checks = [_third_check(b) for _, b in _cases(data, group)]
    text = _table(["contender", "found = true max", "mean found / true", "trials per case", "trials (total)",
                   "steps (total)", "seconds (total)"], rows)
    text += ("\n¹ its totals count each model's table once (it serves all of that model's budgets); its trials are "
             "fake-device runs of the fp32 rung at every micro-batch 1..B.\n")
    text += ("² where the rung will accumulate, it certifies the plan (micro-batch d x B/d fits, the next divisor's "
             "plan does not), not the largest micro-batch alone: its answer is counted against the largest plan that "
             "fits (from the exhaustive table's accumulation plans).\n")
    text += (f"\nCases where oomtune found the true maximum in at most 1/3 of Lightning binsearch's trials: "
             f"**{sum(1 for c in checks if c['met'])} of {n}**; cases where it found the true maximum: "
             f"{sum(1 for c in checks if c['exact'])} of {n}.\n")
    return text


def _verdict(b: dict) -> str:
    """The 1/3 target for one case, with the numbers that decide it."""
    c = _third_check(b)
    third = f"{c['bins']} / 3 = {c['bins'] / 3:.1f}"
    if not c["exact"]:
        return f"**not met**: found {_row(b, 'oomtune')['found']}, not the true max"
    return f"**met**: {c['ours']} <= {third}" if c["met"] else f"**not met**: {c['ours']} > {third}"


def per_case(data: dict, group: str = SMALL) -> str:
    """Every contender in every case; the realistic cases add the 1/3-of-binsearch verdict on oomtune's row."""
    large = group == LARGE
    rows = []
    for case, b in _cases(data, group):
        truth = b["true_max"]["fp32"]
        for c in _present(b):
            r = _row(b, c)
            verdict = [_verdict(b) if c == "oomtune" else ""] if large else []
            rows.append([case["model"], b["budget"], truth, NAMES[c], r["trials"], r["steps"], f"{r['seconds']:.1f}",
                         _found(r, truth, long=not large), _ratio(r["ratio"]), *verdict,
                         _attempts(r.get("attempts"))])
    verdict = ["oomtune: true max in <= 1/3 of binsearch's trials?"] if large else []
    return _table(["model", "budget", "true max", "contender", "trials", "steps", "seconds", "found", "found / true",
                   *verdict, "sizes tried in order (✓ ran, ✗ OOM)"], rows)


def below_truth(data: dict, group: str = SMALL) -> str:
    """Every answer under the true maximum, with the facts the run recorded about it."""
    rows = []
    for case, b in _cases(data, group):
        for c in _present(b)[:-1]:  # the exhaustive answer is the truth
            r = _row(b, c)
            truth = r.get("truth", b["true_max"]["fp32"])  # (a plan certified with accumulation: the largest plan)
            if r["found"] is None or r["found"] >= truth:
                continue
            above = [(a, ok) for a, ok in r["attempts"] if a > r["found"]]
            nxt = min(above) if above else None
            own = dict.fromkeys(f"{d['batch']} ({d['oom_where'] or 'unknown'})" for d in r.get("differing", [])
                                if not d["ran"])
            ran = r["found"] in {a for a, ok in r["attempts"] if ok}
            rows.append([case["model"], b["budget"], NAMES[c], r["found"], truth,
                         _attempts([nxt]) if nxt else "-", "yes" if ran else "**no**", ", ".join(own) or "-"])
    if not rows:
        return "Every contender returned the true maximum in every case.\n"
    return ("Answers below the true maximum: the smallest larger size the contender tried (✓ ran, ✗ OOM), whether it "
            "ran the size it returned, and the sizes at which its own loop ran out of memory although oomtune's "
            "training step fits there (the phase of the step the OOM struck in, as the tracker recorded it).\n\n"
            + _table(["model", "budget", "contender", "found", "true max", "next larger size tried",
                      "ran what it returned", "its OOMs where oomtune's step fits (where)"], rows))


def third_table(data: dict, group: str = SMALL) -> str:
    rows = []
    for case, b in _cases(data, group):
        c = _third_check(b)
        rows.append([case["model"], b["budget"], b["true_max"]["fp32"], c["ours"], c["bins"],
                     f"{c['ours'] / c['bins']:.2f}", "yes" if c["exact"] else "**no**",
                     "yes" if c["met"] else "**no**"])
    return _table(["model", "budget", "true max", "oomtune trials", "binsearch trials", "oomtune / binsearch",
                   "oomtune exact", "<= 1/3 met"], rows)


def large_intro(data: dict) -> str:
    cases = data[LARGE]
    truths = [b["true_max"]["fp32"] for _, b in _cases(data, LARGE)]
    trials = " and ".join(str(c["truth_trials"]) for c in cases)
    seconds = " and ".join(f"{c['truth_seconds']:.0f}" for c in cases)
    return (f"Cases: {_case_list(cases)}; true maxima {min(truths)}-{max(truths)}. Same device, same budgets for "
            f"every contender, headroom {data['headroom']:g}, 2 steps per trial. Only the fp32 batch search is "
            "compared: oomtune's probe climbs only its fp32 rung. The exhaustive truth is every micro-batch 1..B at "
            f"fp32 on the fake device, and every plan d x B/d with accumulation, {trials} trials ({seconds} s), paid "
            "once per model.\n")


def first_line(data: dict, group: str = LARGE) -> str:
    """oomtune's first line on its fp32 rung, as the run recorded it (bench/run.py `first_line`), one row a case."""
    rows = []
    for case, b in _cases(data, group):
        ln, c = b.get("first_line"), _third_check(b)
        if not ln or not ln["per_sample_at_true_max"]:
            continue
        before = " ".join(f"{a}✗" for a in ln["tried_before"])
        nxt = "-" if ln["next_tried"] is None else f"{ln['next_tried']}{'✓' if ln['next_ran'] else '✗'}"
        rows.append([case["model"], b["budget"], b["true_max"]["fp32"],
                     (before + " " if before else "") + f"{ln['second_point']}✓", format_bytes(ln["per_sample"]),
                     format_bytes(ln["per_sample_at_true_max"]),
                     "none (flat)" if ln["predicts"] is None else ln["predicts"], nxt, c["ours"], c["ours"] - FLOOR])
    if not rows:
        return ""
    return ("oomtune's first line on its fp32 rung, read off its own trials: the second point after micro-batch 1 "
            "(sizes that ran out of memory before it), the growth of the forward/backward peak per sample between "
            "micro-batch 1 and the second point, the growth per sample from the true max to the size above it (from "
            "the exhaustive table), the size the line predicts under the limit, the size oomtune tried next, and its "
            f"trials on the rung, also counted above {FLOOR} (the target, micro-batch 1, the second point, the "
            "prediction and the size above it).\n\n"
            + _table(["model", "budget", "true max", "second point (✗ ran out of memory first)",
                      "peak growth per sample, 1 to second point", "at the true max", "line predicts",
                      "oomtune tried next", "oomtune trials", f"above {FLOOR}"], rows))


# -- the full ladder ------------------------------------------------------------------------------------------

def ladder_fit(data: dict) -> str:
    rows, same = [], 0
    for case, b in _cases(data):
        lf = b["ladder_fit"]
        o, e = lf["oomtune"], lf["exhaustive"]
        ok = (o or {}).get("label") == (e or {}).get("label")
        same += ok
        rows.append([case["model"], b["budget"], f"{b['true_max']['fp32']} / {b['true_max'].get('amp')} / "
                     f"{b['true_max'].get('checkpointing')}", o["label"] if o else "nothing fits", lf["trials"],
                     lf["steps"], f"{lf['seconds']:.1f}", e["label"] if e else "nothing fits",
                     case["truth_trials"], "yes" if ok else "**no**"])
    return (_table(["model", "budget", "true max fp32 / amp / ckpt", "oomtune plan", "trials", "steps", "seconds",
                    "exhaustive best plan", "exhaustive trials (per model)", "same"], rows)
            + f"\noomtune's plan equals the exhaustive best in **{same} of {len(rows)}** cases.\n")


def ladder_throughput(data: dict) -> str:
    rows, ratios = [], []
    for case, b in _cases(data):
        lt = b["ladder_throughput"]
        pick = lt["oomtune"]["label"] if lt["oomtune"] else None
        if lt["ratio"] is not None:
            ratios.append(lt["ratio"])
        fastest = lt["tokens_per_s"].get(lt["exhaustive"]) if lt["exhaustive"] else None
        rows.append([case["model"], b["budget"], pick or "nothing fits", _whole(lt["oomtune_tokens_per_s"]),
                     lt["exhaustive"] or "-", _whole(fastest),
                     _ratio(lt["ratio"]), lt["trials"], lt["steps"], f"{lt['seconds']:.1f}"])
    text = _table(["model", "budget", "oomtune pick", "tokens/s", "fastest fitting plan", "tokens/s",
                   "pick / fastest", "trials", "steps", "seconds"], rows)
    exact = sum(1 for r in rows if r[2] == r[4])
    text += (f"\noomtune picked the fastest fitting plan in **{exact} of {len(rows)}** cases"
             + (f" (pick / fastest: mean {mean(ratios):.2f}, worst {min(ratios):.2f})" if ratios else "") + ".\n")
    return text


def throughput_detail(data: dict) -> str:
    parts = []
    for case in data["cases"]:
        speeds = {}
        for b in case["budgets"]:
            lt = b["ladder_throughput"]
            speeds.update(lt["tokens_per_s"])
            if lt["oomtune"] and lt["oomtune_tokens_per_s"]:
                speeds[lt["oomtune"]["label"]] = lt["oomtune_tokens_per_s"]
        row = ", ".join(f"{k} {v:.0f}" for k, v in sorted(speeds.items(), key=lambda kv: -kv[1]))
        parts.append(f"- {case['model']} ({case['timed_plans']} plans, {case['timing_seconds']:.0f} s): {row}")
    return "\n".join(parts) + "\n"


# -- cross-checks and set-up ----------------------------------------------------------------------------------

def cross_checks(data: dict) -> str:
    both = (SMALL, LARGE)  # every case of this run, small-batch and realistic
    same = sum(b["cpu_fake_agree"][0] for _, b in _cases(data, *both))
    total = sum(b["cpu_fake_agree"][1] for _, b in _cases(data, *both))
    verified = [b["truth_boundary_verified"] for _, b in _cases(data, *both)]
    target_fits = [f"{c['model']} B={c['batch']} {b['budget']}" for c, b in _cases(data, *both)
                   if b["target_fits_fp32"]]
    differing = {c: sum(_row(b, c).get("attempts_differing_from_truth", 0) for _, b in _cases(data, *both))
                 for c in PEERS}
    attempts = {c: sum(_row(b, c)["trials"] for _, b in _cases(data, *both)) for c in differing}
    lines = [
        f"- cpu vs fake: of the fitting trials oomtune ran on the cpu device at a plan the exhaustive table also "
        f"measured on the fake device, **{same} of {total}** had the same peak to the byte.",
        f"- The exhaustive answer re-checked with the budget set on the truth device (true max runs, true max + 1 "
        f"raises the OOM): **{sum(1 for v in verified if v)} of {len(verified)}** cases.",
        "- The target batch fits at fp32 in: " + (", ".join(target_fits) if target_fits else "no case") + ".",
        "- The peers' own OOM checks accept the simulated error: "
        + ", ".join(f"{k} {'yes' if v else '**no**'}" for k, v in data["oom_recognised"].items()) + ".",
        "- Peer attempts whose outcome (ran / OOM) differs from oomtune's training step at the same batch size: "
        + ", ".join(f"{c} {differing[c]} of {attempts[c]}" for c in differing) + ".",
    ]
    return "\n".join(lines) + "\n"


def method(data: dict) -> str:
    m = data["machine"]
    amp = "/".join(sorted({c["amp_precision"] for c in data.get(SMALL, [])})) or "the device's"
    large_b = "/".join(str(b) for b in sorted({c["batch"] for c in data.get(LARGE, [])})) or "-"
    return f"""\
- **Device.** Every contender trains the same model file (AdamW at oomtune's default lr, fp32, gradient clipping at
  norm 1.0) on oomtune's `cpu` device: real compute, memory counted by the tensor tracker, which raises
  `torch.cuda.OutOfMemoryError` when live tensor bytes pass the budget. 2 training steps per trial for everyone
  (Lightning's `steps_per_trial` set to 2). Fits = ran without an OOM in the budget: oomtune `--headroom
  {data['headroom']}`, Lightning binsearch `margin=0`.
- **Peers.** Accelerate: `find_executable_batch_size(starting_batch_size=B)` around the loop its docs show
  (`Accelerator(cpu=True)`, `prepare`, `accelerator.backward`, `clip_grad_norm_`, `free_memory()` at the start of
  each attempt). Lightning: `Tuner(trainer).scale_batch_size`, `init_val=2`, `max_trials=25`; its dataloader calls
  the model file's `make_batch`.
- **Tracked.** oomtune: each trial (`device.measure()`). Accelerate: the decorated function. Lightning: each trial's
  `fit_loop.run()`, with the LightningModule's weights; the tuner's bookkeeping between trials is not tracked.
- **Counted.** A trial is one attempt at one batch size; a step is a training step started. oomtune's fp32 row
  counts its fp32 rung only (the target trial included); the peers' seconds are their whole call.
- **Exhaustive truth.** The peak of every micro-batch 1..B on every rung (and every accumulation plan d x B/d) on the
  `fake` device with no margin, once per model; a plan fits a budget when its peak is at most the budget.
- **Realistic batch sizes.** B = {large_b}, a short context, the fp32 rung only (oomtune's `probe()` with its ladder
  cut to fp32; its one accumulation verify is not counted in the fp32 row); truth: every micro-batch 1..B at fp32.
- **Full ladder.** `oomtune probe` under both objectives against the best plan that keeps the global batch exact
  on the same rungs (fp32, {amp} autocast, {amp} autocast + checkpointing; micro-batch d dividing B, B/d
  accumulation steps) at context T (T_min = T). fit: largest micro-batch, then the earliest rung. throughput: the
  highest tokens/s, each candidate timed on the cpu device without the tracker (fastest of 2 steps after 1 warm-up).
- **Machine load.** {m['cores']} cores shared with other jobs (load average {m['load_average_start'][0]:.1f} at the
  start, {m['load_average_end'][0]:.1f} at the end); torch at {m['torch_threads']} intra-op thread for every contender.
"""


# -- the file -------------------------------------------------------------------------------------------------

def _case_list(cases: list[dict]) -> str:
    return ", ".join(f"`{c['path']}` (B={c['batch']}, T={c['context']}; budgets "
                     f"{', '.join(b['budget'] for b in c['budgets'])})" for c in cases)


def _span(data: dict, group: str, key) -> str:
    values = sorted({key(case, b) for case, b in _cases(data, group)})
    return f"{values[0]}" if len(values) == 1 else f"{values[0]}-{values[-1]}"


def header(data: dict) -> list[str]:
    m = data["machine"]
    v = m["versions"]
    ram = format_bytes(m["ram_bytes"]) if m["ram_bytes"] else "unknown"
    devices = sorted({c["truth_device"] for g in (SMALL, LARGE) for c in data.get(g, [])})
    others = ", ".join(f'"{heading}"' for _, _, heading in OTHER_SECTIONS)
    targets = ", ".join(f"`make {target}`" for target in dict.fromkeys(t for _, t, _ in OTHER_SECTIONS))
    out = [
        "# oomtune benchmarks\n",
        f"Generated by `{data['command']}` (`{' '.join(['python', *data['argv'][1:]])}`) on {data['date']}, "
        f"in {data['wall_seconds']:.0f} s. Every figure outside the sections {others} comes from that run; those "
        f"are written by {targets}, which it runs first, and say how they ran. Rerunning `{data['command']}` "
        "regenerates this file and "
        "`bench/results.json` (every trial of every contender). What the figures show: `docs/benchmarks.md`.\n",
        "## Machine\n",
        f"- CPU: {m['cpu']}, {m['cores']} cores; RAM {ram}; {m['os']}",
        f"- torch {v['torch']} ({m['torch_threads']} intra-op thread), lightning {v['lightning']}, "
        f"accelerate {v['accelerate']}, Python {v['python']}; oomtune at commit {m['git_commit']}"
        + (" plus uncommitted changes in the working tree" if m.get("git_dirty") else ""),
        "- No GPU: every contender ran on oomtune's simulated `cpu` device; the exhaustive truth on the "
        f"`{'`/`'.join(devices)}` device\n",
    ]
    if data.get(SMALL):
        out.append(f"Small-batch cases (batch search and the full ladder): {_case_list(data[SMALL])}.\n")
    if data.get(LARGE):
        out.append(f"Realistic-batch cases (batch search at fp32 only): {_case_list(data[LARGE])}.\n")
    return out


def render(data: dict, others: dict[str, str]) -> str:
    small, large = bool(data.get(SMALL)), bool(data.get(LARGE))
    out = header(data)
    out += ["## Headline: batch-size search at fp32\n",
            "Each contender searches for the largest batch that trains in the budget at fp32, on every model x "
            "budget case; \"true max\" is the exhaustive answer.\n", HEADLINE_BEGIN]
    batch = lambda c, b: c["batch"]  # noqa: E731
    truth = lambda c, b: b["true_max"]["fp32"]  # noqa: E731
    for group, title in ((SMALL, "Small batches"), (LARGE, "Realistic batch sizes")):
        if data.get(group):
            out += [f"### {title} (target {_span(data, group, batch)}, true max {_span(data, group, truth)})\n",
                    headline(data, group)]
    out[-1] = out[-1].rstrip()
    out.append(HEADLINE_END + "\n")
    if small:
        out += ["## Batch-size search, per case (small batches)\n", per_case(data), below_truth(data),
                "## oomtune against a third of Lightning binsearch's trials (small batches)\n", third_table(data)]
    if large:
        out += ["## Realistic batch sizes\n", large_intro(data), per_case(data, LARGE), below_truth(data, LARGE),
                "### oomtune against a third of Lightning binsearch's trials (realistic batch sizes)\n",
                third_table(data, LARGE), first_line(data, LARGE)]
    if small:
        out += ["## The full ladder (the peers search batch size only; small-batch cases)\n",
                "### Objective fit\n", ladder_fit(data),
                "### Objective throughput\n", ladder_throughput(data),
                "Tokens/s of every plan timed (fastest first):\n", throughput_detail(data)]
    out += [
        "## The probe from the estimate\n", prior_section(data),
        "## Cross-checks\n", cross_checks(data),
        "## How the comparison is made\n", method(data),
        *(x for name, _, heading in OTHER_SECTIONS
          for x in (f"## {heading}\n", _section(name, others.get(name, "TODO: not run.")))),
    ]
    return "\n".join(out)
