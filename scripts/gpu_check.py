#!/usr/bin/env python3
"""`make gpu-check`: the real-GPU truth for oomtune, on one GPU, in under 8 minutes.

Runs with the machine's own python3 and the repository on the path; installs nothing and needs no network.
Needs torch. Uses pytest (the gpu tests) and nvidia-ml-py (NVML) when present and says so when not;
PyYAML, typer and rich are not needed.

  1. the `gpu` tests (tests/test_gpu.py), in a subprocess, time-boxed
  2. fake estimate vs real memory: every example model x rung (fp32, amp, checkpointing) at a fixed plan
     (8 x the model file's DEFAULTS batch, at its DEFAULTS context): the fake device's tensor peak and its
     peak with the margin, against the real max_memory_allocated / max_memory_reserved, with relative errors
  3. the probe on the real GPU, per example (4 GiB budget, target batch 4096): the plan, trials, wall time,
     next to the fake device's plan for the same targets and budget

Prints one Markdown report; with $OUT set, also writes $OUT/gpu_check.md, $OUT/gpu_check.json and the full
pytest output $OUT/gpu_tests.txt.

Exit status: 0 everything ran and passed; 1 something failed or did not run (a failed or skipped gpu test,
pytest missing, a row that errored, the time box); 2 bad arguments; 3 nothing checked: no CUDA GPU visible
(or no torch for this python).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # the checkout, not an installed copy

EXAMPLES = ("tiny_gpt", "mlp_dict", "conv_net")
PLAN_SCALE = 8  # the table's fixed plan: PLAN_SCALE x DEFAULTS batch, DEFAULTS context
PROBE_BUDGET, PROBE_BATCH = "4GiB", 4096
OPTIONAL = ("pytest", "pynvml", "yaml", "typer", "rich")
NO_GPU = 3


class TimeBox(BaseException):
    """The whole check ran out of its time box. A BaseException, so no `except Exception` on the way (the
    trial's OOM handler, the model file's error wrapper) mistakes it for an OOM or a user error."""


def pct(estimate: int | None, real: int | None) -> str:
    if not estimate or not real:
        return "n/a"
    return f"{(estimate - real) / real * 100:+.1f}%"


def md_table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]
    return "\n".join(lines)


class Report:
    """Collects the Markdown sections (printed as they come) and the JSON."""

    def __init__(self):
        self.md: list[str] = []
        self.data: dict = {}
        self.problems: list[str] = []

    def say(self, text: str = "") -> None:
        print(text, flush=True)
        self.md.append(text)

    def problem(self, text: str) -> None:
        self.problems.append(text)

    def write(self, out_dir: str | None) -> None:
        if not out_dir:
            return
        d = Path(out_dir)
        d.mkdir(parents=True, exist_ok=True)
        (d / "gpu_check.md").write_text("\n".join(self.md) + "\n")
        (d / "gpu_check.json").write_text(json.dumps(self.data, indent=2) + "\n")
        print(f"\nwrote {d / 'gpu_check.md'} and {d / 'gpu_check.json'}", flush=True)


# -- 1. the gpu tests ------------------------------------------------------------------------------

SUMMARY = re.compile(r"(\d+) (passed|failed|skipped|errors?|deselected|xfailed|xpassed)")


def pytest_counts(output: str) -> dict[str, int]:
    """The counts on pytest's last summary line ("1 failed, 9 passed, 2 skipped in 3.2s"); {} if none."""
    last = next((ln for ln in reversed(output.splitlines()) if SUMMARY.search(ln)), "")
    return {k: int(n) for n, k in SUMMARY.findall(last)}


