"""A receiver's watchdog inside vLLM: a transfer that never comes while the
engine makes no handler call.

ppsync's bound (``timeout_s``) runs inside its calls: a consume waits at
most that long. But vLLM's engine stops calling when the last PP rank goes
silent: its executor waits for that rank's step result before it schedules
more than ``pp_size`` steps ahead, so a first or middle rank's worker sits
idle in vLLM's RPC loop with a receive posted, and nothing would ever
time out (a SIGSTOPped last rank hangs the engine with vLLM's own handler
too). This thread watches the receives a path has posted and not yet
consumed: when one has been pending, not ended, for longer than
``timeout_s`` (or ended badly: gloo's own timeout, a connection closed)
while no handler call is running, it makes the path's own
error for it (:meth:`ppsync.core.path.group_end.GroupEnd.failed`: through the
failure board, naming the silent or lost rank, dumped) and hands it to
``on_error`` (the plugin: log it and end the worker, so that vLLM's
executor ends the engine). It reads the ring and asks each work whether it
ended, as the services' watcher does; it never waits on a work. Each look
is a call into torch (a future's value) that the process's exit waits for
(ppsync.core.wire.teardown.native_call); once the exit began, the thread
stops.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import torch.distributed as dist

from ppsync.core.path.token_path import TokenPath
from ppsync.core.wire.teardown import native_call
from ppsync.errors import PPSyncError, SyncTimeout

__all__ = ["PendingWatch"]


class PendingWatch:
    """Watches ``path``'s posted receives from a daemon thread (see the
    module docstring); ``busy`` is set while the engine is inside a handler
    call (that call's own bound applies then)."""

    def __init__(self, path: TokenPath, on_error: Callable[[PPSyncError], None]) -> None:
        self.path = path
        self.on_error = on_error
        self.busy = False
        self.tick_s = min(1.0, path.config.timeout_s / 10)
        self._thread = threading.Thread(target=self._run, name="ppsync-vllm-watchdog",
                                        daemon=True)
        self._thread.start()

    def _pending(self, seen: dict[int, float]) -> tuple[float | None, dist.Work | None]:
        """(how long the oldest posted receive that has not ended has been
        pending, from when this thread first saw it, or None; a pending
        receive that ended badly, or None)."""
        now = time.monotonic()
        try:
            works = [p.work for p in self.path.ring.pending() if p is not None]
        except RuntimeError:  # the engine's thread changed the ring meanwhile
            return None, None
        live, bad = {}, None
        ended, well = self.path.completion.ended, self.path.completion.ended_well
        for work in works:
            if not ended(work):
                live[id(work)] = seen.get(id(work), now)
            elif bad is None and not well(work):
                bad = work  # gloo's own timeout, or a connection closed
        seen.clear()
        seen.update(live)
        return (now - min(live.values()) if live else None), bad

    def _run(self) -> None:
        seen: dict[int, float] = {}
        timeout_s = self.path.config.timeout_s
        what = f"rank {self.path.rank}: a receive posted"
        while not self.path.closed:
            time.sleep(self.tick_s)
            with native_call():
                age, bad = self._pending(seen)
            if self.busy or (bad is None and (age is None or age <= timeout_s + self.tick_s)):
                continue
            tail = "while the engine makes no handler call (ppsync's watchdog of a vLLM worker)"
            own: PPSyncError = SyncTimeout(
                f"{what} {age or 0:.1f} s ago has not completed within timeout_s = "
                f"{timeout_s:g} {tail}")
            if bad is not None:
                try:
                    with native_call():  # ended: it raises its error at once
                        self.path.completion.wait(bad, timeout_s=timeout_s, what=f"{what} "
                                                  f"ended badly {tail}", peer=self.path.src)
                except PPSyncError as e:
                    own = e
            try:
                err = self.path.failed(own, observed=True)
            except Exception as e:  # the board cannot be read: this rank's own error
                own.add_note(f"the failure board could not be read: {e!r}")
                err = own
            self.on_error(err)
            return
