"""A loopback in place of the frames' collective, for the hot own-CPU figure.

Two real :class:`TokenPath` objects in one thread, the last rank's and a
receiver's, made on a real two-rank gloo group (their handshake runs on it),
then linked by a :class:`LoopbackLink`: the last rank's ``issue`` holds its
frame, the receiver's ``issue`` copies it into the posted buffer and
completes both works at once. Everything else (checks, mask, digest, codec,
ring, recorder, release) is the path's own code.

Why not gloo for this figure: a gloo transfer wakes gloo's threads, which
preempt the caller on these 2 cores about once per step, and the first numpy
call after a preemption or a blocking wait costs several times its hot cost
(docs/measured.md). That measures the machine, not the path; the in-rank figures are ``ppsync
bench``'s lockstep and pipelined CPU rows.
"""

from __future__ import annotations

from collections import deque
from datetime import timedelta

import torch
import torch.distributed as dist


class LoopWork(dist.Work):
    """A work that completes when its future is set."""

    def __init__(self) -> None:
        super().__init__()
        self.future: torch.futures.Future[None] = torch.futures.Future()

    def get_future(self) -> torch.futures.Future[None]:
        return self.future

    def is_completed(self) -> bool:
        return self.future.done()

    def wait(self, timeout: timedelta | None = None) -> bool:
        if not self.future.done():  # one thread: nothing else could complete it
            raise RuntimeError("loopback: connection closed, the frame has no peer call")
        return True


class _End:
    def __init__(self, link: LoopbackLink, sender: bool) -> None:
        self.link, self.sender = link, sender

    def issue(self, buf: torch.Tensor) -> dist.Work:
        work = LoopWork()
        mine, other = ((self.link.sends, self.link.recvs) if self.sender
                       else (self.link.recvs, self.link.sends))
        if other:
            peer_buf, peer_work = other.popleft()
            src, dst = (buf, peer_buf) if self.sender else (peer_buf, buf)
            dst.copy_(src)
            peer_work.future.set_result(None)
            work.future.set_result(None)
        else:
            mine.append((buf, work))
        return work


class LoopbackLink:
    """Pairs the last rank's frames with a receiver's posts, in order."""

    def __init__(self) -> None:
        self.sends: deque[tuple[torch.Tensor, LoopWork]] = deque()
        self.recvs: deque[tuple[torch.Tensor, LoopWork]] = deque()

    def end(self, *, last: bool) -> _End:
        """The transport for the last rank's path (``last``) or a receiver's."""
        return _End(self, last)
