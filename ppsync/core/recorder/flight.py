"""The flight recorder: a bounded, preallocated ring of one rank's token-path
events, cheap enough to stay on in production.

Each event is one fixed-size record of int64 words (``FIELDS``) written with
a single ``struct.pack_into`` into a bytearray allocated once: nothing grows
per event and the newest ``capacity`` events are kept. Only the monotonic
clock is read per event; a dump turns it into wall-clock time with a clock
pair read at dump time (the two clocks drift apart by at most what NTP slews
in the meantime).

Besides the ring, the recorder keeps a small table of the transfers issued
and not yet seen complete, indexed by ``seq`` (at most ``_TABLE`` frames can
be in flight: the ring depth D plus a few): a dump lists them as what the
rank was waiting on, and an error event names the oldest as its seq.

The recorder is written by one thread (the token path's caller). An event
is one C call, so a dump taken from a signal handler in that thread never
sees one torn: at worst the event being recorded when the signal arrived is
not in that dump yet.
"""

from __future__ import annotations

import struct
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch.distributed as dist

from ppsync.core.frame import FrameView
from ppsync.schemas.dump import EVENT_KINDS, ClockPair, InFlight

FIELDS = ("kind", "step", "seq", "ring_slot", "num_reqs", "rows_needed", "kept", "excluded",
          "req_idx", "generation", "idx_digest", "checksum", "flags", "mono_ns", "blocked_ns",
          "error")
"""The int64 words of one event, in order (``error``: index + 1 into the
recorder's error names, 0 for none)."""
_EVENT = struct.Struct(f"<{len(FIELDS)}q")
EVENT_BYTES = _EVENT.size
_pack = _EVENT.pack_into
_mono = time.monotonic_ns
K_POST, K_PUBLISH, K_ISSUE, K_COMPLETE, K_CONSUME, K_FREE, K_ERROR = range(len(EVENT_KINDS))
_TABLE = 2048  # in-flight table entries (far above any ring depth + pending sends)
_MAX_ERRORS = 64  # distinct errors kept by name; later ones reuse the last name


