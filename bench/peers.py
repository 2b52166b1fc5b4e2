"""The peers, run with their own code on oomtune's `cpu` device: real compute, simulated memory.

- Accelerate: `accelerate.utils.find_executable_batch_size`, starting from the target batch, around the training
  loop Accelerate's docs show (an `Accelerator`, `prepare`, `accelerator.backward`, `clip_grad_norm_`).
- Lightning: `Tuner.scale_batch_size` in `power` and `binsearch` mode around a LightningModule that wraps the
  same model file (its loss hook, its optimizer hook = AdamW, fp32, gradient clipping by norm 1.0).

Both loops run while the device's MemoryTracker is active and with every tensor the model owns tracked, so a
step that passes the budget raises `torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate ...")`
inside the peer's own loop, and the peer's own check decides it is an OOM: Lightning's `is_oom_error`
(a RuntimeError whose single argument contains "CUDA" and "out of memory") and Accelerate's
`should_reduce_batch_size` (a RuntimeError whose single argument contains " out of memory.").
`oom_recognised()` checks that against the installed versions before a run.

What is counted, the same way for every contender: a trial is one attempt at one batch size (a Lightning
`loop.run()`, one call of Accelerate's decorated function); a step is a training step started (a forward
pass begun), whether it finished or ran out of memory.
"""

from __future__ import annotations

import contextlib
import logging
import tempfile
import time
import warnings
from dataclasses import dataclass, field

import torch

from oomtune.config.schema import TrainConfig
from oomtune.memory.devices import CpuDevice
from oomtune.memory.tracker import simulated_oom_message
from oomtune.model_file import ModelFile

STEPS_PER_TRIAL = 2  # as oomtune's trials: the peak needs the optimizer state, which the first step creates


@dataclass
class PeerResult:
    contender: str
    found: int | None  # the batch size the peer returned
    attempts: list[tuple[int, bool]] = field(default_factory=list)  # (batch size, ran without OOM) in order
    steps: int = 0
    seconds: float = 0.0
    oom_where: dict[int, str] = field(default_factory=dict)  # attempt index -> where its OOM struck (Lightning)
    phase: str | None = None  # where the running attempt is (Lightning's hooks say)

    @property
    def trials(self) -> int:
        return len(self.attempts)


def oom_recognised() -> dict[str, bool]:
    """Does each peer's own OOM check accept the error the tracker raises? (Checked, not assumed.)"""
    err = torch.cuda.OutOfMemoryError(simulated_oom_message(1 << 20, 8 << 20, 7 << 20, "cpu"))
    out = {}
    with contextlib.suppress(ImportError):
        from lightning.pytorch.utilities.memory import is_oom_error

        out["lightning"] = bool(is_oom_error(err))
    with contextlib.suppress(ImportError):
        from accelerate.utils.memory import should_reduce_batch_size

        out["accelerate"] = bool(should_reduce_batch_size(err))
    return out


def _train_defaults() -> tuple[float, float | None]:
    t = TrainConfig()  # oomtune's trial uses the trainer's lr and clipping: so do the peers
    return t.lr, t.clip_grad_norm


# -- Accelerate ----------------------------------------------------------------------------------------------


def run_accelerate(model_file: ModelFile, batch: int, context: int, budget: str,
                   steps: int = STEPS_PER_TRIAL) -> PeerResult:
    """`find_executable_batch_size(starting_batch_size=batch)`: on an OOM it retries at int(0.9 x size)."""
    from accelerate import Accelerator
    from accelerate.utils import find_executable_batch_size

    lr, clip = _train_defaults()
    device = CpuDevice(budget)
    accelerator = Accelerator(cpu=True, mixed_precision="no")
    result = PeerResult("accelerate", None)

    @find_executable_batch_size(starting_batch_size=batch)
    def train(batch_size):
        result.attempts.append((batch_size, False))
        accelerator.free_memory()  # drop the previous attempt's prepared model/optimizer, as Accelerate's docs do
        with device.tracker:  # the simulated GPU: everything built below lives in it
            model = model_file.build()
            optimizer = model_file.optimizer([p for p in model.parameters() if p.requires_grad], lr)
            model, optimizer = accelerator.prepare(model, optimizer)
            model.train()
            for _ in range(steps):
                result.steps += 1
                micro = model_file.batch(batch_size, context, accelerator.device)
                loss = model_file.loss(model, micro)
                accelerator.backward(loss)
                if clip is not None:
                    accelerator.clip_grad_norm_(model.parameters(), clip)
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                del micro, loss
        result.attempts[-1] = (batch_size, True)
        return batch_size

    start = time.perf_counter()
    try:
        result.found = train()
    except RuntimeError as e:  # "No executable batch size found, reached zero."
        if "reached zero" not in str(e):
            raise
    finally:
        accelerator.free_memory()
    result.seconds = time.perf_counter() - start
    return result


