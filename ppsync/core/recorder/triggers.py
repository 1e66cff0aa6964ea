"""The triggers that dump every kept token path of a process: a signal
(SIGUSR1), process exit, and a caller's :func:`dump_all`."""

from __future__ import annotations

import atexit
import contextlib
import faulthandler
import signal
import sys
from pathlib import Path
from types import FrameType

from ppsync.core.recorder.registry import dump_dir, kept, set_dump_dir
from ppsync.core.recorder.snapshot import write_dump, writing
from ppsync.schemas.dump import DumpReason


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
    for path, name in kept():
        own = path.recorder.last_error is not None
        with contextlib.suppress(Exception):
            out.append(write_dump(path, directory / name, reason=reason,
                                  error=None if own else error))
    return out


def _on_signal(signum: int, frame: FrameType | None) -> None:
    if writing():  # the signal landed inside a dump: that dump is already on its way
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
    if directory is not None:
        set_dump_dir(Path(directory))
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
