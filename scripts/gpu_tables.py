"""The tables of `make gpu-check` (scripts/gpu_check.py): fake estimate vs real memory, and the kernels the fake
device follows the CPU for (the probe's tables: gpu_probe.py). Each takes the device to measure on, so a test can
dry-run them on the CPU."""

from __future__ import annotations

import json
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ("tiny_gpt", "mlp_dict", "conv_net")
PLAN_SCALES = (8, 64)  # the table's fixed plans: scale x DEFAULTS batch, DEFAULTS context (64: a few GiB)
MEMORY_HEADER = ["model", "rung", "batch x ctx", "fake tensors, CPU rules", "fake tensors, card rules",
                 "real max allocated", "less live before", "error", "fake reserved (allocator model)",
                 "real max reserved", "error", "fake peak (context + reserved)", "real reserved + context", "error",
                 "real tok/s"]


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


def check_time(deadline: float) -> None:
    if time.monotonic() > deadline:
        raise TimeBox



# -- 2. fake vs real ---------------------------------------------------------------------------------

def fake_device(budget: str, card=None, margin=None):
    """The fake device accounting like `card` (None: CPU rules), or why it could not be made (reported in its column,
    not raised)."""
    from oomtune.memory.devices import FakeDevice

    try:
        return FakeDevice(budget, gpu=card, margin=margin), None
    except Exception as e:  # noqa: BLE001 - any failure to make it is reported in the column, not raised
        return None, f"n/a: fake device failed: {type(e).__name__}: {e}"


def card_of(device):
    """The card whose rules the fake device follows: the real GPU's (its entry in the card table, or a profile made
    from its name, memory and compute capability), or a stand-in device's own card."""
    if device.kind != "cuda":
        return device.card
    import torch

    from oomtune.memory.cards import card_for

    props = torch.cuda.get_device_properties(device.torch_device)
    return card_for(props.name, props.total_memory, (props.major, props.minor))


def rungs_for(cuda) -> list[tuple[str, dict]]:
    """(rung, its plan's keys): the usual rungs, then those past accumulation (NF4 needs frozen weights, which the
    examples have none of: test_gpu.py covers it on a LoRA model)."""
    amp = cuda.amp_dtype()
    usual = [("fp32", {"precision": "fp32"}), ("amp", {"precision": amp}),
             ("checkpointing", {"precision": amp, "activation_checkpointing": True})]
    if not cuda.supports_bf16():
        return usual
    true = {"precision": "bf16-true", "activation_checkpointing": True}
    return usual + [("bf16-true", true), ("+8bit", true | {"optimizer_8bit": True}),
                    ("+offload", true | {"optimizer_8bit": True, "offload_optimizer": True}),
                    ("+offload-activations", true | {"optimizer_8bit": True, "offload_optimizer": True,
                                                     "offload_activations": True})]


def context_now(torch, gpu: dict, device) -> int | None:
    """This process's CUDA context (and the driver's other per-process memory: cuBLAS/cuDNN handles, kernels
    loaded so far): NVML's used memory now, less before torch touched the GPU, less what torch's allocator
    reserves. None without NVML."""
    from oomtune.memory import nvml

    if gpu.get("before_used_bytes") is None:
        return None
    now = nvml.find_gpu(nvml.query(processes=False), pci=gpu.get("pci"), uuid=gpu.get("uuid"))
    if now is None:
        return None
    return now.used_bytes - gpu["before_used_bytes"] - torch.cuda.memory_reserved(device)


def implied_margin(points: list[tuple[int, int]]) -> tuple[float, float] | None:
    """Least squares of (card - tensors) = fixed + pct x tensors over (tensors, card) points: the margin the
    rows imply, as (fixed bytes, pct). None with fewer than two distinct tensor peaks."""
    if len({t for t, _ in points}) < 2:
        return None
    n = len(points)
    mx = sum(t for t, _ in points) / n
    my = sum(c - t for t, c in points) / n
    sxx = sum((t - mx) ** 2 for t, _ in points)
    sxy = sum((t - mx) * (c - t - my) for t, c in points)
    pct = sxy / sxx
    return my - pct * mx, pct


