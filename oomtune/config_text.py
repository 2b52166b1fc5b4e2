"""Keeping a hand-edited `train:` section word for word (comments, spacing, order) when oomtune rewrites a config."""

from __future__ import annotations

import re

_TRAIN = re.compile(r"train\s*:")
_TOP_LEVEL = re.compile(r"[^\s#]")  # a line that starts a top-level key (or a YAML marker), not a comment


def _block(lines: list[str], key: re.Pattern) -> tuple[int, int] | None:
    """[start, end) of the top-level block whose first line matches `key`; column-0 comments and blank lines at its
    end belong to what follows."""
    start = next((i for i, line in enumerate(lines) if key.match(line)), None)
    if start is None:
        return None
    end = next((j for j in range(start + 1, len(lines)) if _TOP_LEVEL.match(lines[j])), len(lines))
    while end - 1 > start and (not lines[end - 1].strip() or lines[end - 1].startswith("#")):
        end -= 1
    return start, end


def keep_train_text(old_text: str, new_text: str) -> str:
    """`new_text` with its train: block replaced by the one in `old_text`, where that changes no value (the whole
    file parses to the same data either way); else `new_text` unchanged."""
    import yaml

    old_lines, new_lines = old_text.splitlines(keepends=True), new_text.splitlines(keepends=True)
    old_block, new_block = _block(old_lines, _TRAIN), _block(new_lines, _TRAIN)
    if old_block is None or new_block is None:
        return new_text
    kept = old_lines[old_block[0]:old_block[1]]
    if kept and not kept[-1].endswith("\n"):
        kept[-1] += "\n"
    spliced = "".join(new_lines[:new_block[0]] + kept + new_lines[new_block[1]:])
    try:
        same = yaml.safe_load(spliced) == yaml.safe_load(new_text)
    except yaml.YAMLError:
        same = False
    return spliced if same else new_text
