"""Where a process's dumps go and which token paths they cover: the dump
directory, the registry of live token paths (the newest few, each with its
file name), and the world id the dumps carry.

The automatic dumps (an error leaving a token path, SIGUSR1, process exit) go
to the *dump directory*: the one given to
:func:`~ppsync.core.recorder.triggers.install_dump_triggers` (``ppsync launch
--dump-dir``), else ``$PPSYNC_DUMP_DIR``. With neither set, no dump is
written automatically: the ring is still kept, and ``dump()`` still works on
request. The file is ``ppsync-rank<global rank>.jsonl`` (``-<n>`` added for
the n-th further token path of the same process); a later dump of the same
path replaces an earlier one.
"""

from __future__ import annotations

import os
import tempfile
import time
from collections import deque
from pathlib import Path
from typing import Protocol

from ppsync.core.recorder.flight import FlightRecorder
from ppsync.errors import ConfigError
from ppsync.schemas.config import SyncConfig
from ppsync.schemas.dump import DUMP_DIR_ENV

_KEEP = 8  # token paths of this process whose recorders the triggers dump


class Dumpable(Protocol):
    """What a dump reads from a token path."""

    config: SyncConfig
    rank: int  # group rank
    recorder: FlightRecorder
    steps: int
    seq: int
    run_id: int  # agreed at the handshake; 0 before
    dump_inline: bool  # False: error dumps are written by the writer thread (event loops)

    @property
    def global_rank(self) -> int: ...
    @property
    def group_ranks(self) -> list[int]: ...
    @property
    def closed(self) -> bool: ...


_paths: deque[tuple[Dumpable, str, int]] = deque(maxlen=_KEEP)  # (path, name, opened wall ns)
_opened = 0  # token paths registered in this process
_dump_dir: Path | None = None  # set by install_dump_triggers
_world: tuple[int, int] = (0, 0)  # (world id, world size) set by set_world; 0: not known


def set_world(world_id: int, world_size: int) -> None:
    """Name the world this process's token paths belong to: every rank of
    one world passes the same ``world_id`` (``ppsync run`` agrees one in the
    run's store), so a reader merges every PP group of a tensor x pipeline
    world; without it, dumps say 0 (not known) and readers go by run id."""
    global _world
    _world = (world_id, world_size)


def world() -> tuple[int, int]:
    """(world id, world size) as :func:`set_world` named them; 0: not known."""
    return _world


def set_dump_dir(directory: Path) -> None:
    """Make ``directory`` the dump directory (over ``$PPSYNC_DUMP_DIR``)."""
    global _dump_dir
    _dump_dir = directory


def kept() -> list[tuple[Dumpable, str]]:
    """The kept token paths, oldest first, each with its file name."""
    return [(path, name) for path, name, _ in _paths]


def dump_dir() -> Path | None:
    """The directory automatic dumps go to, or None (see module docstring)."""
    if _dump_dir is not None:
        return _dump_dir
    env = os.environ.get(DUMP_DIR_ENV)
    return Path(env) if env else None


def check_dump_dir(directory: Path, source: str) -> None:
    """ConfigError naming ``source`` (the flag or variable that gave it)
    unless ``directory`` is, or can be made, a directory where this process
    can write a dump: found before a run, not after its failure."""
    try:
        directory.mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(prefix=".ppsync-probe.", dir=directory)
        os.close(fd)
        os.unlink(probe)
    except FileExistsError:
        raise ConfigError(f"{source} {directory}: not a directory") from None
    except OSError as e:
        raise ConfigError(f"{source} {directory}: cannot write dumps there: "
                          f"{e.strerror or e}") from None


def register(path: Dumpable) -> None:
    """Keep ``path`` (the newest few) for the signal and exit dumps, and
    give it its file name."""
    global _opened
    name = f"ppsync-rank{path.global_rank}" + (f"-{_opened}" if _opened else "") + ".jsonl"
    _opened += 1
    _paths.append((path, name, time.time_ns()))


def entry(path: Dumpable) -> tuple[str, int]:
    """``path``'s (file name, wall ns it was opened; 0: not registered)."""
    for p, name, opened in _paths:
        if p is path:
            return name, opened
    return f"ppsync-rank{path.global_rank}.jsonl", 0


def file_name(path: Dumpable) -> str:
    """The file name automatic dumps of ``path`` use."""
    return entry(path)[0]


def dump_file(path: Dumpable, file: str | Path | None) -> Path:
    """``file``, or ``path``'s file in the dump directory when None."""
    if file is not None:
        return Path(file)
    directory = dump_dir()
    if directory is None:
        raise ConfigError(f"dump(): no file given and no dump directory set "
                          f"(install_dump_triggers or ${DUMP_DIR_ENV})")
    return directory / file_name(path)
