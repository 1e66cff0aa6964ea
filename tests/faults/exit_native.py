"""One process of ``test_exit_native``: a daemon thread of ppsync's kind
keeps calling into torch's C++ (a tensor op that lets go of the
interpreter) through one of ppsync's daemon-thread sites, while the main
thread returns from ``main``: the interpreter's normal exit.

Argument: SITE, one of
- ``bare``: the op itself, unguarded (what every site did before
  ppsync.core.wire.teardown.native_call);
- ``native``: the op inside ``native_call()``;
- ``board``: the op as the failure board's store call (its store worker);
- ``stream``: the op as work queued on a CPU twin's side stream;
- ``abort``: the op as the twin of NCCL's abort (it fills pending
  receives' buffers);
- ``outlives-return``, ``outlives-raise``, ``outlives-status``: one call
  inside ``native_call()`` that lasts far past the exit hook's bound (as a
  real ``ncclCommAbort`` may), the main thread returning, raising, or
  saying its status (``exit_status(3)``) first: the hook ends the process
  with that status (0, 1, 3), its output flushed, instead of letting the
  call return into a finalizing interpreter.
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable

import torch

from ppsync.core.wire.board import _StoreWorker
from ppsync.core.wire.completion.twin import TwinGroup, TwinWork
from ppsync.core.wire.completion.twin_streams import TwinStream
from ppsync.core.wire.teardown import NATIVE_EXIT_S, exit_status, native_call

BUF = torch.empty(4_000_000, dtype=torch.int64)  # one fill: milliseconds, the interpreter let go


def fill() -> None:
    BUF.fill_(7)


def _loop(step: Callable[[], object]) -> None:
    """Call ``step`` for ever, from a daemon thread."""
    def run() -> None:
        while True:
            step()

    threading.Thread(target=run, daemon=True).start()


PENDING: list[TwinWork] = []  # the abort site's pending receive (the twin holds it weakly)


def main() -> None:
    site = sys.argv[1]
    if site == "bare":
        _loop(fill)
    elif site == "native":
        def guarded() -> None:
            with native_call():
                fill()
        _loop(guarded)
    elif site == "board":
        worker = _StoreWorker()
        _loop(lambda: worker.ask(fill, None, 5.0))
    elif site == "stream":
        stream = TwinStream("side", main=False)
        for _ in range(5000):  # seconds of queued work
            stream.submit(fill)
    elif site == "abort":
        # no group is used; "xccl": no modelled watchdog, which would drop the
        # receive from the pending ones once the first abort marked it completed
        twin = TwinGroup(None, "xccl", 0.0, 0.0)  # type: ignore[arg-type]
        PENDING.append(TwinWork(twin, frame=True, root=False, buf=BUF))
        _loop(twin.abort_comms)
    elif site.startswith("outlives-"):
        def long_call() -> None:
            with native_call():
                end = time.monotonic() + 4 * NATIVE_EXIT_S
                while time.monotonic() < end:
                    fill()
        threading.Thread(target=long_call, daemon=True).start()
        time.sleep(0.3)
        print("main returns")  # not flushed here: the hook's end flushes it
        if site == "outlives-raise":
            raise RuntimeError("the engine raised")
        if site == "outlives-status":
            exit_status(3)
        return
    else:
        raise SystemExit(f"unknown site {site!r}")
    time.sleep(0.3)  # the thread is well into its calls
    print("main returns", flush=True)


if __name__ == "__main__":
    main()
