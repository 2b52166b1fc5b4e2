"""Independent traced measurements run side by side, each in a forked copy of this process, on the machine's other
cores: the fewer-block trials a made trial needs and the floors a rung's is made from (Fanned: extrapolate.py,
rung_floors.py), and a rung's micro-batch 1 while its target is traced (Ahead: replayed_trials.py). A fake-tensor
trace computes nothing and shares nothing with the next: run in a copy, it records the events it would record here,
and its result comes back pickled. The caller gets each task's result as if it had run the task here; whatever a
copy cannot do (no fork on this platform, one core, CUDA started in this process, no process or pipe left, a result
that does not pickle, a copy that dies or takes far longer than the task run here beside it) is run here instead,
so a copy is never the cause of an answer, only of its speed.

A copy runs with no output (its stdout and stderr go nowhere: a progress display's thread may hold their locks at
the fork), one torch thread, and leaves by os._exit (no exit handlers, no flush of buffers it inherited)."""

from __future__ import annotations

import contextlib
import logging
import os
import pickle
import select
import signal
import sys
import time
import warnings
from collections.abc import Callable
from typing import TypeVar

import torch

from ..errors import BAD_INPUT, OomtuneError

T = TypeVar("T")

PROCESSES: int | None = None  # the cores to count on (None: OOMTUNE_PROCESSES, else those this process may run
# on); below 2: no copies
ENV = "OOMTUNE_PROCESSES"  # the user's cap (1: no copies), for a machine shared with other work
SLOWER = 20.0  # a copy that runs this many times longer than the task run here (and past MIN_WAIT) is given up on
MIN_WAIT = 120.0  # seconds

_IN_COPY: list[bool] = []  # inside a copy: it fans out no further
_RUNNING: set[int] = set()  # copies started and not yet waited for


def cores() -> int:
    """The processes to count on: OOMTUNE_PROCESSES where set (a positive integer), else this process's cores."""
    told = os.environ.get(ENV, "").strip()
    if told:
        if not told.isdigit() or int(told) < 1:
            raise OomtuneError(f"{ENV}={told!r}: expected a whole number of processes, 1 or more (1: no copies)",
                               BAD_INPUT)
        return int(told)
    with contextlib.suppress(AttributeError, OSError):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def can_fan_out() -> bool:
    """Copies can run here: fork exists (Linux), two or more cores, not inside a copy, CUDA not started (a forked
    process cannot use it, and its state would be shared)."""
    wanted = cores() if PROCESSES is None else PROCESSES
    return (sys.platform == "linux" and hasattr(os, "fork") and wanted >= 2 and not _IN_COPY
            and not torch.cuda.is_initialized())


class Fanned:
    """Each task's result, fetched in order with `result(i)`, as if the tasks ran here one after another, each when
    first fetched (a caller that stops at a failed one runs no more). The first runs here alone: it fills the
    caches every later one reads (FakeTensor's dispatch cache, the first-of-their-kind calls: made_calls.py), which
    copies made before it would each fill again. Fetching the second then starts every task between the first and
    the last in a copy, where copies can run and `ready()` says so (called just before: it may prepare for them),
    runs the last here, and takes the copies' results. `warm`: the caches are filled already (an earlier run of
    tasks of the same kind), so the first too starts in a copy, at the first fetch, and no core waits for it.
    `handed` (run in a copy after its task) gives state the task changed there that this process must keep (a
    check's verdict); `take` (run here) merges it. A task whose copy failed runs here when fetched."""

    def __init__(self, tasks: list[Callable[[], T]], handed: Callable[[], object] | None = None,
                 take: Callable[[object], None] | None = None, ready: Callable[[], bool] = lambda: True,
                 warm: bool = False):
        self.tasks = tasks
        self.handed, self.take, self.ready = handed, take, ready
        self.warm = warm
        self.done: dict[int, T] = {}
        self.copies: list[tuple[int, int] | None] = []  # (None: one that could not start)

    def result(self, i: int) -> T:
        first = 0 if self.warm and not self.done else 1  # the tasks before it have run here, alone
        if i not in self.done and sorted(self.done) == list(range(first)) and len(self.tasks) > first + 1 \
                and can_fan_out() and self.ready():
            self._side_by_side(first)
        if i not in self.done:
            self.done[i] = self.tasks[i]()
        return self.done[i]

    def __enter__(self) -> Fanned:
        return self

    def __exit__(self, *exc) -> None:
        """Copies whose results were never taken are stopped (after an error here)."""
        copies, self.copies = self.copies, []
        for copy in copies:
            _stop(copy, close=True)

    def _side_by_side(self, first: int) -> None:
        self.copies = [_start(task, self.handed) for task in self.tasks[first:-1]]
        start = time.perf_counter()
        self.done[len(self.tasks) - 1] = self.tasks[-1]()
        deadline = start + max(MIN_WAIT, SLOWER * (time.perf_counter() - start))
        copies, self.copies = self.copies, []
        pending = list(enumerate(copies, start=first))
        try:
            while pending:
                i, copy = pending.pop(0)
                got = _finish(copy, deadline)  # (its pipe closed)
                if got is not None:
                    value, state = got
                    if self.take is not None and state is not None:
                        self.take(state)
                    self.done[i] = value
        finally:
            for _, copy in pending:  # (an error here: those not reached)
                _stop(copy, close=True)
            for copy in copies:  # (any still running: given up on)
                _stop(copy)


