"""Every file oomtune writes goes through here: created inside its own folder with no-follow semantics, so a
symbolic link (or a pipe, a device, a folder) standing where oomtune writes is refused, never written through.

- A whole file (a checkpoint, a config, a snapshot, a rewritten log) is written to a new temp name in the same
  folder (O_CREAT | O_EXCL | O_NOFOLLOW: a name that exists, a link included, is never opened), fsynced, then
  renamed over the final name: a reader sees the old file or the new, never half.
- A log line is appended to a file opened with O_NOFOLLOW | O_NONBLOCK and checked to be a regular file.
- Both open the folder once and work relative to that descriptor, so the folder cannot be swapped mid-write.
"""

from __future__ import annotations

import os
import secrets
import stat
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO

from .errors import BAD_INPUT, OomtuneError

_DIR_FD = os.open in os.supports_dir_fd and os.rename in os.supports_dir_fd  # (os.replace takes them as rename does)
_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_NONBLOCK = getattr(os, "O_NONBLOCK", 0)
_DIRECTORY = getattr(os, "O_DIRECTORY", 0)
_CLOEXEC = getattr(os, "O_CLOEXEC", 0)


class NotAFileError(OomtuneError):
    """Where oomtune writes stands a symbolic link, a pipe, a device or a folder: refused, nothing written."""

    def __init__(self, path: Path, what: str):
        super().__init__(f"{path} is {what}: oomtune writes no file through a link, nor into a pipe, a device or a "
                         "folder (nothing was written); remove it, or choose another path", BAD_INPUT)
        self.path = path


def what_stands(path: str | Path) -> str | None:
    """What stands at `path` that oomtune must not write through (never following a link), else None: None for
    nothing there or a regular file."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return None
    except OSError:
        return None  # (cannot look: the write itself will say why)
    if stat.S_ISREG(st.st_mode):
        return None
    if stat.S_ISLNK(st.st_mode):
        try:
            return f"a symbolic link (to {os.readlink(path)})"
        except OSError:
            return "a symbolic link"
    if stat.S_ISDIR(st.st_mode):
        return "a folder"
    if stat.S_ISFIFO(st.st_mode):
        return "a named pipe"
    if stat.S_ISSOCK(st.st_mode):
        return "a socket"
    return "a device"


def refuse_unless_file(path: str | Path) -> None:
    """NotAFileError where something other than a regular file (a link, a pipe, a device, a folder) stands at
    `path`; nothing there or a regular file is fine."""
    what = what_stands(path)
    if what is not None:
        raise NotAFileError(Path(path), what)


def file_mode(path: Path) -> int:
    """The permissions a file written via a temp file (made 0600) should get: those of the regular file it
    replaces, else what a plain open() would give under the umask."""
    try:
        st = os.lstat(path)
        if stat.S_ISREG(st.st_mode):
            return st.st_mode & 0o7777
    except OSError:
        pass
    umask = os.umask(0)
    os.umask(umask)
    return 0o666 & ~umask


class _Folder:
    """A folder opened once (its descriptor), names resolved relative to it: no path above it is read again."""

    def __init__(self, folder: Path):
        self.path = folder
        self.fd = os.open(folder, os.O_RDONLY | _DIRECTORY | _CLOEXEC) if _DIR_FD else None

    def open(self, name: str, flags: int, mode: int = 0o600) -> int:
        if self.fd is None:
            return os.open(self.path / name, flags, mode)
        return os.open(name, flags, mode, dir_fd=self.fd)

    def replace(self, src: str, dst: str) -> None:
        if self.fd is None:
            os.replace(self.path / src, self.path / dst)
        else:
            os.replace(src, dst, src_dir_fd=self.fd, dst_dir_fd=self.fd)

    def unlink(self, name: str) -> None:
        try:
            if self.fd is None:
                os.unlink(self.path / name)
            else:
                os.unlink(name, dir_fd=self.fd)
        except FileNotFoundError:
            pass

    def close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)


def atomic_write(path: str | Path, content: str | Callable[[BinaryIO], None]) -> None:
    """Write via a new temp file in the same folder + fsync + rename: a reader sees the old file or the new, never
    half, and a failure (KeyboardInterrupt included) leaves no temp file. `content`: text, or a function writing
    bytes. A link, pipe, device or folder at `path` is NotAFileError, with nothing written."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    refuse_unless_file(p)
    mode = file_mode(p)
    folder = _Folder(p.parent)
    tmp = f".{p.name}.{secrets.token_hex(4)}.tmp"
    try:
        fd = folder.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _NOFOLLOW | _CLOEXEC)
        try:
            os.fchmod(fd, mode)
            with os.fdopen(fd, "wb") as f:
                if callable(content):
                    content(f)
                else:
                    f.write(content.encode())
                f.flush()
                os.fsync(f.fileno())  # the bytes are on disk before the name points at them
            refuse_unless_file(p)  # (one planted while the bytes were written: the rename would replace it)
            folder.replace(tmp, p.name)
        except BaseException:
            folder.unlink(tmp)
            raise
    finally:
        folder.close()


def append_line(path: str | Path, line: str) -> None:
    """Append one line to a log file in its folder, creating it (0666 under the umask) where it is missing; a link,
    pipe, device or folder at `path` is NotAFileError, with nothing written."""
    p = Path(path)
    folder = _Folder(p.parent)
    try:
        try:
            fd = folder.open(p.name, os.O_WRONLY | os.O_APPEND | os.O_CREAT | _NOFOLLOW | _NONBLOCK | _CLOEXEC, 0o666)
        except OSError:
            if what_stands(p) is not None:  # ELOOP (a link), ENXIO (a pipe no one reads), EISDIR
                raise NotAFileError(p, what_stands(p)) from None
            raise
        with os.fdopen(fd, "ab") as f:
            if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
                raise NotAFileError(p, what_stands(p) or "not a regular file")
            f.write(line.encode())
    finally:
        folder.close()


def nearest_existing(path: Path) -> Path:
    """`path` or the nearest folder above it that exists: where its missing folders would be made from."""
    path = Path(path)
    return next(p for p in (path, *path.parents) if os.path.lexists(p))  # a relative path ends at "."


def try_write_in(folder: Path) -> None:
    """Raise OSError unless a file can be made in `folder` (one is made and deleted at once)."""
    name = folder / f".oomtune-write-test.{secrets.token_hex(4)}"
    fd = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _NOFOLLOW | _CLOEXEC, 0o600)
    os.close(fd)
    os.unlink(name)