def run_gpu_tests(rep: Report, timeout_s: float, out_dir: str | None) -> None:
    rep.say("## gpu tests")
    if importlib.util.find_spec("pytest") is None:
        rep.say("NOT RUN: pytest is not installed for this python; the table below still runs.")
        rep.data["tests"] = {"status": "not run", "reason": "pytest is not installed"}
        rep.problem("gpu tests not run (pytest missing)")
        return
    missing = [m for m in ("yaml", "typer", "rich", "pynvml") if importlib.util.find_spec(m) is None]
    if missing:  # oomtune's own dependencies, which a machine with only PyTorch lacks
        rep.say(f"missing for this python: {', '.join(missing)}; the gpu tests that need them skip (named below), "
                "so the tests count as incomplete")
        rep.data["missing_modules"] = missing
    cmd = [sys.executable, "-m", "pytest", "-m", "gpu", "-q", "-rs", "-p", "no:cacheprovider", "tests/test_gpu.py"]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    start = time.perf_counter()
    try:
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout_s)
        output, rc = proc.stdout + proc.stderr, proc.returncode
    except subprocess.TimeoutExpired as e:
        output = (e.stdout or b"").decode(errors="replace") if isinstance(e.stdout, bytes) else (e.stdout or "")
        output += f"\n[gpu_check] killed after the {timeout_s:.0f} s time box"
        rc = None
    seconds = time.perf_counter() - start
    if out_dir:
        Path(out_dir).mkdir(parents=True, exist_ok=True)
        (Path(out_dir) / "gpu_tests.txt").write_text(output)
    counts = pytest_counts(output)
    passed = rc == 0 and counts.get("passed", 0) > 0 and not counts.get("skipped") and not counts.get("failed")
    status = "passed" if passed else ("timed out" if rc is None else "FAILED" if rc else "incomplete (skips)")
    summary = ", ".join(f"{n} {k}" for k, n in counts.items()) or "no summary line"
    rep.say(f"`{' '.join(cmd[1:])}`: **{status}** ({summary}) in {seconds:.0f} s")
    rep.say("```")
    tail = [ln for ln in output.strip().splitlines() if ln.strip()][-25:]
    rep.say("\n".join(tail))
    rep.say("```")
    rep.data["tests"] = {"status": status, "returncode": rc, "counts": counts, "seconds": round(seconds, 1)}
    if not passed:
        rep.problem(f"gpu tests {status}")


# -- 2. fake vs real ---------------------------------------------------------------------------------

def fake_device(budget: str):
    """The fake device, or the reason there is none (it is being built alongside this script)."""
    from oomtune import devices

    if "fake" not in getattr(devices, "DEVICE_KINDS", ()):
        return None, "n/a: fake device missing"
    try:
        return devices.make_device("fake", budget), None
    except Exception as e:  # noqa: BLE001 - any failure to make it is reported in the column, not raised
        return None, f"n/a: fake device failed: {type(e).__name__}: {e}"


def rungs_for(cuda) -> list[tuple[str, str, bool]]:
    amp = cuda.amp_dtype()
    return [("fp32", "fp32", False), ("amp", amp, False), ("checkpointing", amp, True)]


