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
import tempfile
import time
import weakref
from collections import deque
from collections.abc import Callable, Iterator
from importlib import metadata
from pathlib import Path
from types import FrameType
from typing import Protocol, TypeVar

import numpy as np
import torch
import torch.distributed as dist
from pydantic import BaseModel

from ppsync.core.dump_writer import dumps_pending as dumps_pending
from ppsync.core.dump_writer import flush_dumps as flush_dumps
from ppsync.core.dump_writer import submit_dump
from ppsync.core.recorder import FIELDS, FlightRecorder, clock_pair
from ppsync.errors import ConfigError, DesyncError, PeerLost, PPSyncError, SyncTimeout
from ppsync.schemas.config import SyncConfig
from ppsync.schemas.dump import (
    DUMP_DIR_ENV,
    DUMP_FORMAT_VERSION,
    EVENT_KINDS,
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
_writing = False  # a dump is being written (a signal then does not start another)
_world: tuple[int, int] = (0, 0)  # (world id, world size) set by set_world; 0: not known


def set_world(world_id: int, world_size: int) -> None:
    """Name the world this process's token paths belong to: every rank of
    one world passes the same ``world_id`` (``ppsync run`` agrees one in the
    run's store), so a reader merges every PP group of a tensor x pipeline
    world; without it, dumps say 0 (not known) and readers go by run id."""
    global _world
    _world = (world_id, world_size)


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


def _entry(path: Dumpable) -> tuple[str, int]:
    for p, name, opened in _paths:
        if p is path:
            return name, opened
    return f"ppsync-rank{path.global_rank}.jsonl", 0


def file_name(path: Dumpable) -> str:
    """The file name automatic dumps of ``path`` use."""
    return _entry(path)[0]


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
        _snapshot(path, reason, error).write(file)
        return file
    finally:
        _writing = False


class _Snapshot:
    """A dump's content taken on the recording thread (a copy of the ring:
    one memcpy), turned into lines by whichever thread writes it."""

    def __init__(self, header: DumpHeader, rows: np.ndarray, first: int, errors: list[str],
                 footer: DumpFooter) -> None:
        self.header, self.rows, self.first = header, rows, first
        self.errors, self.footer = errors, footer

    def _event_lines(self) -> Iterator[str]:
        rows, clock = self.rows, self.header.clock
        if rows.shape[0] == 0:
            return
        kinds = rows[:, 0]
        # wall = clock.wall + (mono - clock.mono); the kind's and error's names
        wall = rows[:, _MONO] + (clock.wall_ns - clock.mono_ns)
        names = [json.dumps(n) for n in self.errors]
        body = np.concatenate((rows[:, 1:-1], wall[:, None]), axis=1).tolist()
        for k, (kind, err, values) in enumerate(zip(kinds.tolist(), rows[:, -1].tolist(), body,
                                                    strict=True)):
            name = EVENT_KINDS[kind] if 0 <= kind < len(EVENT_KINDS) else "error"
            error = names[err - 1] if 0 < err <= len(names) else "null"
            yield _EVENT_LINE % (self.first + k, name, *values, error)

    def write(self, file: Path) -> None:
        """Write to a fresh temporary file in ``file``'s directory (created
        exclusively: never through a link planted there), then rename."""
        file.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{file.name}.", suffix=".tmp", dir=file.parent)
        try:
            os.fchmod(fd, 0o644)  # mkstemp's 0600 would hide the dump from the reading tools
            with os.fdopen(fd, "w") as f:
                f.write(json_line(self.header))
                f.writelines(self._event_lines())
                f.write(json_line(self.footer))
            os.replace(tmp, file)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise


_LINE_BREAKS = str.maketrans({"\u0085": "\\u0085", "\u2028": "\\u2028",
                              "\u2029": "\\u2029"})
"""Characters that JSON leaves raw in a string but some readers' line
splits (Python's str.splitlines, JavaScript's line terminators) break a
line at: written as escapes, so every line survives any reader's split
(the other line breaks are control characters, which JSON escapes)."""


def json_line(model: BaseModel) -> str:
    """``model`` as one JSON line that no reader splits in two."""
    return model.model_dump_json().translate(_LINE_BREAKS) + "\n"


_MONO = FIELDS.index("mono_ns")
_EVENT_LINE = ('{"type":"event","index":%d,"kind":"%s",'
               + ",".join(f'"{f}":%d' for f in FIELDS[1:-1])
               + ',"wall_ns":%d,"error":%s}\n')
"""One event line: the JSON ``json.dumps`` writes for a DumpEvent's fields,
formatted in one step."""


def _snapshot(path: Dumpable, reason: DumpReason, error: BaseException | None) -> _Snapshot:
    rec = path.recorder
    clock = clock_pair()
    rows = rec.events()
    opened = _entry(path)[1]
    header = DumpHeader(
        format_version=DUMP_FORMAT_VERSION, ppsync_version=_version(),
        torch_version=str(torch.__version__), rank=path.global_rank, group_rank=path.rank,
        group_ranks=path.group_ranks, pp_size=path.config.pp_size, config=path.config,
        host=socket.gethostname(), pid=os.getpid(), run_id=path.run_id,
        world_id=_world[0], world_size=_world[1] or _world_size(path),
        opened_wall_ns=opened, clock=clock, reason=reason,
        capacity=rec.capacity, recorded=rec.recorded, dropped=rec.recorded - rows.shape[0],
    )
    err = error if error is not None else rec.last_error
    peer = getattr(err, "peer", None)
    footer = DumpFooter(
        error_type=None if err is None else type(err).__name__,
        error_message=None if err is None else str(err),
        error_peer=peer if isinstance(peer, int) else None,
        in_flight=rec.in_flight(clock.mono_ns), last_step=path.steps, next_seq=path.seq,
        closed=path.closed,
    )
    return _Snapshot(header, rows, rec.recorded - rows.shape[0], list(rec.error_names), footer)


def _world_size(path: Dumpable) -> int:
    """torch.distributed's world size where the process joined one (its
    group's ranks lie in it), else 0: not known."""
    if dist.is_available() and dist.is_initialized():
        size = dist.get_world_size()
        if all(r < size for r in path.group_ranks):
            return size
    return 0


_notes: weakref.WeakKeyDictionary[BaseException, str] = weakref.WeakKeyDictionary()
"""Errors already recorded, each with the note naming its dump ('' when no
dump directory was set): once per error object, and once per failure."""

_FAILURES = (PeerLost, SyncTimeout, DesyncError)
"""Errors that end a token path's run: every later one is the same failure."""


def _same_failure(first: BaseException | None, err: BaseException) -> bool:
    """Whether ``err`` is the failure ``first`` already recorded, seen again:
    in the async services the engine's call and the transfer watcher each
    turn one lost peer into their own error of the same kind and peer."""
    return (isinstance(first, _FAILURES) and type(err) is type(first)
            and getattr(err, "peer", None) == getattr(first, "peer", None))


def dump_on_error(path: Dumpable, err: BaseException) -> None:
    """Record ``err`` leaving ``path``; when a dump directory is set, write
    the dump (on the writer thread when the path is driven by an event loop,
    ``dump_inline`` False) and add a note naming its file to ``err``. Never
    raises: a failed dump is named in the note instead. Once per error, and
    once per failure: a later error of the same kind naming the same peer
    (another task's view of it) gets the first one's note."""
    if err in _notes:
        return
    first = path.recorder.last_error
    if first is not None and first in _notes and _same_failure(first, err):
        _notes[err] = _notes[first]
        if _notes[err]:
            err.add_note(_notes[err])
        return
    _notes[err] = ""
    path.recorder.error(path.steps, err)
    directory = dump_dir()
    if directory is None:
        return
    file = directory / file_name(path)
    try:
        snap = _snapshot(path, "error", err)
        if path.dump_inline:
            snap.write(file)
        else:
            submit_dump(functools.partial(snap.write, file))
        written = str(file)
    except Exception as e:  # the real error matters more than the dump
        written = f"not written: {type(e).__name__}: {e}"
    _notes[err] = f"flight record: {written}"
    err.add_note(_notes[err])


def dump_all(reason: DumpReason, directory: Path | None = None, *,
             error: BaseException | None = None) -> list[Path]:
    """Dump every kept token path into ``directory`` (default: the dump
    directory; nothing when there is none). ``error``: what ended the
    process (a :class:`~ppsync.errors.Stopped` naming the signal), the
    footer's error of every path that recorded none of its own. Never raises."""
    directory = directory or dump_dir()
    if directory is None:
        return []
    out = []
    for path, name, _ in list(_paths):
        own = path.recorder.last_error is not None
        with contextlib.suppress(Exception):
            out.append(write_dump(path, directory / name, reason=reason,
                                  error=None if own else error))
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
