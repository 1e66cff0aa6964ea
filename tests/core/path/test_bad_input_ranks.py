"""Bad inputs on real gloo ranks: the offending rank gets a typed error before
any collective, and the group then completes a valid step on every rank.

One P = 2 world (rank 0 receives, rank 1 is the last rank) plays a script of
rounds. In each round the offending rank makes one bad call, then both ranks
make a valid step; the receiver checks, one round later (D = 1), that the
valid step arrived intact. A bad call that had issued a collective would have
shifted every later frame (DesyncError or wrong rows), or left the peer
waiting until the deadline.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
import pytest
import torch
import torch.distributed as dist

from ppsync.core import SampledStep
from ppsync.core.path.token_path import TokenPath
from ppsync.core.rules import BatchView
from ppsync.core.wire.groups import token_group
from ppsync.errors import BatchError, PPSyncError, ProtocolError, RoleError
from ppsync.harness.launcher import RankEnv, spawn_ranks
from ppsync.schemas.config import SyncConfig

MAX_NUM_REQS = 8
K = 2  # L = 3
L = K + 1
TIMEOUT_S = 10.0
CONFIG = SyncConfig.build(
    pp_size=2, max_num_reqs=MAX_NUM_REQS, num_speculative_steps=K, ring_depth=1,
    timeout_s=TIMEOUT_S, wire="fixed",
)
RECEIVER, LAST = 0, 1


# -- the valid step of round r -------------------------------------------


def _view(
    idx: list[int] | np.ndarray,
    *,
    num_reqs: int | None = None,
    computed: int = 10,
) -> BatchView:
    idx_np = idx if isinstance(idx, np.ndarray) else np.array(idx, dtype=np.int64)
    n = idx_np.shape[0]
    return BatchView(
        num_reqs=n if num_reqs is None else num_reqs,
        idx_mapping_np=idx_np,
        num_computed_tokens_np=np.full(n, computed, dtype=np.int64),
        num_scheduled_tokens_np=np.full(n, 1 + K, dtype=np.int64),
        prefill_len_np=np.full(n, 5, dtype=np.int64),
    )


def _idx(r: int) -> list[int]:
    return [r % MAX_NUM_REQS, (r + 3) % MAX_NUM_REQS, (r + 5) % MAX_NUM_REQS]


NUM_SAMPLED = [1, 2, 3]
NUM_REJECTED = [2, 1, 0]


def _tokens_np(r: int) -> np.ndarray:  # [3, L] int64, -1 past num_sampled
    rows, cols = np.meshgrid(np.arange(3), np.arange(L), indexing="ij")
    tokens = 1000 * r + 10 * rows + cols
    return np.where(cols < np.array(NUM_SAMPLED)[:, None], tokens, -1).astype(np.int64)


def _drafts_np(r: int) -> np.ndarray:  # [3, K] int64
    rows, cols = np.meshgrid(np.arange(3), np.arange(K), indexing="ij")
    return (500_000 + 1000 * r + 10 * rows + cols).astype(np.int64)


def _publish(path: TokenPath, r: int, **bad: object) -> int:
    """Publish round r's step; ``bad`` replaces one of its arguments."""
    args: dict[str, object] = {
        "view": _view(_idx(r)),
        "sampled_token_ids": torch.from_numpy(_tokens_np(r)),
        "num_sampled": torch.tensor(NUM_SAMPLED, dtype=torch.int32),
        "num_rejected": torch.tensor(NUM_REJECTED, dtype=torch.int32),
        "draft_tokens": torch.from_numpy(_drafts_np(r)),
    }
    args.update(bad)
    a: dict[str, Any] = args  # bad values among them, as given
    sampled = SampledStep[torch.Tensor](a["sampled_token_ids"], a["num_sampled"],
                                        a["num_rejected"], a["draft_tokens"])
    return path.publish(args["view"], sampled)  # type: ignore[arg-type]


def _tok(rows: int, width: int, dtype: torch.dtype = torch.int64) -> torch.Tensor:
    return torch.zeros(rows, width, dtype=dtype)


def _i32(values: list[int]) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int32)


# -- the script -------------------------------------------------------------

When = Literal["before_consume", "after_consume", "after_post", "before_publish"]


@dataclass(frozen=True)
class Case:
    name: str
    rank: int  # the offending rank
    when: When  # where in the round the bad call comes
    call: Callable[[TokenPath, int], object]  # (path, round) -> makes the bad call
    error: type[PPSyncError]
    match: str  # re.search pattern for the message


def _recv(name: str, when: When, call: Callable[[TokenPath, int], object],
          error: type[PPSyncError], match: str) -> Case:
    return Case(name, RECEIVER, when, call, error, match)


