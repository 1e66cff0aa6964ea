"""Heartbeats: telling a silent peer from a slow one (docs/design.md, "Slow
is not dead").

Every rank publishes a beat on the failure board about once a second
(:data:`BEAT_S`, from its watcher thread, ppsync.core.wire.rank_watch): a
counter, its step, and where it is: starting (what it is doing), inside a
ppsync wait (for what, since when) or in its engine (since its step count
last moved). A rank that waits reads its peers' beats; a peer whose beat
stops changing for ``silent_s`` is *silent*, whatever the step time. A peer
whose beat runs is *alive*, however long its step: a wait on it is bounded
by ``timeout_s`` from the wait's start, and the error then says what the
peer was doing.

Silence is judged on the reader's own clock (when it first saw the beat's
current value), never by comparing two hosts' clocks, and only for a peer
known to beat in this run: seen changing, or read after the start-up
handshake (every rank beats before it joins it). Before that, a key left in
the store by an earlier run, or a peer that has not started, is *not
started*, which the waits' own bound covers.
"""

from __future__ import annotations

import json
import secrets
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

BEAT_S = 1.0
"""About how often a rank publishes its beat."""
LOOK_S = 0.25
"""How often a rank that waits, or has a transfer pending, reads its peers'
beats and the board's failure count (else once per beat)."""
ALIVE_S = 2 * BEAT_S + LOOK_S
"""A peer whose beat moved this recently is alive (beating); one quiet for
longer is not yet known silent until ``silent_s``."""

STARTING, ENGINE, WAITING = "start", "engine", "wait"


@dataclass(frozen=True)
class Beat:
    """One rank's heartbeat as it travels (a short JSON object)."""

    boot: int
    """This process's random id: a restarted rank's beats are another run."""
    n: int
    """Beats so far: a reader sees it change while the rank lives."""
    step: int
    """The rank's post/publish calls so far."""
    state: str
    """STARTING, ENGINE or WAITING."""
    for_s: float
    """Seconds in that state when the beat was written."""
    what: str
    """What it waits for, or what its start-up is doing ('' in its engine)."""

    def encode(self) -> str:
        return json.dumps({"b": self.boot, "n": self.n, "s": self.step, "st": self.state,
                           "f": round(self.for_s, 1), "w": self.what})

    @classmethod
    def decode(cls, text: str | bytes) -> Beat | None:
        """The beat ``text`` holds; None for anything else."""
        try:
            d = json.loads(text)
            return cls(int(d["b"]), int(d["n"]), int(d["s"]), str(d["st"]), float(d["f"]),
                       str(d["w"]))
        except (ValueError, KeyError, TypeError):
            return None

    def doing(self, later_s: float) -> str:
        """What the rank was doing, ``later_s`` after this beat: "in its
        engine's step 813 for 75 s"."""
        for_s = self.for_s + later_s
        if self.state == WAITING:
            return f"waiting for {self.what} for {for_s:.0f} s"
        if self.state == STARTING:
            return f"starting ({self.what}) for {for_s:.0f} s"
        return f"in its engine's step {self.step} for {for_s:.0f} s"


class Activity:
    """What this rank reports about itself: its start-up phase and its
    waits, set by the engine's thread (a wait only when it must block, off
    the hot path), read by the watcher under the same lock."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.lock = threading.Lock()
        self.boot = secrets.randbits(48)
        self._clock = clock
        self._phase: tuple[str, float] | None = None
        self._waits: dict[int, tuple[str, float]] = {}
        self._next = 0
        self._step = (-1, clock())  # (step count, when the watcher saw it change)
        self._n = 0

    def starting(self, what: str | None) -> None:
        """This rank's start-up is at ``what`` (None: it is done)."""
        with self.lock:
            self._phase = None if what is None else (what, self._clock())

    def waiting(self, what: str) -> int:
        """A wait for ``what`` begins; returns its token for :meth:`waited`."""
        with self.lock:
            token = self._next
            self._next += 1
            self._waits[token] = (what, self._clock())
            return token

    def waiting_now(self) -> bool:
        """Whether a wait is under way."""
        with self.lock:
            return bool(self._waits)

    def waited(self, token: int) -> None:
        with self.lock:
            self._waits.pop(token, None)
            self._step = (self._step[0], self._clock())  # back in its engine from now

    def beat(self, step: int) -> Beat:
        """This rank's next beat, its step count being ``step``."""
        now = self._clock()
        with self.lock:
            self._n += 1
            if step != self._step[0]:
                self._step = (step, now)
            if self._waits:
                what, since = min(self._waits.values(), key=lambda w: w[1])
                return Beat(self.boot, self._n, step, WAITING, now - since, what)
            if self._phase is not None:
                return Beat(self.boot, self._n, step, STARTING, now - self._phase[1],
                            self._phase[0])
            return Beat(self.boot, self._n, step, ENGINE, now - self._step[1], "")


