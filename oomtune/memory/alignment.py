"""How the traces of a step at k and k+1 repeated blocks line up (memory/repeats.py): each event as a token naming
its storage by where it was born, the runs of periods the trace with one block more has inserted. No torch here."""

from __future__ import annotations

from typing import NamedTuple

from .allocator import rounded
from .replay import Trace

WINDOW = 12  # events that must match after a mismatch for an insertion (or a changed size) to be taken
MIN_AGREE = 4  # ... or at least this many, where another insertion follows closer
Token = tuple  # (kind, value, ref): b birth (raw bytes), r resize (raw), f free (rounded bytes), m mark (phase);
# B, R, F: the same for a storage in host memory
SIZED = "brBR"  # the kinds whose value is a size in raw bytes (a rule in the blocks)


def tokens(trace: Trace) -> list[Token]:
    """The trace's events with each storage named by where it was born: ("i", k) for the k-th storage alive at the
    start (those in host memory after the device's), ("d", d) for the one born d births before the latest."""
    sizes = dict(enumerate((*trace.initial, *trace.host_initial)))
    first = len(sizes)
    born = first
    out: list[Token] = []

    def ref(n: int) -> tuple:
        return ("i", n) if n < first else ("d", born - 1 - n)

    for ev in trace.events:
        kind = ev[0]
        if kind in ("set", "hset"):
            n, raw = ev[1], ev[2]
            if n >= born:
                out.append(("b" if kind == "set" else "B", raw, None))
                born += 1
            else:
                out.append(("r" if kind == "set" else "R", raw, ref(n)))
            sizes[n] = rounded(raw)
        elif kind in ("free", "hfree"):
            out.append(("f" if kind == "free" else "F", sizes.pop(ev[1]), ref(ev[1])))
        else:
            out.append(("m", ev[1], None))
    return out


def token_key(t: Token) -> tuple:
    return t[0], t[1]


def _agree(a: list[Token], i: int, b: list[Token], j: int) -> int:
    """How many events a[i:] and b[j:] agree on in a row, up to WINDOW (or a's end), one of them allowed another size
    (a size that grows a block, as the stack of per-parameter norms that clipping makes)."""
    sized = 0
    for x in range(min(WINDOW, len(a) - i)):
        if j + x >= len(b):
            return x
        ea, eb = a[i + x], b[j + x]
        if token_key(ea) != token_key(eb):
            sized += 1
            if ea[0] != eb[0] or ea[0] not in SIZED or sized > 1:
                return x
    return min(WINDOW, len(a) - i)


def _periodic(b: list[Token], j: int, length: int) -> bool:
    """b[j:j+length] repeats the `length` events before it: the last period of a run (a run's other periods agree
    with the trace of one block fewer)."""
    return j >= length and all(token_key(b[j - length + x]) == token_key(b[j + x]) for x in range(length))


def _inserted(a: list[Token], i: int, b: list[Token], j: int) -> tuple[int, int] | None:
    """The events of b from j on that a lacks, after which a[i:] resumes: (how many, how many then agree). The
    fewest that repeat the period before them (a run's last period) and after which a whole window agrees; else
    (another insertion close behind: a parameter's frees after its norms) after which at least MIN_AGREE do; else
    the fewest after which a window agrees, whether or not they repeat."""
    full = min(WINDOW, len(a) - i)
    partial = plain = None
    for length in range(1, (len(b) - j) - (len(a) - i) + 1):
        agree = _agree(a, i, b, j + length)
        if agree < min(MIN_AGREE, full):
            continue
        if _periodic(b, j, length):
            if agree == full:
                return length, agree
            partial = partial or (length, agree)
        elif agree == full:
            plain = plain or (length, agree)
    return partial or plain


def align(a: list[Token], b: list[Token]) -> list[tuple] | None:
    """How `b` (one block more) is `a` with periods inserted: ("eq", i, j) pairs, ("sub", i, j) pairs whose size
    differs, ("ins", j, length) runs of b that a lacks. None where they do not line up so."""
    ops: list[tuple] = []
    i = j = 0
    while i < len(a) or j < len(b):
        if i < len(a) and j < len(b) and token_key(a[i]) == token_key(b[j]):
            ops.append(("eq", i, j))
            i, j = i + 1, j + 1
            continue
        if i < len(a) and j < len(b) and a[i][0] == b[j][0] and a[i][0] in SIZED \
                and _agree(a, i + 1, b, j + 1) == min(WINDOW, len(a) - i - 1):
            ops.append(("sub", i, j))
            i, j = i + 1, j + 1
            continue
        found = _inserted(a, i, b, j)
        if found is None:
            return None
        ops.append(("ins", j, found[0]))
        j += found[0]
        for _ in range(found[1]):  # what agrees after it, a changed size included
            ops.append(("eq" if token_key(a[i]) == token_key(b[j]) else "sub", i, j))
            i, j = i + 1, j + 1
    return ops


class Run(NamedTuple):
    """Periods of events repeated once per block: `start` in the trace with k+1 blocks, `length` events a period,
    `n + offset` periods at n blocks. (A tuple: each event's slot, hashed once per event, hashes in C.)"""

    start: int
    length: int
    offset: int


def runs_of(b: list[Token], ops: list[tuple], k: int) -> list[Run] | None:
    """The runs of `b` (k+1 blocks) that end with each inserted period (a run's last: the ones before it lined up
    with the trace of one block fewer): the period and up to k more repeating it before, not reaching into the
    run before."""
    found: list[Run] = []
    for op in ops:
        if op[0] != "ins":
            continue
        j, length = op[1], op[2]
        floor = found[-1].start + found[-1].length * (found[-1].offset + k + 1) if found else 0
        if j < floor:
            return None  # an insertion inside the run before: not a layout of repeated blocks
        start = j
        while (j - start) // length < k and start - length >= floor and _periodic(b, start, length):
            start -= length
        found.append(Run(start, length, (j - start) // length - k))
    return found