def clock_pair(tries: int = 5) -> ClockPair:
    """Wall and monotonic clocks read together: the wall read that sits in
    the narrowest pair of monotonic reads, its monotonic time the midpoint."""
    best: tuple[int, int, int] | None = None
    for _ in range(tries):
        m0 = time.monotonic_ns()
        w = time.time_ns()
        m1 = time.monotonic_ns()
        if best is None or m1 - m0 < best[0]:
            best = (m1 - m0, w, (m0 + m1) // 2)
    assert best is not None
    return ClockPair(wall_ns=best[1], mono_ns=best[2])


class FlightRecorder:
    """The newest ``capacity`` events of one token path (0 = off: every
    method returns at once and a dump holds no events)."""

    def __init__(self, capacity: int, *, is_last: bool, depth: int) -> None:
        self.capacity = capacity
        self.on = capacity > 0
        self.op = "send" if is_last else "recv"
        self.depth = 0 if is_last else depth  # ring depth D; the last rank has no ring
        self._buf = bytearray(capacity * EVENT_BYTES)  # [capacity * len(FIELDS)] int64
        self._n = 0  # events recorded so far
        # in-flight transfers by seq % _TABLE
        self._works: list[dist.Work | None] = [None] * _TABLE
        self._issued_ns: list[int] = [0] * _TABLE
        self._rows: list[int] = [0] * _TABLE  # rows needing a sample, per seq
        self._oldest = 0  # no seq below this is still in the table
        self._next = 0  # one past the highest seq issued
        self._errors: list[str] = []
        self.last_error: BaseException | None = None
        """The last error recorded (the footer's error)."""

    # -- recording (hot path: one pack_into each, no call in between) ---------

    def call(self, last: bool, step: int, advanced: int, num_reqs: int) -> None:
        """A post (``last`` False) or publish call for step ``step`` that has
        no transfer (no row needs a sample); ``advanced``: the ring's advance
        count (its tail is the step's ring slot). A call with a transfer is
        recorded by :meth:`issue` alone."""
        if not self.on:
            return
        n, d = self._n, self.depth
        _pack(self._buf, (n % self.capacity) * EVENT_BYTES, K_PUBLISH if last else K_POST,
              step, -1, (advanced - 1) % d if d else -1, num_reqs, 0, 0, 0, -1, -1, 0, 0, 0,
              _mono(), 0, 0)
        self._n = n + 1

    def issue(self, work: dist.Work, step: int, seq: int, advanced: int, num_reqs: int,
              rows: int, digest: int, checksum: int, flags: int) -> None:
        """Step ``step``'s post or publish issued frame ``seq`` as ``work``
        (``rows`` of ``num_reqs`` need a sample)."""
        if not self.on:
            return
        i, n, d = seq % _TABLE, self._n, self.depth
        now = _mono()
        self._works[i] = work
        self._issued_ns[i] = now
        self._rows[i] = rows
        self._next = seq + 1
        _pack(self._buf, (n % self.capacity) * EVENT_BYTES, K_ISSUE, step, seq,
              (advanced - 1) % d if d else -1, num_reqs, rows, 0, 0, -1, -1, digest, checksum,
              flags, now, 0, 0)
        self._n = n + 1

    def consume(self, frame: FrameView, step: int, advanced: int, keep_np: np.ndarray | None,
                kept: int, wait_from_ns: int) -> None:
        """``frame``'s step was released; ``keep_np`` ([num_reqs] bool) marks
        the ``kept`` rows handed out (the others were excluded); the wait began at
        ``wait_from_ns`` (monotonic). None: every row was excluded, nothing
        was waited for, and the receive stays in flight until a
        :meth:`complete`."""
        if not self.on:
            return
        seq, n = frame.seq, self._n
        i = seq % _TABLE
        now = _mono()
        blocked = 0
        if keep_np is not None:
            blocked = now - wait_from_ns
            works = self._works
            works[i] = None
            if seq == self._oldest:  # receives are released in order: usually so
                o, nxt = seq + 1, self._next
                while o < nxt and works[o % _TABLE] is None:
                    o += 1
                self._oldest = o
        num_reqs = frame.num_reqs
        _pack(self._buf, (n % self.capacity) * EVENT_BYTES, K_CONSUME, step, seq,
              (advanced - 1) % self.depth, num_reqs, self._rows[i], kept, num_reqs - kept,
              -1, -1, frame.idx_digest, 0, 0, now, blocked, 0)
        self._n = n + 1

    def complete(self, work: dist.Work, step: int) -> None:
        """``work`` was seen complete (a send, a dropped receive)."""
        if not self.on:
            return
        works, nxt = self._works, self._next
        seq = o = max(self._oldest, nxt - _TABLE)
        while seq < nxt and works[seq % _TABLE] is not work:
            seq += 1
        if seq == nxt:
            return  # not in the table (issued before it wrapped)
        i = seq % _TABLE
        works[i] = None
        if seq == o:  # sends complete in order: usually so
            o += 1
            while o < nxt and works[o % _TABLE] is None:
                o += 1
            self._oldest = o
        n = self._n
        _pack(self._buf, (n % self.capacity) * EVENT_BYTES, K_COMPLETE, step, seq, -1, 0,
              self._rows[i], 0, 0, -1, -1, 0, 0, 0, _mono(), 0, 0)
        self._n = n + 1

    def free(self, step: int, req_idx: int, generation: int) -> None:
        """Request slot ``req_idx`` was freed; its generation is now ``generation``."""
        if not self.on:
            return
        n = self._n
        _pack(self._buf, (n % self.capacity) * EVENT_BYTES, K_FREE, step, -1, -1, 0, 0, 0, 0,
              req_idx, generation, 0, 0, 0, _mono(), 0, 0)
        self._n = n + 1

    def drained(self, step: int) -> None:
        """Every transfer in flight completed (a draining close)."""
        for seq in self.in_flight_seqs():
            work = self._works[seq % _TABLE]
            assert work is not None
            self.complete(work, step)

    def error(self, step: int, err: BaseException) -> None:
        """``err`` is leaving the token path; its seq is the oldest transfer
        in flight (what the rank was waiting on), -1 when none. Recorded
        once per error object."""
        if err is self.last_error:
            return
        self.last_error = err
        if not self.on:
            return
        name = type(err).__name__
        if name not in self._errors and len(self._errors) < _MAX_ERRORS:
            self._errors.append(name)
        code = self._errors.index(name) + 1 if name in self._errors else len(self._errors)
        pending = self.in_flight_seqs()
        n = self._n
        _pack(self._buf, (n % self.capacity) * EVENT_BYTES, K_ERROR, step,
              pending[0] if pending else -1, -1, 0, 0, 0, 0, -1, -1, 0, 0, 0, _mono(), 0, code)
        self._n = n + 1

    # -- reading (dumps) ------------------------------------------------------

    @property
    def recorded(self) -> int:
        """Events recorded since the recorder was made."""
        return self._n

    def events(self) -> np.ndarray:
        """[n, len(FIELDS)] int64: a copy of the kept events, oldest first."""
        n, cap = self._n, self.capacity
        if cap == 0 or n == 0:
            return np.zeros((0, len(FIELDS)), dtype=np.int64)
        ring = np.frombuffer(self._buf, dtype="<i8").reshape(cap, len(FIELDS))
        if n <= cap:
            return ring[:n].copy()
        start = n % cap
        return np.concatenate([ring[start:], ring[:start]])

    def event_dicts(self, clock: ClockPair) -> Iterator[dict[str, Any]]:
        """The kept events as DumpEvent fields, oldest first; wall times from
        ``clock``."""
        rows = self.events()
        first = self._n - rows.shape[0]
        for k, row in enumerate(rows.tolist()):
            d = dict(zip(FIELDS, row, strict=True))
            kind = d.pop("kind")
            err = d.pop("error")
            d["wall_ns"] = clock.wall_ns + (d["mono_ns"] - clock.mono_ns)
            d["error"] = self._errors[err - 1] if 0 < err <= len(self._errors) else None
            yield {"type": "event", "index": first + k,
                   "kind": EVENT_KINDS[kind] if 0 <= kind < len(EVENT_KINDS) else "error",
                   **d}

    @property
    def error_names(self) -> list[str]:
        """The error type names that events' ``error`` words index (1-based)."""
        return self._errors

    def in_flight_seqs(self) -> list[int]:
        """Seqs issued and not seen complete, oldest first."""
        lo = max(self._oldest, self._next - _TABLE)
        return [s for s in range(lo, self._next) if self._works[s % _TABLE] is not None]

    def in_flight(self, now_ns: int) -> list[InFlight]:
        """What was in flight at ``now_ns`` (monotonic), oldest first."""
        out = []
        for s in self.in_flight_seqs():
            work = self._works[s % _TABLE]
            assert work is not None
            issued = self._issued_ns[s % _TABLE]
            out.append(InFlight(seq=s, op="send" if self.op == "send" else "recv",
                                issued_mono_ns=issued, age_ns=max(0, now_ns - issued),
                                completed=bool(work.is_completed())))
        return out