def memory_table(rep: Report, cuda, deadline: float, context: int | None) -> None:
    import torch

    from oomtune.model_file import load_model_file
    from oomtune.plan import Plan
    from oomtune.trial import run_trial
    from oomtune.units import format_bytes as fb

    rep.say("## fake estimate vs real memory (fixed plan per model)")
    fake, fake_missing = fake_device("1TiB")
    rungs = rungs_for(cuda)
    models = {name: load_model_file(ROOT / "examples" / f"{name}.py") for name in EXAMPLES}
    # warm-up: every (model, rung) once at micro-batch 1, so workspaces cuBLAS & co. keep for the process's
    # lifetime exist before measuring; they stay in every real number below (as in any training process)
    for name, mf in models.items():
        for _, prec, ckpt in rungs:
            check_time(deadline)
            try:
                run_trial(mf, Plan(1, mf.defaults.get("context", 512), prec, ckpt), cuda, steps=1)
            except Exception as e:  # noqa: BLE001 - (not the TimeBox) its row below reports it; the table is written
                rep.problem(f"{name} {prec}{'+ckpt' if ckpt else ''} warm-up: {type(e).__name__}: {str(e)[:80]}")
    baseline = torch.cuda.memory_allocated(cuda.torch_device)
    rep.say(f"live before each trial (kept across trials: cuBLAS workspaces etc.): {fb(baseline)}; "
            f"fake margin: {fake.margin.describe() if fake is not None and hasattr(fake, 'margin') else 'n/a'}")
    rows, data = [], []
    stopped = False
    for name, mf in models.items():
        if stopped:
            break
        b, t = PLAN_SCALE * mf.defaults.get("batch", 32), mf.defaults.get("context", 512)
        for rung, prec, ckpt in rungs:
            plan = Plan(b, t, prec, ckpt)
            label = f"{prec}{'+ckpt' if ckpt else ''}"
            row = {"model": name, "rung": rung, "precision": prec, "checkpointing": ckpt, "batch": b, "context": t}
            try:
                check_time(deadline)
                real = run_trial(mf, plan, cuda, steps=2)
                est = run_trial(mf, plan, fake, steps=2) if fake is not None else None
            except TimeBox:
                rep.problem("time box hit in the memory table")
                rows.append([name, label, f"{b}x{t}", "time box"] + [""] * 8)
                data.append(row | {"error": "time box"})
                stopped = True
                break
            except Exception as e:  # noqa: BLE001 - a broken row is reported, the others still run
                rep.problem(f"{name} {label}: {type(e).__name__}")
                rows.append([name, label, f"{b}x{t}", f"error: {type(e).__name__}: {str(e)[:80]}"] + [""] * 8)
                data.append(row | {"error": f"{type(e).__name__}: {e}"})
                continue
            if real.oom:
                rep.problem(f"{name} {label}: real OOM")
            fake_t = None if est is None or est.oom else est.peak_allocated_bytes  # tensors only
            fake_m = None if est is None or est.oom else est.peak_bytes  # + the margin
            fake_txt = fake_missing or ("OOM" if est.oom else fb(fake_t))
            # the margin stands for the CUDA context too, so its yardstick is reserved + context
            on_card = real.peak_bytes + context if real.peak_bytes is not None and context is not None else None
            rows.append([name, label, f"{b}x{t}", fake_txt, fb(real.peak_allocated_bytes),
                         pct(fake_t, real.peak_allocated_bytes), fb(real.peak_bytes),
                         fake_missing or fb(fake_m), fb(on_card), pct(fake_m, on_card),
                         "OOM" if real.oom else f"{real.tokens_per_s:,.0f}" if real.tokens_per_s else "-"])
            data.append(row | {"fake_tensor_peak_bytes": fake_t, "fake_peak_with_margin_bytes": fake_m,
                               "fake_missing": fake_missing, "real_max_allocated_bytes": real.peak_allocated_bytes,
                               "real_max_reserved_bytes": real.peak_bytes, "real_reserved_plus_context_bytes": on_card,
                               "real_oom": real.oom,
                               "real_tokens_per_s": real.tokens_per_s, "real_phase_peaks": real.phase_peaks})
    rep.say(md_table(["model", "rung", "batch x ctx", "fake (tensors)", "real max allocated", "error",
                      "real max reserved", "fake + margin", "real reserved + context", "error", "real tok/s"], rows))
    rep.say("error = (fake - real) / real. Real numbers include the live-before figure above. The fake margin "
            "stands for the allocator's rounding and the CUDA context, so it is compared with the real reserved "
            "peak plus the context (measured above; n/a without NVML).")
    rep.data["memory"] = {"baseline_allocated_bytes": baseline, "fake_missing": fake_missing, "rows": data}


# -- 3. the probe --------------------------------------------------------------------------------------

