"""Writing flight-recorder dumps, and the triggers that write them.

A dump is one JSON Lines file per token path (``ppsync.schemas.dump``):
header, events oldest first, footer. It is written to a temporary file in
the target directory and renamed, so a reader never sees half a dump.

Where dumps go: ``TokenPath.dump(path)`` writes where it is told. The
automatic dumps (an error leaving the token path, SIGUSR1, process exit) go
to the *dump directory*: the one given to :func:`install_dump_triggers`
(``ppsync launch --dump-dir``), else ``$PPSYNC_DUMP_DIR``. With neither set,
no dump is written automatically: the ring is still kept, and ``dump()``
still works on request. The file is ``ppsync-rank<global rank>.jsonl``
(``-<n>`` added for the n-th further token path of the same process); a
later dump of the same path replaces an earlier one.
"""

from __future__ import annotations

import atexit
import contextlib
import faulthandler
import functools
import json
import os
import signal
import socket
import sys
from collections import deque
from collections.abc import Callable
from importlib import metadata
from pathlib import Path
from types import FrameType
from typing import Protocol, TypeVar

import torch

from ppsync.core.recorder import FlightRecorder, clock_pair
from ppsync.errors import ConfigError, PPSyncError
from ppsync.schemas.config import SyncConfig
from ppsync.schemas.dump import (
    DUMP_DIR_ENV,
    DUMP_FORMAT_VERSION,
    DumpFooter,
    DumpHeader,
    DumpReason,
)

_KEEP = 8  # token paths of this process whose recorders the triggers dump


class Dumpable(Protocol):
    """What a dump reads from a token path."""

    config: SyncConfig
    rank: int  # group rank
    recorder: FlightRecorder
    steps: int
    seq: int

    @property
    def global_rank(self) -> int: ...
    @property
    def group_ranks(self) -> list[int]: ...
    @property
    def closed(self) -> bool: ...


_paths: deque[tuple[Dumpable, str]] = deque(maxlen=_KEEP)
_opened = 0  # token paths registered in this process
_dump_dir: Path | None = None  # set by install_dump_triggers
_writing = False  # a dump is being written (a signal then does not start another)


def dump_dir() -> Path | None:
    """The directory automatic dumps go to, or None (see module docstring)."""
    if _dump_dir is not None:
        return _dump_dir
    env = os.environ.get(DUMP_DIR_ENV)
    return Path(env) if env else None


def register(path: Dumpable) -> None:
    """Keep ``path`` (the newest few) for the signal and exit dumps, and
    give it its file name."""
    global _opened
    name = f"ppsync-rank{path.global_rank}" + (f"-{_opened}" if _opened else "") + ".jsonl"
    _opened += 1
    _paths.append((path, name))


def file_name(path: Dumpable) -> str:
    """The file name automatic dumps of ``path`` use."""
    for p, name in _paths:
        if p is path:
            return name
    return f"ppsync-rank{path.global_rank}.jsonl"


def dump_file(path: Dumpable, file: str | Path | None) -> Path:
    """``file``, or ``path``'s file in the dump directory when None."""
    if file is not None:
        return Path(file)
    directory = dump_dir()
    if directory is None:
        raise ConfigError(f"dump(): no file given and no dump directory set "
                          f"(install_dump_triggers or ${DUMP_DIR_ENV})")
    return directory / file_name(path)


def _version() -> str:
    try:
        return metadata.version("ppsync")
    except metadata.PackageNotFoundError:
        return "unknown"


def write_dump(path: Dumpable, file: Path, *, reason: DumpReason,
               error: BaseException | None = None) -> Path:
    """Write ``path``'s dump to ``file`` (atomically); return ``file``."""
    global _writing
    _writing = True
    try:
        return _write(path, file, reason, error)
    finally:
        _writing = False