def memory_table(rep: Report, cuda, deadline: float, gpu: dict, examples=EXAMPLES,
                 scales=PLAN_SCALES, batch: int | None = None) -> int | None:
    """The fake-vs-real rows on `cuda` (the real device; a test dry-runs it on the cpu device, at a small `batch`
    instead of each model's DEFAULTS batch); returns the CUDA context measured after the warm-up (None without
    NVML)."""
    import torch

    from oomtune.config.schema import Plan
    from oomtune.model_file import load_model_file
    from oomtune.search.trial import run_trial
    from oomtune.units import format_bytes as fb

    rep.say(f"## fake estimate vs real memory (fixed plans: {' and '.join(map(str, scales))} x each model's "
            "DEFAULTS batch)")
    from oomtune.memory.margin import Margin

    card = card_of(cuda)
    fake, fake_missing = fake_device("1TiB", card)
    cpu_rules, _ = fake_device("1TiB", None, Margin())
    rungs = rungs_for(cuda)
    models = {name: load_model_file(ROOT / "examples" / f"{name}.py") for name in examples}
    # warm-up: every (model, rung) once at micro-batch 1, so workspaces cuBLAS & co. keep for the process's
    # lifetime exist before measuring; they stay in every real number below (as in any training process)
    for name, mf in models.items():
        for rung, keys in rungs:
            check_time(deadline)
            try:
                run_trial(mf, Plan(1, mf.defaults.get("context", 512), **keys), cuda, steps=1)
            except Exception as e:  # noqa: BLE001 - (not the TimeBox) its row below reports it; the table is written
                rep.problem(f"{name} {rung} warm-up: {type(e).__name__}: {str(e)[:80]}")
    baseline = cuda.live_bytes()
    context = context_now(torch, gpu, cuda.torch_device)  # after the warm-up: handles and kernels exist now
    rep.data["gpu"] = gpu | {"context_bytes": context}
    ws = card.workspace_bytes if card is not None else None
    rep.data["fixed_costs"] = {"card": card.name if card else None, "live_after_warm_up_bytes": baseline,
                               "predicted_workspace_bytes": ws, "context_bytes": context,
                               "assumed_context_bytes": card.context if card else None}
    rep.say(f"live before each trial (kept across trials: cuBLAS workspaces etc.): {fb(baseline)}, against "
            f"{fb(ws) if ws is not None else 'n/a'} of cuBLAS workspaces the card profile predicts; this process's "
            f"CUDA context after the warm-up (NVML used - used before - reserved): "
            f"{fb(context) if context is not None else 'n/a (no NVML)'}, against "
            f"{fb(card.context) if card else 'n/a'} in the profile "
            f"({'measured' if card and card.context_bytes is not None else 'assumed'}); the fake device follows "
            f"{fake.card_text() if fake is not None else 'n/a'}, margin {fake.margin.text() if fake else 'n/a'}")
    rows, data = [], []
    stopped = False
    plans = [(name, mf, scale) for scale in scales for name, mf in models.items()]
    for name, mf, scale in plans:
        if stopped:
            break
        b, t = scale * (batch or mf.defaults.get("batch", 32)), mf.defaults.get("context", 512)
        for rung, keys in rungs:
            plan = Plan(b, t, **keys)
            prec, ckpt = plan.precision, plan.activation_checkpointing
            label = rung if rung.startswith(("bf16-true", "+")) else f"{prec}{'+ckpt' if ckpt else ''}"
            row = {"model": name, "rung": rung, "precision": prec, "checkpointing": ckpt, "batch": b, "context": t,
                   "plan": plan.describe()}
            try:
                check_time(deadline)
                live_before = cuda.live_bytes()
                real = run_trial(mf, plan, cuda, steps=2)
                est = run_trial(mf, plan, fake, steps=2) if fake is not None else None
                cpu_est = run_trial(mf, plan, cpu_rules, steps=2) if cpu_rules is not None else None
            except TimeBox:
                rep.problem("time box hit in the memory table")
                rows.append([name, label, f"{b}x{t}", "time box"] + [""] * (len(MEMORY_HEADER) - 4))
                data.append(row | {"error": "time box"})
                stopped = True
                break
            except Exception as e:  # noqa: BLE001 - a broken row is reported, the others still run
                rep.problem(f"{name} {label}: {type(e).__name__}")
                rows.append([name, label, f"{b}x{t}", f"error: {type(e).__name__}: {str(e)[:80]}"]
                            + [""] * (len(MEMORY_HEADER) - 4))
                data.append(row | {"error": f"{type(e).__name__}: {e}"})
                continue
            if real.oom:
                rep.problem(f"{name} {label}: real OOM")
            fake_t = None if est is None or est.oom else est.peak_allocated_bytes  # tensors only
            cpu_t = None if cpu_est is None or cpu_est.oom else cpu_est.peak_allocated_bytes  # CPU rules, tensors
            fake_m = None if est is None or est.oom else est.peak_bytes  # context + modelled reserved
            fake_txt = fake_missing or ("OOM" if est.oom else fb(fake_t))
            modelled = None if est is None or est.oom else est.modelled_reserved_bytes  # the allocator model
            # the fake device starts from nothing; the real peak includes what was live before (workspaces)
            own = real.peak_allocated_bytes - live_before if real.peak_allocated_bytes is not None else None
            # a stand-in device's own peak holds its card's context: its reserved is its allocator model's
            reserved = real.peak_bytes if cuda.kind == "cuda" else real.modelled_reserved_bytes
            on_card = reserved + context if reserved is not None and context is not None else None
            rows.append([name, label, f"{b}x{t}", fb(cpu_t), fake_txt, fb(real.peak_allocated_bytes), fb(own),
                         pct(fake_t, own), fake_missing or fb(modelled), fb(reserved), pct(modelled, reserved),
                         fake_missing or fb(fake_m), fb(on_card), pct(fake_m, on_card),
                         "OOM" if real.oom else f"{real.tokens_per_s:,.0f}" if real.tokens_per_s else "-"])
            data.append(row | {"fake_tensor_peak_bytes": fake_t, "fake_peak_with_margin_bytes": fake_m,
                               "fake_cpu_rules_tensor_peak_bytes": cpu_t,
                               "fake_missing": fake_missing, "real_max_allocated_bytes": real.peak_allocated_bytes,
                               "real_live_before_bytes": live_before,
                               "real_max_allocated_less_live_before_bytes": own,
                               "real_max_reserved_bytes": reserved, "fake_modelled_reserved_bytes": modelled,
                               "real_reserved_plus_context_bytes": on_card,
                               "real_oom": real.oom, "real_host_peak_bytes": real.host_peak_bytes,
                               "fake_host_peak_bytes": None if est is None else est.host_peak_bytes,
                               "real_tokens_per_s": real.tokens_per_s, "real_phase_peaks": real.phase_peaks})
    rep.say(md_table(MEMORY_HEADER, rows))
    rep.say("error = (fake - real) / real. The fake device follows the card's rules (CUDA autocast, its SDPA and "
            "dropout kernels); the CPU-rules column is the same fake trial without them, for comparison. The fake "
            "tensor peak is compared with the real max allocated less what was live just before that trial "
            "(workspaces kept across trials). The allocator model (the caching allocator's rules replayed over the "
            "fake trial's storages, seeded with the predicted cuBLAS workspaces) is compared with the real max "
            "reserved, and the fake peak (the profile's context + that) with the real reserved peak plus the "
            "measured context (n/a without NVML).")
    points = [(r["fake_tensor_peak_bytes"], r["real_reserved_plus_context_bytes"]) for r in data
              if r.get("fake_tensor_peak_bytes") and r.get("real_reserved_plus_context_bytes") and not r["real_oom"]]
    fit = implied_margin(points)
    if fit is not None:
        worst = max((c - t) - (fit[0] + fit[1] * t) for t, c in points)
        rep.say(f"margin these {len(points)} rows imply (least squares, card - tensors = fixed + pct x tensors): "
                f"{fb(int(fit[0]))} + {fit[1] * 100:.1f}%; the worst row is {fb(int(worst))} above that line "
                f"(the card's own margin is the context plus the allocator model, per trial)")
    rep.data["memory"] = {"baseline_allocated_bytes": baseline, "fake_missing": fake_missing, "rows": data,
                          "implied_margin": {"fixed_bytes": int(fit[0]), "pct": fit[1],
                                             "points": len(points)} if fit else None}
    return context


