"""bench/RESULTS.md is written by several scripts, each owning the block between its markers
`<!-- name:begin -->` and `<!-- name:end -->`; this writes one block and leaves the rest of the file alone."""

from __future__ import annotations

import os
import re
from pathlib import Path

# the blocks other scripts write: (name, the make target that writes it, its heading in RESULTS.md); a target may
# write several (bench-estimate: the estimate and its speed), and `make bench` runs each target once
OTHER_SECTIONS = (("train", "bench-train", "Trainer overhead"), ("estimate", "bench-estimate", "Estimate"),
                  ("estimate-speed", "bench-estimate", "Estimate speed"),
                  ("levers", "bench-levers", "Past accumulation: 7B Llama estimates"),
                  ("autocast", "bench-autocast", "CUDA-faithful estimate"),
                  ("prior", "bench-prior", "The probe from the estimate, by what a device trial costs"),
                  ("published", "bench-published", "Published fine-tuning runs"))


def has_make_target(target: str, root: Path = Path(__file__).resolve().parent.parent) -> bool:
    """Does the repository's Makefile have `target`?"""
    makefile = root / "Makefile"
    return makefile.exists() and re.search(rf"^{re.escape(target)}\s*:", makefile.read_text(), re.M) is not None


def marker(name: str, which: str) -> str:
    return f"<!-- {name}:{which} -->"


def write_section(out: Path, name: str, body: str, heading: str = "") -> None:
    """Replace block `name` in `out` (atomically); append it, under `heading`, when the file has none."""
    begin, end = marker(name, "begin"), marker(name, "end")
    block = f"{begin}\n{body}\n{end}"
    text = out.read_text() if out.exists() else ""
    if begin in text and end in text:
        head, rest = text.split(begin, 1)
        _, tail = rest.split(end, 1)
        text = head + block + tail
    else:
        text = (text.rstrip() + "\n\n" if text.strip() else "# oomtune benchmarks\n\n") + \
            (f"{heading}\n\n" if heading else "") + block + "\n"
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(out.suffix + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, out)