def _write(path: Dumpable, file: Path, reason: DumpReason, error: BaseException | None) -> Path:
    rec = path.recorder
    clock = clock_pair()
    events = list(rec.event_dicts(clock))
    header = DumpHeader(
        format_version=DUMP_FORMAT_VERSION, ppsync_version=_version(),
        torch_version=str(torch.__version__), rank=path.global_rank, group_rank=path.rank,
        group_ranks=path.group_ranks, pp_size=path.config.pp_size, config=path.config,
        host=socket.gethostname(), pid=os.getpid(), clock=clock, reason=reason,
        capacity=rec.capacity, recorded=rec.recorded, dropped=rec.recorded - len(events),
    )
    err = error if error is not None else rec.last_error
    footer = DumpFooter(
        error_type=None if err is None else type(err).__name__,
        error_message=None if err is None else _original_message(err),
        in_flight=rec.in_flight(clock.mono_ns), last_step=path.steps, next_seq=path.seq,
        closed=path.closed,
    )
    file.parent.mkdir(parents=True, exist_ok=True)
    tmp = file.with_name(f".{file.name}.{os.getpid()}.tmp")
    with open(tmp, "w") as f:
        f.write(header.model_dump_json() + "\n")
        for e in events:
            f.write(json.dumps(e, separators=(",", ":")) + "\n")
        f.write(footer.model_dump_json() + "\n")
    os.replace(tmp, file)
    return file


_NOTE = " [flight record: "


def _original_message(err: BaseException) -> str:
    text = str(err)
    cut = text.find(_NOTE)
    return text if cut < 0 else text[:cut]


def dump_on_error(path: Dumpable, err: BaseException) -> None:
    """Record ``err`` leaving ``path``; when a dump directory is set, write
    the dump and append its file name to ``err``'s message. Never raises:
    a failed dump is named in the message instead. Once per error."""
    if getattr(err, "_ppsync_dumped", False):
        return
    err._ppsync_dumped = True  # type: ignore[attr-defined]  # a plain exception attribute
    path.recorder.error(path.steps, err)
    directory = dump_dir()
    if directory is None:
        return
    try:
        written = str(write_dump(path, directory / file_name(path), reason="error", error=err))
    except Exception as e:  # the real error matters more than the dump
        written = f"not written: {type(e).__name__}: {e}"
    text = _original_message(err)
    if err.args and isinstance(err.args[0], str):
        err.args = (f"{text}{_NOTE}{written}]", *err.args[1:])


def dump_all(reason: DumpReason, directory: Path | None = None) -> list[Path]:
    """Dump every kept token path into ``directory`` (default: the dump
    directory; nothing when there is none). Never raises."""
    directory = directory or dump_dir()
    if directory is None:
        return []
    out = []
    for path, name in list(_paths):
        with contextlib.suppress(Exception):
            out.append(write_dump(path, directory / name, reason=reason))
    return out


def _on_signal(signum: int, frame: FrameType | None) -> None:
    if _writing:  # the signal landed inside a dump: that dump is already on its way
        return
    paths = dump_all("signal")
    if paths:
        print(f"ppsync: flight record dumped to {', '.join(map(str, paths))}",
              file=sys.__stderr__ or sys.stderr, flush=True)


def install_dump_triggers(directory: Path | str | None, *, signum: int = signal.SIGUSR1,
                          stacks: bool = True) -> None:
    """Make this rank process dump its token paths into ``directory`` (None:
    ``$PPSYNC_DUMP_DIR``): on ``signum``, on errors, and at exit by
    ``atexit`` (a process leaving by ``os._exit`` calls
    ``dump_all("exit")`` itself). ``stacks``: the signal also prints every
    thread's stack to fd 2 (faulthandler, before the dump). Call it in the
    main thread, once per process."""
    global _dump_dir
    if directory is not None:
        _dump_dir = Path(directory)
    dumps = dump_dir() is not None
    if dumps:
        try:
            signal.signal(signum, _on_signal)
        except ValueError:  # not the main thread: no signal dumps, the rest still holds
            dumps = False
        atexit.register(dump_all, "exit")
    if stacks:
        # faulthandler prints at once (even while the main thread is blocked in
        # C), then chains to the handler above, which runs at the next bytecode
        # (without one, chaining would run the default action: terminate)
        with contextlib.suppress(Exception):
            faulthandler.register(signum, file=2, all_threads=True, chain=dumps)


F = TypeVar("F", bound=Callable[..., object])


def records_errors(method: F) -> F:
    """Decorate a public call of the token path: a PPSyncError leaving it
    (a bad input as much as a lost peer) is recorded, and dumped with its
    file named in the message when a dump directory is set, before it
    reaches the caller. Free when nothing is raised."""

    @functools.wraps(method)
    def call(self: Dumpable, *args: object, **kwargs: object) -> object:
        try:
            return method(self, *args, **kwargs)
        except PPSyncError as e:
            dump_on_error(self, e)
            raise

    return call  # type: ignore[return-value]
