"""Path arguments checked before any work starts: a file the command will
write (``--report``, ``bench --json``, ``dump trace -o``) and a directory
it will fill (``schema export``). A bad one is a :class:`ConfigError` naming
the flag, the path and the rule (exit 2), never a traceback once the work is
done. Here, below cli.py, because the debug commands need it too."""

from __future__ import annotations

import os
import stat
from pathlib import Path

from ppsync.errors import ConfigError


def check_output_file(flag: str, path: Path) -> None:
    """``path`` can be written as a file: its directory exists, it is not a
    directory, and it is either absent and creatable there or a regular
    file open for writing (a read-only file such as ``/proc/version`` is
    refused even for root, who could open it)."""
    where = f"{flag} {path}"
    if path.is_dir():
        raise ConfigError(f"{where}: is a directory; give a file to write")
    parent = path.parent if str(path.parent) else Path(".")
    if not parent.is_dir():
        raise ConfigError(f"{where}: directory {parent} does not exist")
    try:
        st = path.stat()
    except FileNotFoundError:
        _try_create(where, path)
        return
    except OSError as e:
        raise ConfigError(f"{where}: cannot be read ({e.strerror})") from None
    if not stat.S_ISREG(st.st_mode):
        raise ConfigError(f"{where}: not a regular file")
    if not st.st_mode & 0o222:
        raise ConfigError(f"{where}: read-only (mode {stat.S_IMODE(st.st_mode):04o})")
    try:
        with open(path, "r+b"):  # opens for writing without truncating
            pass
    except OSError as e:
        raise ConfigError(f"{where}: not writable ({e.strerror})") from None


def _try_create(where: str, path: Path, what: str = "cannot be created") -> None:
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    except OSError as e:
        raise ConfigError(f"{where}: {what} ({e.strerror})") from None
    os.close(fd)
    path.unlink()


def check_output_dir(flag: str, path: Path) -> None:
    """``path`` is a writable directory, made (with its parents) if absent."""
    where = f"{flag} {path}"
    if path.exists() and not path.is_dir():
        raise ConfigError(f"{where}: not a directory")
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ConfigError(f"{where}: cannot be made ({e.strerror})") from None
    probe = path / ".ppsync-write-check"
    _try_create(where, probe, "no file can be written in it")