def _last(name: str, call: Callable[[TokenPath, int], object],
          error: type[PPSyncError], match: str) -> Case:
    return Case(name, LAST, "before_publish", call, error, match)


CASES: list[Case] = [
    # batch views, on the receiver (post) and on the last rank (publish)
    _recv("post-idx-too-large", "after_consume", lambda p, r: p.post(_view([0, 1, 8])),
          BatchError, r"idx_mapping\[2\] = 8 outside \[0, max_num_reqs = 8\)"),
    _recv("post-idx-negative", "after_consume", lambda p, r: p.post(_view([3, -1, 4])),
          BatchError, r"idx_mapping\[1\] = -1 outside \[0, max_num_reqs = 8\)"),
    _recv("post-num-reqs-over-max", "after_consume",
          lambda p, r: p.post(_view(list(range(9)))),
          BatchError, r"num_reqs = 9 must lie in \[0, max_num_reqs = 8\]"),
    _recv("post-idx-shape", "after_consume",
          lambda p, r: p.post(_view([0, 1], num_reqs=3)),
          BatchError, r"idx_mapping_np\.shape = \(2,\) must be \(num_reqs,\) = \(3,\)"),
    _recv("post-idx-float", "after_consume",
          lambda p, r: p.post(_view(np.array([0.0, 1.0, 2.0]))),
          BatchError, r"idx_mapping_np\.dtype = float64 must be an integer dtype"),
    _recv("post-idx-twice", "after_consume", lambda p, r: p.post(_view([2, 5, 2])),
          BatchError, r"idx_mapping holds request slot index \d+ twice"),
    _recv("post-computed-negative", "after_consume",
          lambda p, r: p.post(_view([0, 1, 2], computed=-1)),
          BatchError, r"num_computed_tokens_np\[\d\] = -1 outside \[0, 2\*\*62\)"),
    _last("publish-idx-too-large", lambda p, r: _publish(p, r, view=_view([0, 8, 1])),
          BatchError, r"idx_mapping\[1\] = 8 outside \[0, max_num_reqs = 8\)"),
    _last("publish-num-reqs-over-max",
          lambda p, r: _publish(
              p, r, view=_view(list(range(9))), sampled_token_ids=_tok(9, L),
              num_sampled=_i32([1] * 9), num_rejected=_i32([0] * 9),
              draft_tokens=_tok(9, K)),
          BatchError, r"num_reqs = 9 must lie in \[0, max_num_reqs = 8\]"),
    # sampler outputs, on the last rank
    _last("width-zero", lambda p, r: _publish(p, r, sampled_token_ids=_tok(3, 0)),
          BatchError, r"sampled_token_ids\.shape\[1\] = 0 must lie in \[1, L = 3\]"),
    _last("width-over-L", lambda p, r: _publish(p, r, sampled_token_ids=_tok(3, L + 1)),
          BatchError, r"sampled_token_ids\.shape\[1\] = 4 must lie in \[1, L = 3\]"),
    _last("num-sampled-over-width",
          lambda p, r: _publish(p, r, sampled_token_ids=_tok(3, 2), num_sampled=_i32([1, 3, 1])),
          BatchError, r"num_sampled\[1\] = 3 outside \[0, w = 2\]"),
    _last("num-sampled-negative",
          lambda p, r: _publish(p, r, num_sampled=_i32([1, 1, -1])),
          BatchError, r"num_sampled\[2\] = -1 outside \[0, w = 3\]"),
    _last("num-rejected-over-K",
          lambda p, r: _publish(p, r, num_rejected=_i32([0, K + 1, 0])),
          BatchError, r"num_rejected\[1\] = 3 outside \[0, K = 2\]"),
    _last("num-rejected-negative",
          lambda p, r: _publish(p, r, num_rejected=_i32([-1, 0, 0])),
          BatchError, r"num_rejected\[0\] = -1 outside \[0, K = 2\]"),
    _last("tokens-float",
          lambda p, r: _publish(p, r, sampled_token_ids=_tok(3, L, torch.float32)),
          BatchError, r"sampled_token_ids\.dtype = torch\.float32 must be torch\.int64"),
    _last("num-sampled-float",
          lambda p, r: _publish(p, r, num_sampled=torch.ones(3)),
          BatchError, r"num_sampled\.dtype = torch\.float32 must be torch\.int64"),
    _last("tokens-not-a-tensor",
          lambda p, r: _publish(p, r, sampled_token_ids=_tokens_np(r)),
          BatchError, r"sampled_token_ids must be a torch\.Tensor, got ndarray"),
    _last("tokens-one-dim",
          lambda p, r: _publish(p, r, sampled_token_ids=torch.zeros(3, dtype=torch.int64)),
          BatchError, r"sampled_token_ids has 1 dims, shape \(3,\); 2 expected"),
    _last("tokens-rows", lambda p, r: _publish(p, r, sampled_token_ids=_tok(2, L)),
          BatchError, r"sampled_token_ids\.shape\[0\] = 2 must equal num_reqs = 3"),
    _last("num-sampled-shape", lambda p, r: _publish(p, r, num_sampled=_i32([1, 1])),
          BatchError, r"num_sampled\.shape = \(2,\) must be \(num_reqs,\) = \(3,\)"),
    _last("num-rejected-shape", lambda p, r: _publish(p, r, num_rejected=_i32([0] * 4)),
          BatchError, r"num_rejected\.shape = \(4,\) must be \(num_reqs,\) = \(3,\)"),
    _last("drafts-shape", lambda p, r: _publish(p, r, draft_tokens=_tok(3, K + 1)),
          BatchError, r"draft_tokens\.shape = \(3, 3\) must be \(num_reqs, K\) = \(3, 2\)"),
    _last("drafts-float", lambda p, r: _publish(p, r, draft_tokens=_tok(3, K, torch.float64)),
          BatchError, r"draft_tokens\.dtype = torch\.float64 must be torch\.int64"),
    # outputs whose data the host cannot read: the device codec's error for a
    # tensor off its device, before any collective (not a raw NotImplementedError)
    _last("tokens-on-meta",
          lambda p, r: _publish(p, r, sampled_token_ids=_tok(3, L).to("meta")),
          BatchError, r"^sampled_token_ids is on meta; the token path's device is cpu$"),
    _last("num-sampled-on-meta",
          lambda p, r: _publish(p, r, num_sampled=_i32(NUM_SAMPLED).to("meta")),
          BatchError, r"^num_sampled is on meta; the token path's device is cpu$"),
    _last("num-rejected-on-meta",
          lambda p, r: _publish(p, r, num_rejected=_i32(NUM_REJECTED).to("meta")),
          BatchError, r"^num_rejected is on meta; the token path's device is cpu$"),
    _last("drafts-on-meta", lambda p, r: _publish(p, r, draft_tokens=_tok(3, K).to("meta")),
          BatchError, r"^draft_tokens is on meta; the token path's device is cpu$"),
    _recv("consume-draft-table-on-meta", "before_consume",
          lambda p, r: p.consume(_tok(MAX_NUM_REQS, K).to("meta")),
          BatchError, r"^draft_tokens_to_update is on meta: a tensor without data cannot take "
          r"drafts$"),
    _last("free-slot-out-of-range", lambda p, r: p.free(MAX_NUM_REQS),
          BatchError, r"req_idx = 8 outside \[0, max_num_reqs = 8\)"),
    _recv("consume-draft-table-shape", "before_consume",
          lambda p, r: p.consume(_tok(MAX_NUM_REQS, K - 1)),
          BatchError,
          r"draft_tokens_to_update\.shape = \(8, 1\) must be \(max_num_reqs, K\) = \(8, 2\)"),
    # roles
    _recv("publish-on-receiver", "after_consume", lambda p, r: _publish(p, r),
          RoleError, r"publish\(\) belongs to the last rank; group rank 0 of pp_size 2"),
    _last("post-on-last", lambda p, r: p.post(_view(_idx(r))),
          RoleError, r"post\(\) belongs to a non-last rank; group rank 1 of pp_size 2"),
    _last("consume-on-last", lambda p, r: p.consume(),
          RoleError, r"consume\(\) belongs to a non-last rank"),
    # call order, on the receiver
    _recv("post-twice", "after_post", lambda p, r: p.post(_view(_idx(r))),
          ProtocolError, r"post\(\) without a consume\(\) before it"),
]


