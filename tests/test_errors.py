"""ppsync.errors: one base class, "Raised when" docstrings, picklable fields."""

from __future__ import annotations

import inspect
import pickle

import pytest

from ppsync import errors
from ppsync.errors import (
    BatchError,
    ConfigError,
    DesyncError,
    PeerLost,
    PPSyncError,
    RankFailed,
    SyncTimeout,
)


def _error_classes() -> list[type[BaseException]]:
    """Every exception class defined in ppsync.errors (not imported into it)."""
    return [
        obj
        for _, obj in inspect.getmembers(errors, inspect.isclass)
        if issubclass(obj, BaseException) and obj.__module__ == errors.__name__
    ]


_SUBCLASSES = [c for c in _error_classes() if c is not PPSyncError]


def test_module_defines_the_documented_classes() -> None:
    names = {c.__name__ for c in _error_classes()}
    assert names == set(errors.__all__)
    assert len(_SUBCLASSES) >= 8


@pytest.mark.parametrize("cls", _SUBCLASSES, ids=lambda c: c.__name__)
def test_every_error_subclasses_the_base(cls: type[BaseException]) -> None:
    assert issubclass(cls, PPSyncError)


@pytest.mark.parametrize("cls", _SUBCLASSES, ids=lambda c: c.__name__)
def test_every_error_says_when_it_is_raised(cls: type[BaseException]) -> None:
    doc = cls.__doc__
    assert doc is not None
    assert doc.startswith("Raised when"), f"{cls.__name__}: {doc!r}"


@pytest.mark.parametrize(
    ("cls", "builtin"),
    [
        (ConfigError, ValueError),
        (BatchError, ValueError),
        (SyncTimeout, TimeoutError),
        (PeerLost, ConnectionError),
    ],
)
def test_builtin_bases_let_generic_handlers_catch(
    cls: type[PPSyncError], builtin: type[Exception]
) -> None:
    assert issubclass(cls, builtin)


def test_desync_error_keeps_both_views() -> None:
    err = DesyncError("seq differs", expected={"seq": 3}, received={"seq": 4})
    assert str(err) == "seq differs"
    assert err.expected == {"seq": 3}
    assert err.received == {"seq": 4}


def test_desync_error_survives_pickle() -> None:
    err = DesyncError(
        "rank 1: frame disagrees", expected={"seq": 3, "num_reqs": 2},
        received={"seq": 4, "num_reqs": 2},
    )
    back = pickle.loads(pickle.dumps(err))
    assert type(back) is DesyncError
    assert str(back) == "rank 1: frame disagrees"
    assert back.expected == {"seq": 3, "num_reqs": 2}
    assert back.received == {"seq": 4, "num_reqs": 2}


@pytest.mark.parametrize("peer", [None, 0, 7])
def test_peer_lost_survives_pickle(peer: int | None) -> None:
    err = PeerLost("connection reset by rank", peer=peer)
    back = pickle.loads(pickle.dumps(err))
    assert type(back) is PeerLost
    assert str(back) == "connection reset by rank"
    assert back.peer == peer


def test_peer_lost_defaults_to_unknown_peer() -> None:
    assert PeerLost("gone").peer is None


def test_rank_failed_survives_pickle() -> None:
    err = RankFailed("2 ranks failed", {0: ValueError("boom"), 2: "killed by signal 9"})
    back = pickle.loads(pickle.dumps(err))
    assert type(back) is RankFailed
    assert str(back) == "2 ranks failed"
    assert set(back.errors) == {0, 2}
    inner = back.errors[0]
    assert isinstance(inner, ValueError)
    assert str(inner) == "boom"
    assert back.errors[2] == "killed by signal 9"


def test_rank_failed_without_errors_has_empty_mapping() -> None:
    err = RankFailed("nothing recorded")
    assert err.errors == {}
    assert pickle.loads(pickle.dumps(err)).errors == {}


def test_nested_errors_survive_pickle_inside_rank_failed() -> None:
    desync = DesyncError("x", expected={"seq": 1}, received={"seq": 2})
    err = RankFailed("1 rank failed", {1: desync, 3: PeerLost("y", peer=2)})
    back = pickle.loads(pickle.dumps(err))
    inner = back.errors[1]
    assert isinstance(inner, DesyncError)
    assert inner.received == {"seq": 2}
    lost = back.errors[3]
    assert isinstance(lost, PeerLost)
    assert lost.peer == 2
