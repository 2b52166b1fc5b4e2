"""Stopping `oomtune train` on Ctrl-C / SIGTERM: after the step in flight, with a checkpoint."""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from collections.abc import Iterator

from ..dist.group import Dist


class StopRequest:
    """Set by the handler: the name of the signal that asked the run to stop, None until one did."""

    def __init__(self) -> None:
        self.signal_name: str | None = None
        self.forced = False  # a second one came: stop at once (whatever error its KeyboardInterrupt turned into)

    def agreed(self, dist: Dist) -> str | None:
        """The signal every rank stops on: one reaches the ranks at different moments, all stop after the same
        step."""
        if dist.world_size == 1:
            return self.signal_name
        return (self.signal_name or "SIGTERM") if dist.max(1 if self.signal_name else 0)[0] else None


@contextlib.contextmanager
def graceful_stop() -> Iterator[StopRequest]:
    """SIGINT / SIGTERM ask the loop to stop after the step in flight and save a checkpoint; a second one
    stops at once (KeyboardInterrupt; the last checkpoint on disk stays whole). Main thread only."""
    request = StopRequest()
    if threading.current_thread() is not threading.main_thread():
        yield request
        return
    # under torchrun one Ctrl-C arrives twice (from the terminal and from the agent): one request, not two
    same_request_s = 1.0 if "TORCHELASTIC_RUN_ID" in os.environ else 0.0
    first = [0.0]

    def handler(signum, frame):
        if request.signal_name is not None:
            if time.monotonic() - first[0] < same_request_s:
                return
            request.forced = True
            raise KeyboardInterrupt
        request.signal_name = signal.Signals(signum).name
        first[0] = time.monotonic()

    previous = {s: signal.signal(s, handler) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield request
    finally:
        for s, h in previous.items():
            signal.signal(s, h)