# -- the ranks --------------------------------------------------------------


@dataclass(frozen=True)
class Attempt:
    """A bad call and the state of the token path around it."""

    case: str
    error: str  # the exception's type name, "" when nothing was raised
    message: str
    before: tuple[int, int, int, int]  # (seq, steps, ring slots filled, works in flight)
    after: tuple[int, int, int, int]


@dataclass(frozen=True)
class Delivered:
    """What one consume released: the valid step of the round before."""

    seq: int
    tokens: list[list[int]]
    num_sampled: list[int]
    num_rejected: list[int]
    idx: list[int]
    drafts: list[list[int]] | None
    table_rows: list[list[int]]  # the draft table at the released rows' slots


@dataclass(frozen=True)
class RankRun:
    attempts: list[Attempt]
    delivered: list[Delivered | None]  # receiver: one per consume
    sent: list[int]  # last rank: one per valid publish
    after_close: str  # "Type: message" of a call made after close()


def _state(path: TokenPath) -> tuple[int, int, int, int]:
    return (path.seq, path.steps, len(list(path.ring.pending())),
            len(path._inflight))


def _attempt(path: TokenPath, case: Case, r: int) -> Attempt:
    before = _state(path)
    try:
        case.call(path, r)
    except Exception as e:  # recorded; the parent checks type and message
        return Attempt(case.name, type(e).__name__, str(e), before, _state(path))
    return Attempt(case.name, "", "", before, _state(path))


