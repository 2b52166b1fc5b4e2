"""The bench's section on the probe that starts from the estimate: device trials per searched rung and wall seconds,
with and without the prior, next to Lightning's binsearch and Accelerate; and the cases with memory the estimate
cannot see. Tables only; docs/benchmarks.md says what they show."""

from __future__ import annotations

from statistics import mean

from .report_format import SMALL, _cases, _row, _table

LARGE = "large_cases"


def _same(a: dict, b: dict) -> str:
    """run.py's same_answers (a: with the prior): each rung certified alone the search's largest micro-batch, each
    certified by its plan the largest plan that fits, and the same plan; older results compare the answers."""
    s = a.get("same")
    if s is None:
        return "yes" if a["answers"] == b["answers"] and a["plan"] == b["plan"] else "**no**"
    unchecked = f" ({', '.join(s['rungs_unchecked'])} unchecked)" if s["rungs_unchecked"] else ""
    return ("yes" if s["same"] else f"**no**: {', '.join(s['rungs_differing']) or 'the plan'}") + unchecked


def _prior(r: dict) -> str:
    p = r["prior"]
    if p is None or not p["used"]:
        return "-" if p is None else f"none: {p['why_not']}"
    back = f", fell back: {', '.join(p['fell_back_rungs'])}" if p["fell_back_rungs"] else ""
    replayed = f" + {p['replayed_trials']} replayed" if p.get("replayed_trials") else ""
    return f"{p['fake_trials']} fake{replayed} / {p['fake_seconds']:.1f} s{back}"


def _answer(r: dict, b: dict) -> str:
    """A run's fp32 answer: the largest micro-batch alone, or the plan it certified (micro-batch x accumulation); the
    search's with its plan."""
    accum = r.get("certified_plans", {}).get("fp32")
    if accum:
        return f"{r['answers'].get('fp32')} x{accum} (plan)"
    plan = r.get("plan")
    tail = f", plan {plan['micro_batch_size']} x{plan['grad_accum_steps']}" if plan else ""
    return f"{r['answers'].get('fp32')} alone{tail}"


def per_case(data: dict) -> str:
    rows = []
    for c, b in _cases(data, SMALL, LARGE):
        w, o = b["prior"]["with"], b["prior"]["without"]
        rows.append([c["model"], b["budget"], b["batch"], o["device_trials"], w["device_trials"],
                     w["rungs_searched"], f"{o['trials_per_rung']:.2f}", f"{w['trials_per_rung']:.2f}",
                     f"{o['seconds']:.1f}", f"{w['seconds']:.1f}", _prior(w), _same(w, o)])
    return _table(["model", "budget", "target", "device trials, no prior", "device trials, prior", "rungs",
                   "per rung, no prior", "per rung, prior", "seconds, no prior", "seconds, prior (estimate incl.)",
                   "the estimate", "same answers"], rows)


def summary(data: dict) -> str:
    rows = []
    for group, title in ((SMALL, "small batches, full ladder"), (LARGE, "realistic batch sizes, fp32 rung")):
        cases = list(_cases(data, group))
        if not cases:
            continue
        w = [b["prior"]["with"] for _, b in cases]
        o = [b["prior"]["without"] for _, b in cases]
        bins = [_row(b, "lightning-binsearch")["trials"] for _, b in cases]
        acc = [_row(b, "accelerate")["trials"] for _, b in cases]
        same = sum(_same(a, b).startswith("yes") for a, b in zip(w, o, strict=True))
        rows.append([title, len(cases), f"{mean(r['trials_per_rung'] for r in o):.2f}",
                     f"{mean(r['trials_per_rung'] for r in w):.2f}", f"{max(r['trials_per_rung'] for r in w):.2f}",
                     f"{mean(bins):.1f}", f"{mean(acc):.1f}", f"{sum(r['seconds'] for r in o):.1f}",
                     f"{sum(r['seconds'] for r in w):.1f}", *_break_even(w, o), same,
                     sum(bool(r["prior"] and r["prior"]["fell_back_rungs"]) for r in w)])
    return _table(["cases", "n", "device trials per searched rung, no prior", "with the prior (mean)",
                   "with the prior (worst case)", "binsearch trials (fp32 search)", "Accelerate trials",
                   "seconds, no prior (sum)", "seconds, prior (sum, estimate incl.)",
                   "a device trial here (s, mean, no prior)", "the estimate's seconds per device trial saved",
                   "same answers", "cases with a rung that fell back"], rows)


