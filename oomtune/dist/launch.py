"""Start an oomtune command on several ranks with torchrun (torch.distributed.run), and report how it ended.

`oomtune train ... --nproc-per-node N` (and probe) builds a torchrun command line - the launcher options passed
through, then `python -m oomtune <the same command>` - and runs torchrun's agent in this process. The agent
starts N workers per node, stops all of them as soon as one fails, and says which failed first; that worker's
exit code becomes ours. A worker that stopped only because a peer failed (its collective broke or timed out)
exits with PEER_FAILED, so the rank that really failed is the one reported.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import socket
import sys
from dataclasses import dataclass

from ..errors import BAD_INPUT, NO_FIT, OOM_RELAUNCH, PEER_FAILED, OomtuneError

INTERRUPTED = 130
DEFAULT_TIMEOUT_S = 300.0  # a collective waits this long for the other ranks before the run stops with an error
TORCHRUN_ENV = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")  # what torchrun sets in each worker


def launched_by_torchrun() -> bool:
    """True in a worker started by torchrun (or anything that sets its environment variables)."""
    return all(k in os.environ for k in TORCHRUN_ENV)


def worker_rank() -> int | None:
    """This process's rank when torchrun started it, else None."""
    return int(os.environ["RANK"]) if launched_by_torchrun() else None


@dataclass(frozen=True)
class Launch:
    nproc_per_node: int
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int | None = None  # None: a free port (one node), torchrun's 29500 (several)

    def check(self) -> None:
        if self.nproc_per_node < 1:
            raise OomtuneError(f"--nproc-per-node must be at least 1, got {self.nproc_per_node}", BAD_INPUT)
        if self.nnodes < 1:
            raise OomtuneError(f"--nnodes must be at least 1, got {self.nnodes}", BAD_INPUT)
        if not 0 <= self.node_rank < self.nnodes:
            raise OomtuneError(f"--node-rank must be in [0, {self.nnodes - 1}], got {self.node_rank}", BAD_INPUT)
        if self.master_port is not None and not 0 < self.master_port < 65536:
            raise OomtuneError(f"--master-port must be in [1, 65535], got {self.master_port}", BAD_INPUT)

    @property
    def world_size(self) -> int:
        return self.nproc_per_node * self.nnodes


def free_port(addr: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((addr, 0))
        return s.getsockname()[1]


def check_port_free(addr: str, port: int) -> None:
    """The rendezvous store listens on master_addr:master_port on node 0: say so now if something else does."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("" if addr in ("localhost", "127.0.0.1", "0.0.0.0") else addr, port))
        except OSError as e:
            raise OomtuneError(f"--master-port {port} is in use on {addr} ({e.strerror}): another run holds it; "
                               "pass another --master-port (or leave it out on one node: a free one is picked)",
                               BAD_INPUT) from None


def torchrun_args(launch: Launch, worker_args: list[str]) -> list[str]:
    port = launch.master_port
    if port is None:
        port = free_port() if launch.nnodes == 1 else 29500
    return ["--nproc-per-node", str(launch.nproc_per_node), "--nnodes", str(launch.nnodes),
            "--node-rank", str(launch.node_rank), "--master-addr", launch.master_addr, "--master-port", str(port),
            "--max-restarts", "0", "--monitor-interval", "0.1", "-m", "oomtune", *worker_args]


@contextlib.contextmanager
def _quiet_agent():
    """torchrun's agent logs every step of a shutdown; the outcome is reported by `run` instead."""
    log = logging.getLogger("torch.distributed.elastic")
    level = log.level
    log.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        log.setLevel(level)


def describe_failure(rank: int, exitcode: int, pid: int) -> tuple[str, int]:
    """(message, our exit code) for the worker that failed first."""
    if exitcode < 0:
        try:
            name = signal.Signals(-exitcode).name
        except ValueError:
            name = f"signal {-exitcode}"
        return f"rank {rank} (pid {pid}) was killed by {name}; the other ranks were stopped", NO_FIT
    if exitcode == PEER_FAILED:
        return (f"rank {rank} stopped first: a collective with the other ranks broke or timed out (--dist-timeout), "
                "so another rank died or hangs (see above)", NO_FIT)
    code = exitcode if exitcode in (BAD_INPUT, NO_FIT, INTERRUPTED, OOM_RELAUNCH) else NO_FIT
    return f"rank {rank} exited with code {exitcode} (its error is above); the other ranks were stopped", code


def run(launch: Launch, worker_args: list[str]) -> None:
    """Run `python -m oomtune <worker_args>` on every rank of this node; return when all finished, or raise
    OomtuneError (message, exit code) naming the rank that failed first."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import elastic_launch
    from torch.distributed.run import config_from_args, parse_args

    from ..cli.stdio import real_stdout  # (here: the command line imports this module)

    launch.check()
    args = torchrun_args(launch, worker_args)
    if launch.node_rank == 0:
        check_port_free(launch.master_addr, int(args[args.index("--master-port") + 1]))
    config, cmd, cmd_args = config_from_args(parse_args(args))
    if cmd != sys.executable:  # PYTHON_EXEC chooses another interpreter: fine, but ours knows oomtune
        cmd = sys.executable
    try:
        with _quiet_agent(), real_stdout():  # (--json: rank 0 prints it)
            elastic_launch(config, cmd)(*cmd_args)
    except ChildFailedError as e:
        failures = e.failures
        # an FSDP out-of-memory stop (the launcher relaunches), else the first to fail (timestamps are whole
        # seconds: in a tie, a rank's own failure before one that only followed a peer's, or the agent's SIGTERM)
        rank = min(failures, key=lambda r: (failures[r].exitcode != OOM_RELAUNCH, failures[r].timestamp,
                                            failures[r].exitcode in (PEER_FAILED, -signal.SIGTERM), r))
        message, code = describe_failure(rank, failures[rank].exitcode, failures[rank].pid)
        raise OomtuneError(message, code) from None
    except SignalException as e:
        raise OomtuneError(f"stopped by {e.sigval.name}: the ranks were asked to save a checkpoint and stop",
                           INTERRUPTED) from None