def probe_table(rep: Report, deadline: float, context: int | None) -> None:
    from oomtune.devices import make_device
    from oomtune.model_file import load_model_file
    from oomtune.probe import Targets, probe
    from oomtune.units import format_bytes as fb
    from oomtune.units import parse_budget

    # on cuda the budget caps the caching allocator (the context is outside it); the fake device's budget is a
    # whole card whose margin includes the context: give it the context on top, so both mean the same memory
    fake_budget = f"{parse_budget(PROBE_BUDGET) + (context or 0)}B"
    rep.say(f"## the probe on the real GPU (budget {PROBE_BUDGET}, headroom 10%, target batch {PROBE_BATCH})")
    rep.say(f"the fake device gets {fb(parse_budget(fake_budget))}: the budget plus this process's CUDA context "
            f"({fb(context) if context is not None else 'unknown without NVML: not added'})")
    rows, data = [], []
    for name in EXAMPLES:
        mf = load_model_file(ROOT / "examples" / f"{name}.py")
        t = mf.defaults.get("context", 512)
        targets = Targets(PROBE_BATCH, t, t)
        try:
            check_time(deadline)
            cuda = make_device("cuda", PROBE_BUDGET)
            start = time.perf_counter()
            real = probe(mf, cuda, targets)
            real_s = time.perf_counter() - start
            fake, fake_missing = fake_device(fake_budget)
            est, est_s = None, None
            if fake is not None:
                check_time(deadline)
                start = time.perf_counter()
                est = probe(mf, fake, targets, command="estimate")
                est_s = time.perf_counter() - start
        except TimeBox:
            rep.problem("time box hit in the probe table")
            rows.append([name, "time box"] + [""] * 7)
            data.append({"model": name, "error": "time box"})
            break
        except Exception as e:  # noqa: BLE001
            rep.problem(f"probe {name}: {type(e).__name__}")
            rows.append([name, f"error: {type(e).__name__}: {str(e)[:80]}"] + [""] * 7)
            data.append({"model": name, "error": f"{type(e).__name__}: {e}"})
            continue
        plan = real.config.plan.describe() if real.config else "nothing fits"
        peak = fb(real.config.found_by.peak_bytes) if real.config else "-"
        per_rung = ", ".join(f"{k} {v}" for k, v in real.trials_per_rung.items())
        if est is None:
            fake_plan, same = fake_missing, "n/a"
        else:
            fake_plan = est.config.plan.describe() if est.config else "nothing fits"
            same = "yes" if (est.config and real.config and est.config.plan == real.config.plan) else "no"
        rows.append([name, f"{PROBE_BATCH}x{t}", plan, peak, f"{len(real.records)} ({per_rung})", f"{real_s:.1f}",
                     fake_plan, f"{len(est.records)} / {est_s:.1f} s" if est is not None else "n/a", same])
        data.append({"model": name, "batch": PROBE_BATCH, "context": t, "budget": PROBE_BUDGET,
                     "plan": real.config.plan.describe() if real.config else None,
                     "peak_bytes": real.config.found_by.peak_bytes if real.config else None,
                     "trials": len(real.records), "trials_per_rung": real.trials_per_rung,
                     "wall_seconds": round(real_s, 2),
                     "fake_plan": est.config.plan.describe() if est is not None and est.config else None,
                     "fake_trials": len(est.records) if est is not None else None,
                     "fake_wall_seconds": round(est_s, 2) if est_s is not None else None, "fake_missing": fake_missing,
                     "same_plan": same})
    rep.say(md_table(["model", "target", "real plan", "real peak", "trials (per rung)", "wall s", "fake plan",
                      "fake trials / wall", "same plan"], rows))
    rep.data["probe"] = data


# -- the run -------------------------------------------------------------------------------------------

def check_time(deadline: float) -> None:
    if time.monotonic() > deadline:
        raise TimeBox


def _alarm(signum, frame):  # a trial that runs past the deadline is interrupted where Python regains control
    raise TimeBox


def environment(rep: Report):
    try:
        import torch
    except ImportError:
        rep.say("# oomtune gpu-check")
        rep.say(f"**no torch**: {sys.executable} cannot import torch; nothing was checked (exit status {NO_GPU}). "
                "Use the python that has PyTorch: make gpu-check GPU_PYTHON=/path/to/python3")
        rep.data["status"] = "no-torch"
        return None

    deps = {m: importlib.util.find_spec(m) is not None for m in OPTIONAL}
    info = {"python": sys.version.split()[0], "torch": torch.__version__, "torch_cuda": torch.version.cuda,
            "cuda_available": torch.cuda.is_available(), "optional": deps}
    rep.data["environment"] = info
    rep.say("# oomtune gpu-check")
    rep.say(f"python {info['python']}, torch {info['torch']} (CUDA build {info['torch_cuda']}); optional modules: "
            + ", ".join(f"{m} {'yes' if ok else 'MISSING'}" for m, ok in deps.items()))
    return torch