# -- Lightning -----------------------------------------------------------------------------------------------

DATASET_LEN = 1 << 20  # indices; batches are made lazily, so length costs nothing and never caps the search


def _lightning_module(model_file: ModelFile, context: int, result: PeerResult):
    import lightning.pytorch as pl
    from torch.utils.data import DataLoader

    lr, _ = _train_defaults()

    class ModelFileModule(pl.LightningModule):
        """The model file as a LightningModule: its loss, its optimizer hook, the batch its make_batch makes."""

        def __init__(self):
            super().__init__()
            self.model = model_file.build()
            self.batch_size = 2  # Lightning's tuner reads and writes this attribute

        def train_dataloader(self):
            make = lambda idx: model_file.batch(len(idx), context, torch.device("cpu"))  # noqa: E731
            return DataLoader(range(DATASET_LEN), batch_size=self.batch_size, collate_fn=make)

        def on_train_start(self):  # once per loop.run(): once per trial
            _close_attempt(result)
            result.attempts.append((self.batch_size, False))

        def on_train_end(self):  # reached only when the loop finished without an OOM
            result.attempts[-1] = (result.attempts[-1][0], True)

        def training_step(self, micro, batch_idx):
            result.steps += 1
            alive = any(p.grad is not None for p in self.model.parameters())
            result.phase = "forward, previous gradients alive" if alive else "forward"
            return model_file.loss(self.model, micro)

        def on_before_backward(self, loss):
            result.phase = "backward"

        def on_before_optimizer_step(self, optimizer):
            result.phase = "optimizer step"

        def configure_optimizers(self):
            return model_file.optimizer([p for p in self.model.parameters() if p.requires_grad], lr)

    return ModelFileModule()


def _close_attempt(result: PeerResult) -> None:
    """The previous attempt ran out of memory if it never finished: note where (the last hook it passed)."""
    if result.attempts and not result.attempts[-1][1]:
        result.oom_where[len(result.attempts) - 1] = result.phase or "set-up"
    result.phase = None


def _run_loop_on(device: CpuDevice, trainer) -> None:
    """Each trial's training (the fit loop's `run`, which the tuner calls once per batch size) runs on the
    simulated GPU; the tuner's bookkeeping between trials runs on the host, as it would next to a real GPU.
    Needed because on CPU Lightning's host-side tensors would count as GPU memory: its OOM handler makes one
    (`has_len_all_ranks`, 512 B) while the failed trial's tensors are still held by the exception, and that
    re-raised the OOM out of the tuner. Accelerate's decorated function enters the tracker the same way."""
    loop = trainer.fit_loop
    run = loop.run

    def run_on_device():
        with device.tracker:
            return run()

    loop.run = run_on_device


def run_lightning(model_file: ModelFile, context: int, budget: str, mode: str,
                  steps: int = STEPS_PER_TRIAL) -> PeerResult:
    """`Tuner(trainer).scale_batch_size(module, mode=mode)` from Lightning's default start (init_val=2), with
    margin=0 in binsearch (its default 0.05 shaves 5% off the answer: a headroom, which no contender gets
    here; see RESULTS.md)."""
    import lightning.pytorch as pl
    from lightning.pytorch.tuner import Tuner

    _, clip = _train_defaults()
    result = PeerResult(f"lightning-{mode}", None)
    device = CpuDevice(budget)
    for name in ("lightning", "lightning.pytorch", "lightning.fabric"):
        logging.getLogger(name).setLevel(logging.ERROR)
    with tempfile.TemporaryDirectory() as root, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        module = _lightning_module(model_file, context, result)
        trainer = pl.Trainer(
            accelerator="cpu", devices=1, precision="32-true", max_epochs=1, default_root_dir=root,
            logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
            num_sanity_val_steps=0, gradient_clip_val=clip, gradient_clip_algorithm="norm",
        )
        kwargs = {"margin": 0.0} if mode == "binsearch" else {}
        start = time.perf_counter()
        device.tracker.track(module)  # the weights were built before the tracker started: they count too
        _run_loop_on(device, trainer)
        result.found = Tuner(trainer).scale_batch_size(module, mode=mode, steps_per_trial=steps, **kwargs)
        result.seconds = time.perf_counter() - start
        _close_attempt(result)
        del trainer, module
    device.release()
    return result