def _break_even(w: list[dict], o: list[dict]) -> tuple[str, str]:
    """What a device trial cost here (the search alone: its seconds over its trials), and the estimate's seconds
    over the device trials it saved: where a device trial costs more than that (a GPU's, with a model of real
    size), the probe from the estimate takes less wall time than the search alone."""
    per_trial = sum(r["seconds"] for r in o) / max(sum(r["device_trials"] for r in o), 1)
    saved = sum(r["device_trials"] for r in o) - sum(r["device_trials"] for r in w)
    fake = sum(r["prior"]["fake_seconds"] for r in w if r["prior"])
    return f"{per_trial:.2f}", f"{fake / saved:.2f}" if saved > 0 else "-"


def third(data: dict) -> str:
    rows = []
    for c, b in _cases(data, LARGE):
        ours, bins = _row(b, "oomtune-prior"), _row(b, "lightning-binsearch")
        rows.append([c["model"], b["budget"], ours["trials"], bins["trials"], f"{bins['trials'] / 3:.1f}",
                     "yes" if ours["trials"] <= bins["trials"] / 3 else "no"])
    return _table(["model", "budget", "oomtune from the estimate: fp32 trials", "binsearch trials", "a third",
                   "at most a third"], rows) if rows else ""


def hidden(data: dict) -> str:
    rows = []
    for c, b in _cases(data, LARGE):
        for h in b["prior"]["hidden"]:
            w, o = h["with"], h["without"]
            rows.append([c["model"], b["budget"], h["hidden"], _answer(o, b), _answer(w, b),
                         o["device_trials"], w["device_trials"], f"{o['seconds']:.1f}", f"{w['seconds']:.1f}",
                         _prior(w), _same(w, o)])
    return _table(["model", "budget", "hidden (fixed + share of the tensors)", "fp32, no prior",
                   "fp32, prior", "device trials, no prior", "device trials, prior", "seconds, no prior",
                   "seconds, prior", "the estimate", "same answers"], rows) if rows else ""


def prior_section(data: dict) -> str:
    if not any("prior" in b for _, b in _cases(data, SMALL, LARGE)):
        return "Not run.\n"
    return "\n".join([
        "`oomtune probe` runs the ladder on the fake device first, accounting as the cpu device does, then certifies "
        "each rung on the cpu device: a rung that will accumulate by its plan (d x B/d fits, the next divisor's plan "
        "does not), another by its predicted micro-batch (it fits, the next does not). It corrects a miss, and falls "
        "back to the search where the estimate is off by more than 25%. `--no-prior` is the search alone. Device "
        "trials count the trials on the cpu device (accumulation verifies included); the seconds are the whole "
        "probe's, the estimate's included. Same answers: each rung certified alone has the search's largest "
        "micro-batch, each certified by its plan the largest plan that fits on that rung (the exhaustive table's; "
        "with hidden memory, which the table cannot see, the search's own plan), and the plan is the search's.\n",
        "### Summary\n", summary(data), "### Per case\n", per_case(data),
        "### Realistic batch sizes: against a third of Lightning binsearch's trials\n", third(data),
        "### Memory the estimate cannot see\n",
        "The cpu device counts a fixed part plus a share of the tensor peak on top of its tensors (its margin); the "
        "estimate does not, so every prediction misses by that much and the certification must correct it. The "
        "answers are compared with the search's on the same device.\n", hidden(data)])