# -- 4. kernels the fake device follows the CPU for ----------------------------------------------------------------

LSTM_SHAPES = ((8, 64, 128, 128, 2), (32, 128, 256, 256, 2))  # batch, steps, input, hidden, layers


def rnn_buffer_bytes(torch, device: str, shape: tuple, dtype) -> int:
    """What nn.LSTM keeps for its backward beyond tensors the meta kernels size: on the CPU oneDNN's workspaces
    (aten.mkldnn_rnn_layer's fourth output, per layer), on CUDA cuDNN's reserve space (aten._cudnn_rnn's fourth)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    ops = {"cpu": "mkldnn_rnn_layer", "cuda": "_cudnn_rnn"}
    seen = []

    class Spy(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if func.__name__.split(".")[0] == ops[device] and out[3] is not None:
                seen.append(out[3].untyped_storage().nbytes())
            return out

    batch, steps, width, hidden, layers = shape
    lstm = torch.nn.LSTM(width, hidden, num_layers=layers, batch_first=True).to(device, dtype)
    x = torch.randn(batch, steps, width, device=device, dtype=dtype, requires_grad=True)
    with Spy():
        lstm(x)
    return sum(seen)


def kernel_table(rep: Report, torch) -> None:
    """cuDNN's LSTM reserve space against the oneDNN workspace both simulated devices count in its place, and
    whether CUDA's grouped matmul takes fp32 (the fake device follows the CPU's, which does)."""
    from oomtune.units import format_bytes as fb

    rep.say("## kernels the fake device follows the CPU for")
    rows, data = [], []  # (fp32: the CPU's oneDNN LSTM under autocast is another question)
    for shape in LSTM_SHAPES:
        cpu = rnn_buffer_bytes(torch, "cpu", shape, torch.float32)
        cuda = rnn_buffer_bytes(torch, "cuda", shape, torch.float32)
        rows.append(["x".join(map(str, shape)), fb(cpu), fb(cuda), pct(cpu, cuda)])
        data.append({"shape": shape, "onednn_bytes": cpu, "cudnn_reserve_bytes": cuda})
    rep.say(md_table(["fp32 LSTM batch x steps x input x hidden x layers", "oneDNN workspace (counted)",
                      "cuDNN reserve (real)", "error"], rows))
    try:
        a, b = torch.randn(64, 32, device="cuda"), torch.randn(4, 32, 16, device="cuda")
        torch._grouped_mm(a, b, offs=torch.tensor([16, 32, 48, 64], device="cuda", dtype=torch.int32))
        grouped = "runs"
    except Exception as e:  # noqa: BLE001 - what it says is the finding
        grouped = f"raises {type(e).__name__}: {str(e).splitlines()[0][:120]}"
    rep.say(f"fp32 torch._grouped_mm on cuda: {grouped}")
    rep.data["kernels"] = {"lstm": data, "grouped_mm_fp32": grouped}
