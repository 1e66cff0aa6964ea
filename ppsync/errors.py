"""Every exception ppsync raises, under one base class.

This module sits below every layer (it imports nothing from ppsync), so
schemas, core, compat, services and the CLI all raise the same types.

Messages name the field, the value and the rule that was broken, e.g.
``num_sampled[3] = 5 exceeds the sample width w = 4``. Input errors are raised
before any collective is issued, so a bad call on one rank never leaves its
peers matched to a collective that will not come.
"""

from __future__ import annotations

__all__ = [
    "BatchError",
    "ConfigError",
    "DesyncError",
    "PPSyncError",
    "PeerLost",
    "ProtocolError",
    "RankFailed",
    "RoleError",
    "Stopped",
    "SyncTimeout",
]


class PPSyncError(Exception):
    """Base class of every error ppsync raises on purpose."""


class ConfigError(PPSyncError, ValueError):
    """Raised when a configuration value is out of range or inconsistent
    (pp_size, max_num_reqs, ring depth, timeout, wire mode, ...)."""


class BatchError(PPSyncError, ValueError):
    """Raised when a batch view or a step's sampled outputs break a rule on
    dtype, shape or range; raised before any collective."""


class RoleError(PPSyncError):
    """Raised when a rank calls an operation that belongs to the other role
    (a broadcast on a non-last rank, a receive on the last rank)."""


class ProtocolError(PPSyncError):
    """Raised when calls come out of the documented order (two posts without a
    consume between them, a use after close, ...); raised before any
    collective."""


class DesyncError(PPSyncError):
    """Raised when a received frame disagrees with this rank's own view of the
    step (step number, num_reqs, widths, idx_mapping digest, checksum).

    ``expected`` is this rank's view, ``received`` what the frame header says.
    """

    def __init__(self, message: str, *, expected: dict[str, int], received: dict[str, int]):
        super().__init__(message)
        self.expected = expected
        self.received = received

    def __reduce__(self) -> tuple[object, ...]:
        # keyword-only fields survive pickling across rank processes
        return (_rebuild, (DesyncError, str(self), {"expected": self.expected,
                                                    "received": self.received}))


class SyncTimeout(PPSyncError, TimeoutError):
    """Raised when a bounded wait (a transfer, a consumer wait, a rendezvous)
    passes its deadline; the peer is alive as far as ppsync can tell but
    silent. ``peer`` is the silent global rank where known (with a failure
    board: the rank that never posted), else None."""

    def __init__(self, message: str, *, peer: int | None = None):
        super().__init__(message)
        self.peer = peer

    def __reduce__(self) -> tuple[object, ...]:
        return (_rebuild, (SyncTimeout, str(self), {"peer": self.peer}))


class PeerLost(PPSyncError, ConnectionError):
    """Raised when a transfer fails because a peer rank is gone (connection
    reset or closed); ``peer`` is the lost global rank where known."""

    def __init__(self, message: str, *, peer: int | None = None):
        super().__init__(message)
        self.peer = peer

    def __reduce__(self) -> tuple[object, ...]:
        return (_rebuild, (PeerLost, str(self), {"peer": self.peer}))


class RankFailed(PPSyncError):
    """Raised when a launcher's rank process raised, crashed or was killed;
    ``errors`` holds each failed rank's exception (or a description of its
    exit)."""

    def __init__(self, message: str, errors: dict[int, BaseException | str] | None = None):
        super().__init__(message)
        self.errors = errors or {}

    def __reduce__(self) -> tuple[object, ...]:
        return (RankFailed, (str(self), self.errors))


class Stopped(PPSyncError):
    """Raised when a launcher was asked to stop (SIGTERM, SIGINT) and ended
    its ranks and its store; ``signum`` is the signal."""

    def __init__(self, message: str, signum: int = 0):
        super().__init__(message)
        self.signum = signum

    def __reduce__(self) -> tuple[object, ...]:
        return (_rebuild, (Stopped, str(self), {"signum": self.signum}))


def _rebuild(cls: type[PPSyncError], message: str, fields: dict[str, object]) -> PPSyncError:
    return cls(message, **fields)
