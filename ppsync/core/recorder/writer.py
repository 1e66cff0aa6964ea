"""The writer threads of error dumps: a token path driven by an event loop
(``dump_inline`` False) never writes its dump on the loop's thread, but
hands it over here (ppsync.core.recorder.on_error.dump_on_error). The process's exit,
and ``open_rank`` before an error leaves it, wait for them."""

from __future__ import annotations

import atexit
import contextlib
import threading
import time
from collections.abc import Callable


class _Writer:
    """Writes the dumps an event loop's thread hands over, each in a thread
    of its own (failures are rare; no thread outlives its dump).
    :func:`flush_dumps` waits for them, and so does the process's exit."""

    def __init__(self) -> None:
        self._threads: list[threading.Thread] = []
        self._lock = threading.Lock()
        self._atexit = False

    def submit(self, write: Callable[[], object]) -> None:
        def run() -> None:
            with contextlib.suppress(Exception):  # the error itself is raised to the caller
                write()

        thread = threading.Thread(target=run, name="ppsync-dump", daemon=True)
        with self._lock:
            self._threads = [t for t in self._threads if t.is_alive()]
            self._threads.append(thread)
            if not self._atexit:
                atexit.register(flush_dumps)
                self._atexit = True
        thread.start()

    def pending(self) -> bool:
        with self._lock:
            return any(t.is_alive() for t in self._threads)

    def flush(self, timeout_s: float) -> bool:
        """Wait until every dump handed over is written; False on timeout."""
        deadline = time.monotonic() + timeout_s
        with self._lock:
            threads = list(self._threads)
        for t in threads:
            t.join(max(0.0, deadline - time.monotonic()))
        return not self.pending()


_writer = _Writer()


def flush_dumps(timeout_s: float = 30.0) -> bool:
    """Wait (at most ``timeout_s``) until every dump handed to a writer
    thread is on disk; True when none is left. Blocks: an event loop awaits
    :func:`dumps_pending` turning False instead."""
    return _writer.flush(timeout_s)


def dumps_pending() -> bool:
    """Whether a dump handed to a writer thread is still being written."""
    return _writer.pending()




def submit_dump(write: Callable[[], object]) -> None:
    """Run ``write`` (a dump's write) in a thread of its own; its failure is
    dropped (the error that caused the dump reaches the caller anyway)."""
    _writer.submit(write)
