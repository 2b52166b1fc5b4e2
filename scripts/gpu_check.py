#!/usr/bin/env python3
"""`make gpu-check`: the real-GPU truth for oomtune, on one GPU, in under 9 minutes.

Runs with the machine's own python3 and the repository on the path; installs nothing and needs no network.
Needs torch. Uses pytest (the gpu tests) and nvidia-ml-py (NVML) when present and says so when not;
PyYAML, typer and rich are not needed.

  1. the `gpu` tests (tests/test_gpu.py, tests/test_gpu_estimates.py), in a subprocess, time-boxed
  2. fake estimate vs real memory: every example model x rung (fp32, amp, checkpointing) at two fixed plans
     (8 and 64 x the model file's DEFAULTS batch, at its DEFAULTS context): the fake device's tensor peak against
     the real max_memory_allocated less what was live before the trial, and its peak with the margin against the
     real max_memory_reserved plus the CUDA context, with relative errors; then the margin those rows imply
     (a least-squares fit of card - tensors = fixed + pct x tensors), to calibrate the default 512MiB+5%
  3. the probe on the real GPU, per example (4 GiB budget, target batch 4096): the plan, trials, wall time, from
     the estimate and with --no-prior, next to the fake device's plan for the same targets and budget
  4. the kernels the fake device follows the CPU for (an LSTM's cuDNN reserve space, fp32 grouped matmul)
  5. the probe table's rows for realistic models, GPT-2 small (16 GiB, target batch 32, context 1024) and a 1.1B
     Llama with LoRA (16 GiB, target batch 16, context 1024), where the time box leaves each ~2.5-3 minutes: whether
     the prior (default "auto": skipped where it would not pay) pays in wall time where a device trial costs real
     compute, against the search with --no-prior

Prints one Markdown report; with $OUT set, also writes $OUT/gpu_check.md, $OUT/gpu_check.json and the full
pytest output $OUT/gpu_tests.txt.

Exit status: 0 everything ran and passed; 1 something failed or did not run (a failed or skipped gpu test,
pytest missing, a row that errored, the time box); 2 bad arguments; 3 nothing checked: no CUDA GPU visible
(or no torch for this python).
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # the checkout, not an installed copy
sys.path.insert(0, str(ROOT / "scripts"))  # its tables, beside this file

from gpu_probe import GPT2_NEEDS_S, LLAMA_1B_LORA, LORA_NEEDS_S, probe_table, realistic_table  # noqa: E402 - after the path
from gpu_tables import Report, TimeBox, kernel_table, memory_table  # noqa: E402

OPTIONAL = ("pytest", "pynvml", "yaml", "typer", "rich")
NO_GPU = 3


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
    cmd = [sys.executable, "-m", "pytest", "-m", "gpu", "-q", "-rs", "-p", "no:cacheprovider", "tests/test_gpu.py",
           "tests/test_gpu_estimates.py"]
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


# -- the run -------------------------------------------------------------------------------------------

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
    from oomtune.memory import nvml
    from oomtune.units import format_bytes as fb

    props = torch.cuda.get_device_properties(0)
    pci, uuid = nvml.ids_of(props)
    before = nvml.find_gpu(nvml.query(processes=False), pci=pci, uuid=uuid)
    torch.zeros(1, device="cuda")  # creates the context (and one 2 MiB allocator block)
    torch.cuda.synchronize()
    report = nvml.query()
    after = nvml.find_gpu(report, pci=pci, uuid=uuid)
    info = {"name": props.name, "total_bytes": props.total_memory, "cc": f"{props.major}.{props.minor}",
            "driver": report.driver_version, "cuda_driver": report.cuda_driver_version,
            "nvml": report.available, "nvml_reason": report.reason, "pci": pci, "uuid": uuid,
            "before_used_bytes": before.used_bytes if before is not None and after is not None else None}
    line = f"GPU: {props.name}, {fb(props.total_memory)}, compute capability {info['cc']}"
    if after is not None and before is not None:
        context = after.used_bytes - before.used_bytes - torch.cuda.memory_reserved()
        info |= {"nvml_free_bytes": after.free_bytes, "context_bytes": context,
                 "other_processes": [(p.pid, p.name, p.used_bytes) for p in after.processes]}
        line += (f"; NVML: driver {report.driver_version}, CUDA {report.cuda_driver_version}, free "
                 f"{fb(after.free_bytes)}, this process's bare CUDA context ~{fb(context)} (NVML used after - "
                 "before; measured again after the warm-up below)")
    else:
        line += f"; NVML: {report.reason or 'this GPU not found by PCI address / UUID'}"
    rep.say(line)
    rep.data["gpu"] = info
    return info


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--time-box", type=float, default=540, help="seconds for everything (default 540 = 9 min)")
    ap.add_argument("--tests-time", type=float, default=240, help="at most this many seconds for the gpu tests")
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
    try:
        run_checks(rep, torch, args, deadline, out_dir)
    except Exception as e:  # noqa: BLE001 - whatever broke, the report so far is written and says what
        import traceback

        rep.problem(f"gpu-check itself failed: {type(e).__name__}: {e}")
        rep.say(f"\n**gpu-check failed**: {type(e).__name__}: {e}\n```\n{traceback.format_exc().strip()}\n```")
    total = args.time_box - (deadline - time.monotonic())
    status = "ok" if not rep.problems else "problems: " + "; ".join(rep.problems)
    rep.say(f"\n**{status}** (total {total:.0f} s)")
    rep.data["status"] = "ok" if not rep.problems else "problems"
    rep.data["problems"] = rep.problems
    rep.data["seconds"] = round(total, 1)
    rep.write(out_dir)
    return 0 if not rep.problems else 1


def run_checks(rep: Report, torch, args, deadline: float, out_dir: str | None) -> None:
    gpu = gpu_header(rep, torch)
    if args.skip_tests:
        rep.say("## gpu tests\nskipped (--skip-tests)")
        rep.data["tests"] = {"status": "skipped by --skip-tests"}
        rep.problem("gpu tests skipped")
    else:  # the tests run in their own process; leave the tables ~2.5 minutes and the realistic row its own
        realistic = GPT2_NEEDS_S + LORA_NEEDS_S
        run_gpu_tests(rep, max(30.0, min(args.tests_time, deadline - time.monotonic() - 150 - realistic)), out_dir)
    from oomtune.memory.devices import make_device

    signal.signal(signal.SIGALRM, _alarm)
    signal.alarm(max(1, int(deadline - time.monotonic())))
    try:
        context = memory_table(rep, make_device("cuda"), deadline, gpu)
        probe_table(rep, deadline, context)
        kernel_table(rep, torch)
        realistic_table(rep, deadline, context)  # last: where the time box is short, only they are lost
        realistic_table(rep, deadline, context, case=LLAMA_1B_LORA, needs_s=LORA_NEEDS_S, key="probe_realistic_lora")
    except TimeBox:
        rep.problem("time box hit")
        rep.say(f"\n**time box**: stopped after {args.time_box:.0f} s")
    finally:
        signal.alarm(0)


if __name__ == "__main__":
    sys.exit(main())