class Ahead:
    """One task run ahead in a copy while this process goes on (a trial the search will most likely ask for next):
    `result()` waits for it (and runs the task here where the copy failed, or where no copy could start); `drop()`
    stops a copy whose result is not wanted. `handed`/`take` as for Fanned."""

    def __init__(self, task: Callable[[], T], handed: Callable[[], object] | None = None,
                 take: Callable[[object], None] | None = None):
        self.task, self.take = task, take
        self.started = time.perf_counter()
        self.copy = _start(task, handed) if can_fan_out() else None

    def result(self) -> T:
        copy, self.copy = self.copy, None
        if copy is not None:
            now = time.perf_counter()
            try:
                got = _finish(copy, now + max(MIN_WAIT, SLOWER * (now - self.started)))
            finally:
                _stop(copy)
            if got is not None:
                value, state = got
                if self.take is not None and state is not None:
                    self.take(state)
                return value
        return self.task()

    def drop(self) -> None:
        copy, self.copy = self.copy, None
        _stop(copy, close=True)


def _start(task: Callable[[], T], handed: Callable[[], object] | None) -> tuple[int, int] | None:
    """(the copy's process id, the pipe its result comes by), or None where no copy could start (no pipes, no
    processes left: the task then runs here)."""
    try:
        read, write = os.pipe()
    except OSError:
        return None
    try:
        pid = os.fork()
    except OSError:
        os.close(read)
        os.close(write)
        return None
    if pid:
        os.close(write)
        _RUNNING.add(pid)
        return pid, read
    os.close(read)  # the copy: run the task, send (value, state), leave
    code = 1
    try:
        _IN_COPY.append(True)
        _quiet()
        value = task()
        data = pickle.dumps((value, handed() if handed is not None else None), protocol=pickle.HIGHEST_PROTOCOL)
        with os.fdopen(write, "wb") as f:
            f.write(data)
        code = 0
    except BaseException:  # noqa: BLE001 - whatever it is, the task runs again in the parent
        pass
    finally:
        os._exit(code)


def _quiet() -> None:
    """A copy's output goes nowhere, its warnings and logs too; SIGINT is the parent's to act on."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    null = os.open(os.devnull, os.O_WRONLY)
    for fd in (1, 2):
        os.dup2(null, fd)
    sys.stdout = sys.stderr = open(os.devnull, "w")  # noqa: SIM115 - for the copy's life
    warnings.simplefilter("ignore")
    logging.disable(logging.CRITICAL)
    torch.set_num_threads(1)


def _finish(copy: tuple[int, int] | None, deadline: float) -> tuple | None:
    """(value, state) a copy sent, or None where it failed, passed the deadline (_stop it then) or never started.
    The copy is waited for here, once it has sent all."""
    if copy is None:
        return None
    pid, read = copy
    chunks = []
    try:
        while True:
            left = deadline - time.perf_counter()
            if left <= 0 or not select.select([read], [], [], left)[0]:
                return None
            chunk = os.read(read, 1 << 20)
            if not chunk:
                break
            chunks.append(chunk)
    finally:
        os.close(read)
    _, status = os.waitpid(pid, 0)
    _RUNNING.discard(pid)
    if status != 0 or not chunks:
        return None
    try:
        return pickle.loads(b"".join(chunks))
    except Exception:  # noqa: BLE001 - run here instead
        return None


def _stop(copy: tuple[int, int] | None, close: bool = False) -> None:
    """A copy not yet waited for is killed and waited for (one waited for is left alone: its number may be another
    process's now); `close`: its pipe too (where _finish did not)."""
    if copy is None:
        return
    pid, read = copy
    if close:
        with contextlib.suppress(OSError):
            os.close(read)
    if pid not in _RUNNING:
        return
    _RUNNING.discard(pid)
    with contextlib.suppress(ChildProcessError, ProcessLookupError):
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
