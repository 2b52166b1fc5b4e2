"""Writing a file so that a reader sees the old one or the new one, never half, with the permissions it had."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO


def file_mode(path: Path) -> int:
    """The permissions a file written via a temp file (which mkstemp makes 0600) should get: those of the file
    it replaces, else what a plain open() would give under the umask."""
    try:
        return path.stat().st_mode & 0o7777
    except OSError:
        umask = os.umask(0)
        os.umask(umask)
        return 0o666 & ~umask


def atomic_write(path: str | Path, content: str | Callable[[BinaryIO], None]) -> None:
    """Write via a temp file in the same folder + fsync + rename: a reader sees the old file or the new, never half,
    and a failure (KeyboardInterrupt included) leaves no temp file. `content`: text, or a function writing bytes."""
    p = Path(os.path.realpath(path))  # a symlink's target is what is replaced, and the link stays
    p.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{p.name}.", suffix=".tmp", dir=p.parent)
    try:
        os.fchmod(fd, file_mode(p))
        with os.fdopen(fd, "wb") as f:
            if callable(content):
                content(f)
            else:
                f.write(content.encode())
            f.flush()
            os.fsync(f.fileno())  # the bytes are on disk before the name points at them
        os.replace(tmp, p)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def nearest_existing(path: Path) -> Path:
    """`path` or the nearest folder above it that exists: where its missing folders would be made from."""
    path = Path(path)
    return next(p for p in (path, *path.parents) if os.path.lexists(p))  # a relative path ends at "."


def try_write_in(folder: Path) -> None:
    """Raise OSError unless a file can be made in `folder` (one is made and deleted at once)."""
    fd, probe = tempfile.mkstemp(prefix=".oomtune-write-test.", dir=folder)
    os.close(fd)
    os.unlink(probe)