def gpu_header(rep: Report, torch) -> dict:
    """The GPU as torch and NVML see it, and the size of this process's CUDA context (NVML's used memory
    before and after creating it). Call before anything else creates the context."""
    from oomtune import nvml
    from oomtune.units import format_bytes as fb

    props = torch.cuda.get_device_properties(0)
    pci = (props.pci_domain_id, props.pci_bus_id, props.pci_device_id) if hasattr(props, "pci_bus_id") else None
    uuid = str(props.uuid) if hasattr(props, "uuid") else None
    before = nvml.find_gpu(nvml.query(processes=False), pci=pci, uuid=uuid)
    torch.zeros(1, device="cuda")  # creates the context (and one 2 MiB allocator block)
    torch.cuda.synchronize()
    report = nvml.query()
    after = nvml.find_gpu(report, pci=pci, uuid=uuid)
    info = {"name": props.name, "total_bytes": props.total_memory, "cc": f"{props.major}.{props.minor}",
            "driver": report.driver_version, "cuda_driver": report.cuda_driver_version,
            "nvml": report.available, "nvml_reason": report.reason}
    line = f"GPU: {props.name}, {fb(props.total_memory)}, compute capability {info['cc']}"
    if after is not None and before is not None:
        context = after.used_bytes - before.used_bytes - torch.cuda.memory_reserved()
        info |= {"nvml_free_bytes": after.free_bytes, "context_bytes": context,
                 "other_processes": [(p.pid, p.name, p.used_bytes) for p in after.processes]}
        line += (f"; NVML: driver {report.driver_version}, CUDA {report.cuda_driver_version}, free "
                 f"{fb(after.free_bytes)}, this process's CUDA context ~{fb(context)} (NVML used after - before)")
    else:
        line += f"; NVML: {report.reason or 'this GPU not found by PCI address / UUID'}"
    rep.say(line)
    rep.data["gpu"] = info
    return info


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--time-box", type=float, default=450, help="seconds for everything (default 450 = 7.5 min)")
    ap.add_argument("--tests-time", type=float, default=300, help="at most this many seconds for the gpu tests")
    ap.add_argument("--skip-tests", action="store_true", help="only the tables")
    args = ap.parse_args(argv)
    deadline = time.monotonic() + args.time_box
    out_dir = os.environ.get("OUT")
    rep = Report()
    torch = environment(rep)
    if torch is None:
        rep.write(out_dir)
        return NO_GPU
    if not torch.cuda.is_available():
        rep.say(f"\n**no CUDA GPU**: torch.cuda.is_available() is False (torch {torch.__version__}, CUDA build "
                f"{torch.version.cuda}). Nothing was checked; run this on a machine with an NVIDIA GPU. "
                f"Exit status {NO_GPU}.")
        rep.data["status"] = "no-gpu"
        rep.write(out_dir)
        return NO_GPU
    context = gpu_header(rep, torch).get("context_bytes")
    if args.skip_tests:
        rep.say("## gpu tests\nskipped (--skip-tests)")
        rep.data["tests"] = {"status": "skipped by --skip-tests"}
        rep.problem("gpu tests skipped")
    else:  # the tests run in their own process; leave the tables ~2.5 minutes
        run_gpu_tests(rep, max(30.0, min(args.tests_time, deadline - time.monotonic() - 150)), out_dir)
    from oomtune.devices import make_device

    signal.signal(signal.SIGALRM, _alarm)
    signal.alarm(max(1, int(deadline - time.monotonic())))
    try:
        memory_table(rep, make_device("cuda"), deadline, context)
        probe_table(rep, deadline, context)
    except TimeBox:
        rep.problem("time box hit")
        rep.say(f"\n**time box**: stopped after {args.time_box:.0f} s")
    finally:
        signal.alarm(0)
    total = args.time_box - (deadline - time.monotonic())
    status = "ok" if not rep.problems else "problems: " + "; ".join(rep.problems)
    rep.say(f"\n**{status}** (total {total:.0f} s)")
    rep.data["status"] = "ok" if not rep.problems else "problems"
    rep.data["problems"] = rep.problems
    rep.data["seconds"] = round(total, 1)
    rep.write(out_dir)
    return 0 if not rep.problems else 1


if __name__ == "__main__":
    sys.exit(main())