def _bad(path: TokenPath, rank: int, when: When, case: Case, r: int,
         out: list[Attempt]) -> None:
    if case.rank == rank and case.when == when:
        out.append(_attempt(path, case, r))


def _delivered(path: TokenPath, table: torch.Tensor) -> Delivered | None:
    released = path.consume(table)
    if released is None:
        return None
    idx = released.idx_mapping.numpy()
    return Delivered(
        seq=released.seq,
        tokens=released.sampled_tokens.tolist(),
        num_sampled=released.num_sampled.tolist(),
        num_rejected=released.num_rejected.tolist(),
        idx=idx.tolist(),
        drafts=None if released.draft_tokens is None else released.draft_tokens.tolist(),
        table_rows=table[torch.from_numpy(idx[idx >= 0])].tolist(),
    )


def _script_rank(env: RankEnv) -> RankRun:
    group = token_group(dist.group.WORLD, timeout_s=TIMEOUT_S)  # type: ignore[arg-type]
    path = TokenPath(CONFIG, group)
    attempts: list[Attempt] = []
    delivered: list[Delivered | None] = []
    sent: list[int] = []
    table = torch.full((MAX_NUM_REQS, K), -1, dtype=torch.int64)
    for r, case in enumerate(CASES):
        if path.is_last:
            _bad(path, env.rank, "before_publish", case, r, attempts)
            sent.append(_publish(path, r))
        else:
            _bad(path, env.rank, "before_consume", case, r, attempts)
            delivered.append(_delivered(path, table))
            _bad(path, env.rank, "after_consume", case, r, attempts)
            path.post(_view(_idx(r)))
            _bad(path, env.rank, "after_post", case, r, attempts)
    if not path.is_last:
        delivered.append(_delivered(path, table))
        path.post(_view([]))
    path.close()
    try:
        if path.is_last:
            _publish(path, len(CASES))
        else:
            path.consume()
    except Exception as e:
        after_close = f"{type(e).__name__}: {e}"
    else:
        after_close = ""
    return RankRun(attempts, delivered, sent, after_close)


@pytest.fixture(scope="module")
def world() -> list[RankRun]:
    return spawn_ranks(_script_rank, 2, timeout_s=TIMEOUT_S)


# -- the checks -------------------------------------------------------------


def test_script_covers_both_roles_and_every_hook() -> None:
    assert len({c.name for c in CASES}) == len(CASES)
    hooks = {(c.rank, c.when) for c in CASES}
    assert hooks == {
        (RECEIVER, "before_consume"), (RECEIVER, "after_consume"), (RECEIVER, "after_post"),
        (LAST, "before_publish"),
    }


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_bad_call_raises_typed_error_before_any_collective(
    world: list[RankRun], case: Case
) -> None:
    attempts = [a for a in world[case.rank].attempts if a.case == case.name]
    assert len(attempts) == 1
    (a,) = attempts
    assert a.error == case.error.__name__, a
    assert re.search(case.match, a.message), a.message
    # no frame issued or posted, no step counted, nothing queued
    assert a.after == a.before, a
    other = world[1 - case.rank]
    assert all(x.case != case.name for x in other.attempts)


def test_every_valid_step_after_a_bad_call_arrives_intact(world: list[RankRun]) -> None:
    receiver, last = world
    assert last.sent == [3] * len(CASES)  # every valid publish issued its frame
    assert len(receiver.delivered) == len(CASES) + 1
    assert receiver.delivered[0] is None  # D = 1: nothing posted before round 0
    for r, got in enumerate(receiver.delivered[1:]):
        assert got is not None, f"round {r}'s step was not released"
        # frames are numbered by valid steps only: the bad calls issued none
        assert got.seq == r
        assert got.tokens == _tokens_np(r).tolist()
        assert got.num_sampled == NUM_SAMPLED
        assert got.num_rejected == NUM_REJECTED
        assert got.idx == _idx(r)
        assert got.drafts == _drafts_np(r).tolist()
        assert got.table_rows == _drafts_np(r).tolist()


def test_calls_after_close_are_protocol_errors(world: list[RankRun]) -> None:
    for run in world:
        assert re.search(r"^ProtocolError: rank \d: token path used after close\(\)$",
                         run.after_close), run.after_close
