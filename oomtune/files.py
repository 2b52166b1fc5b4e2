"""Writing a file so that a reader sees the old one or the new one, never half, with the permissions it had."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path


def file_mode(path: Path) -> int:
    """The permissions a file written via a temp file (which mkstemp makes 0600) should get: those of the file
    it replaces, else what a plain open() would give under the umask."""
    try:
        return path.stat().st_mode & 0o7777
    except OSError:
        umask = os.umask(0)
        os.umask(umask)
        return 0o666 & ~umask


def atomic_write(path: str | Path, text: str) -> None:
    """Write via a temp file in the same folder + rename: a reader sees the old file or the new, never half."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{p.name}.", suffix=".tmp", dir=p.parent)
    try:
        os.fchmod(fd, file_mode(p))
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, p)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
