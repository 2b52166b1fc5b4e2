"""Byte sizes: parse '24GiB' / '80%' / '1.5GB', format 1234567 -> '1.18 MiB'; and the one timestamp oomtune writes
(UTC, whole seconds, ISO 8601). No torch."""

from __future__ import annotations

import datetime as dt
import re
from typing import TYPE_CHECKING

from .errors import OomtuneError, shown

if TYPE_CHECKING:
    from .memory.cards import GpuSpec

_UNITS = {
    "": 1, "b": 1,
    "k": 1000, "kb": 1000, "m": 1000**2, "mb": 1000**2, "g": 1000**3, "gb": 1000**3, "t": 1000**4, "tb": 1000**4,
    "kib": 1024, "mib": 1024**2, "gib": 1024**3, "tib": 1024**4,
}
BARE_BYTES_FLOOR = 1024  # a budget given as a bare number below this is a unit left out
MAX_BUDGET = 1024**6  # 1 EiB: more than any device, far less than a float's range
_SIZE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*$")


def parse_budget(text: str, capacity_bytes: int | None = None) -> int:
    """'24GiB' -> bytes; '80%' -> 80% of capacity_bytes (the device's memory)."""
    s = str(text).strip()
    if s.endswith("%"):
        try:
            pct = float(s[:-1])
        except ValueError:
            raise OomtuneError(f"budget {shown(text)}: expected a size like 24GiB or a percentage like 80%") from None
        if not 0 < pct <= 100:
            raise OomtuneError(f"budget {shown(text)}: a percentage must be in (0, 100]")
        if capacity_bytes is None:
            raise OomtuneError(f"budget {shown(text)}: a percentage needs a device whose memory size is known")
        return int(capacity_bytes * pct / 100)
    m = _SIZE.match(s)
    if not m or m.group(2).lower() not in _UNITS:
        raise OomtuneError(f"budget {shown(text)}: expected a size like 24GiB, 512MiB, 1.5GB or a percentage like 80%")
    number = float(m.group(1)) * _UNITS[m.group(2).lower()]
    if not number <= MAX_BUDGET:  # (a 401-digit budget: inf, which int() cannot take)
        raise OomtuneError(f"budget {shown(text)}: more than any device holds (at most 1 EiB)")
    value = int(number)
    if not m.group(2) and 0 < float(m.group(1)) < BARE_BYTES_FLOOR:  # `--budget 24` meant 24 GB, not 24 bytes
        raise OomtuneError(f"budget {shown(text)}: a number without a unit is bytes, and {m.group(1)} bytes hold no "
                           f"model: give the unit ({m.group(1)}GiB, {m.group(1)}GB or {m.group(1)}MiB)")
    if value <= 0:
        raise OomtuneError(f"budget {shown(text)}: must be more than zero bytes")
    return value


def card_budget(budget: str, card: GpuSpec | None, capacity_bytes: int | None = None) -> int:
    """--budget where a card is simulated (--gpu): a size, or a percentage of the card's memory (of `capacity_bytes`
    where the card has none, or there is no card); never more than the card's memory, which it could not give."""
    memory = card.memory_bytes if card is not None else None
    budget_bytes = parse_budget(budget, memory or capacity_bytes)
    if memory is not None and budget_bytes > memory:
        raise OomtuneError(f"--budget {format_bytes(budget_bytes)} is more than the {card.name}'s "
                           f"{format_bytes(memory)}")
    return budget_bytes


def card_memory(card: GpuSpec, gpu: str | None = None) -> int:
    """The budget --gpu means without --budget: the card's memory. The generic card has none (`gpu`: the name the
    user gave)."""
    if card.memory_bytes is None:
        raise OomtuneError(f"--gpu {gpu or card.aliases[0]} has no memory size: give --budget too (e.g. --budget "
                           "24GiB)")
    return card.memory_bytes


def format_bytes(n: int | float | None) -> str:
    """Binary units, three significant-ish digits: 1536 -> '1.50 KiB'."""
    if n is None:
        return "-"
    n = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{int(n)} B" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def counted(n: int, noun: str) -> str:
    """"1 trial", "3 trials": `noun` singular, an s added where n is not 1."""
    return f"{n} {noun}" if n == 1 else f"{n} {noun}s"


def utc_now() -> str:
    """Now, as every file oomtune writes records it: '2026-12-01T10:08:56+00:00'."""
    return dt.datetime.now(dt.timezone.utc).replace(microsecond=0).isoformat()