@dataclass
class _Seen:
    text: str
    beat: Beat | None
    since: float  # the reader's time when it first saw this value
    changed: bool  # the value changed at least once while observed


class Peers:
    """What this rank knows of its peers' beats (global ranks; ``stage_of``
    names a rank's PP stage)."""

    def __init__(self, silent_s: float, stage_of: Callable[[int], int],
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.silent_s = silent_s
        self._stage_of = stage_of
        self._clock = clock
        self._seen: dict[int, _Seen] = {}
        self._joined = False  # past the handshake: every value read is this run's
        self.lock = threading.Lock()

    def joined(self) -> None:
        """The start-up handshake completed: every peer beat before it
        joined, so from now on a value read is this run's (a peer that stops
        right after the handshake is judged from its first read)."""
        with self.lock:
            self._joined = True
            self._seen.clear()

    def update(self, beats: dict[int, str]) -> None:
        """Values read from the board now (a rank without a beat is absent)."""
        now = self._clock()
        with self.lock:
            for rank, text in beats.items():
                seen = self._seen.get(rank)
                if seen is None:
                    self._seen[rank] = _Seen(text, Beat.decode(text), now, self._joined)
                elif seen.text != text:
                    self._seen[rank] = _Seen(text, Beat.decode(text), now, True)

    def quiet_s(self, rank: int) -> float | None:
        """How long ``rank``'s beat has not changed, for a peer seen beating;
        None for one never seen beating (not started, or an earlier run's key)."""
        with self.lock:
            seen = self._seen.get(rank)
            if seen is None or not seen.changed:
                return None
            return self._clock() - seen.since

    def silent(self, ranks: Sequence[int]) -> list[int]:
        """The ones of ``ranks`` whose beat stopped for more than silent_s."""
        return [r for r in ranks if (q := self.quiet_s(r)) is not None and q > self.silent_s]

    def alive(self, rank: int) -> bool:
        """Whether ``rank`` beats: its beat moved within ALIVE_S."""
        q = self.quiet_s(rank)
        return q is not None and q <= min(ALIVE_S, self.silent_s)

    def name(self, rank: int) -> str:
        return f"rank {rank} (PP stage {self._stage_of(rank)})"

    def describe(self, rank: int) -> str:
        """One phrase for ``rank`` as its beats show it: "rank 2 (PP stage 2):
        alive, in its engine's step 813 for 75 s"."""
        with self.lock:
            seen = self._seen.get(rank)
            now = self._clock()
        who = self.name(rank)
        if seen is None:
            return f"{who}: no heartbeat seen (not started, or no failure board)"
        quiet = now - seen.since
        if not seen.changed:
            return f"{who}: its heartbeat has not moved for {quiet:.0f} s since first read " \
                   "(not started, or stopped)"
        last = "?" if seen.beat is None else seen.beat.doing(0.0)
        if quiet > self.silent_s:
            return f"{who}: silent, no heartbeat for {quiet:.0f} s (last seen {last})"
        if quiet > ALIVE_S:
            return (f"{who}: its heartbeat has not moved for {quiet:.0f} s (silent at "
                    f"silent_s = {self.silent_s:g}; last seen {last})")
        now_doing = "?" if seen.beat is None else seen.beat.doing(quiet)
        return f"{who}: alive, {now_doing}"
