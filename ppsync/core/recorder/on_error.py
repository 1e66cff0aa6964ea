"""Recording the errors that leave a token path: each one once in its
flight recorder, and dumped, with a note naming the file, where a dump
directory is set."""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable
from typing import TypeVar

from ppsync.core.recorder.registry import Dumpable, dump_dir, file_name
from ppsync.core.recorder.snapshot import snapshot
from ppsync.core.recorder.writer import submit_dump
from ppsync.errors import DesyncError, PeerLost, PPSyncError, SyncTimeout

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
        snap = snapshot(path, "error", err)
        if path.dump_inline:
            snap.write(file)
        else:
            submit_dump(functools.partial(snap.write, file))
        written = str(file)
    except Exception as e:  # the real error matters more than the dump
        written = f"not written: {type(e).__name__}: {e}"
    _notes[err] = f"flight record: {written}"
    err.add_note(_notes[err])


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
