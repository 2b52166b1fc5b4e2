"""Keeping a hand-edited config's text (comments, spacing, order) when oomtune rewrites it: every top-level section
whose values the rewrite does not change stays word for word."""

from __future__ import annotations

import re

_KEY = re.compile(r"([A-Za-z_][\w.-]*)\s*:(\s|$)")  # a top-level key at column 0
_TOP_LEVEL = re.compile(r"[^\s#]")  # a line that starts a top-level key (or a YAML marker), not a comment


def _blocks(lines: list[str]) -> dict[str, tuple[int, int, int]]:
    """Top-level key -> (lead, start, end): lines [start, end) hold the key's block, [lead, start) the column-0
    comments right above it (none for the file's first key: those are the file's header, which oomtune writes).
    Comments and blank lines at a block's end belong to what follows. A key seen twice is left out (not YAML
    oomtune can keep)."""
    found: dict[str, tuple[int, int, int]] = {}
    seen: set[str] = set()
    starts = [i for i, line in enumerate(lines) if _TOP_LEVEL.match(line)]
    for n, start in enumerate(starts):
        m = _KEY.match(lines[start])
        if not m:
            continue
        end = starts[n + 1] if n + 1 < len(starts) else len(lines)
        while end - 1 > start and (not lines[end - 1].strip() or lines[end - 1].startswith("#")):
            end -= 1
        lead = start
        while n > 0 and lead - 1 >= 0 and lines[lead - 1].startswith("#"):
            lead -= 1
        key = m[1]
        if key in seen:
            found.pop(key, None)
        else:
            found[key] = (lead, start, end)
        seen.add(key)
    return found


def keep_unchanged_text(old_text: str, new_text: str) -> str:
    """`new_text` with each top-level block that `old_text` also has, and whose values are the same, taken from
    `old_text` as written (with the comments right above it); a block whose values differ is `new_text`'s. The
    result always parses to exactly what `new_text` does."""
    import yaml

    try:
        want = yaml.safe_load(new_text)
    except yaml.YAMLError:
        return new_text
    old_lines = old_text.splitlines(keepends=True)
    if old_lines and not old_lines[-1].endswith("\n"):
        old_lines[-1] += "\n"
    old_blocks = _blocks(old_lines)
    text = new_text
    for key in list(_blocks(new_text.splitlines(keepends=True))):
        if key not in old_blocks:
            continue
        lines = text.splitlines(keepends=True)
        lead, start, end = _blocks(lines)[key]
        o_lead, o_start, o_end = old_blocks[key]
        spliced = "".join(lines[:lead] + old_lines[o_lead:o_end] + lines[end:])
        try:
            same = yaml.safe_load(spliced) == want
        except yaml.YAMLError:
            same = False
        if same:
            text = spliced
    return text
