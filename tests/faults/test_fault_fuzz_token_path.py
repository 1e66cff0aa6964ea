"""Hypothesis fuzzing of every public entry of TokenPath, on real gloo ranks.

One P = 2 world (rank 0 receives, rank 1 is the last rank, D = 1, K = 2).
Each rank runs hypothesis itself, derandomized, over the same strategy, so
both generate the same schedule of bad calls (the ranks compare a digest of
it through the run's store before starting). Round r of the schedule: the
offending rank makes its one bad call at its place in the engine order, then
both ranks make a valid step r; the receiver checks, one round later, that
step r arrived intact. A bad call that had issued a collective would shift
every later frame (a DesyncError or wrong rows) or leave the peer waiting.

Bad calls: a batch view with one field broken (type, dtype, shape, range,
a repeated request slot, a num_reqs that is not the arrays'), bad sampler
outputs and drafts, a bad draft table, a bad freed slot, a call that belongs
to the other role, calls out of order (post before consume, post twice,
consume twice), and, once both ranks closed, every entry after close(). Each
must raise a PPSyncError subclass whose message names the field (or the
call), leaving seq, the step count, the ring and the works in flight as they
were.

Calls that reveal ppsync bugs (``known_bug``) stay in the schedule, as long
as they issue nothing; their checks are a strict xfail of their own. Bad
calls that ppsync accepts and that would then send a frame are probed on the
last rank with a step that has no transfer (``_probes``).
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import Literal

import numpy as np
import pytest
import torch
import torch.distributed as dist
from fault_fuzz_inputs import (
    Bad,
    bad_int,
    collect,
    fingerprint,
    int_tensor,
    replace_field,
    uniform,
    view_bads,
)
from fault_tools import watchdog
from hypothesis import strategies as st

from ppsync.core.batch import BatchView
from ppsync.core.groups import token_group
from ppsync.core.handler import PreparedStep, TokenPath
from ppsync.errors import PPSyncError
from ppsync.schemas.config import SyncConfig
from ppsync.services.launcher import RankEnv, spawn_ranks

MAX_NUM_REQS = 8
K = 2
L = K + 1
TIMEOUT_S = 10.0
EXAMPLES = 240  # bad calls, one per round
AFTER_CLOSE_EXAMPLES = 60  # calls after close(), per rank
CONFIG = SyncConfig.build(
    pp_size=2, max_num_reqs=MAX_NUM_REQS, num_speculative_steps=K, ring_depth=1,
    timeout_s=TIMEOUT_S, wire="fixed",
)
RECEIVER, LAST = 0, 1

# -- valid values ---------------------------------------------------------------


def _view(idx: list[int], *, computed: int = 10, scheduled: int = 1 + K) -> BatchView:
    """Decode rows in request slots ``idx``: every row needs a sample."""
    n = len(idx)
    return BatchView(
        num_reqs=n,
        idx_mapping_np=np.array(idx, dtype=np.int64),
        num_computed_tokens_np=np.full(n, computed, dtype=np.int64),
        num_scheduled_tokens_np=np.full(n, scheduled, dtype=np.int64),
        prefill_len_np=np.full(n, 5, dtype=np.int64),
    )


def _idx(r: int) -> list[int]:
    return [r % MAX_NUM_REQS, (r + 3) % MAX_NUM_REQS, (r + 5) % MAX_NUM_REQS]


NUM_SAMPLED = [1, 2, 3]
NUM_REJECTED = [2, 1, 0]


def _tokens(r: int) -> torch.Tensor:  # [3, L] int64, -1 past num_sampled
    rows, cols = np.meshgrid(np.arange(3), np.arange(L), indexing="ij")
    tokens = 1000 * r + 10 * rows + cols
    return torch.from_numpy(np.where(cols < np.array(NUM_SAMPLED)[:, None], tokens, -1))


def _drafts(r: int) -> torch.Tensor:  # [3, K] int64
    rows, cols = np.meshgrid(np.arange(3), np.arange(K), indexing="ij")
    return torch.from_numpy(500_000 + 1000 * r + 10 * rows + cols)


def _outputs(r: int) -> dict[str, object]:
    return {
        "sampled_token_ids": _tokens(r),
        "num_sampled": torch.tensor(NUM_SAMPLED, dtype=torch.int32),
        "num_rejected": torch.tensor(NUM_REJECTED, dtype=torch.int32),
    }


BASE_IDX = [2, 5, 7]  # the request slots of every bad call's otherwise valid view
BASE = _view(BASE_IDX)
BASE_R = 10_000  # the round whose tokens bad calls carry (any valid values do)

# -- the schedule ------------------------------------------------------------------

When = Literal["before_consume", "after_consume", "after_post", "before_publish"]
RECEIVER_HOOKS: list[When] = ["before_consume", "after_consume", "after_post"]


@dataclass(frozen=True)
class BadCall:
    """One bad call: who makes it, where in the round, into which entry, with
    which argument (``arg``) replaced by ``bad.value``."""

    rank: int
    when: When
    entry: str  # a TokenPath method
    arg: str  # the argument or batch-view attribute broken; "" for role/order calls
    bad: Bad
    error: str  # the PPSyncError subclass expected

    def describe(self) -> str:
        return f"rank {self.rank} {self.when} {self.entry}({self.arg}) {self.bad.describe()}"


VIEW_BAD = view_bads(3, BASE.idx_mapping_np, {
    "num_computed_tokens_np": BASE.num_computed_tokens_np,
    "num_scheduled_tokens_np": BASE.num_scheduled_tokens_np,
    "prefill_len_np": BASE.prefill_len_np,
}, MAX_NUM_REQS)
# Not a batch view at all (ppsync reads its attributes without checking its type).
NOT_A_VIEW = st.sampled_from([
    ("None", None), ("dict", {"num_reqs": 3}), ("tuple", (3,)), ("str", "view"), ("int", 3),
]).map(lambda tv: Bad("view", "type", tv[0], tv[1]))


def _view_calls(rank: int, when: When, entry: str) -> list[st.SearchStrategy[BadCall]]:
    """One target per batch-view attribute, and one for a view that is none."""
    out = [VIEW_BAD[a].map(functools.partial(_call, rank, when, entry, a, "BatchError"))
           for a in sorted(VIEW_BAD)]
    out.append(NOT_A_VIEW.map(functools.partial(_call, rank, when, entry, "view", "BatchError")))
    return out


def _call(rank: int, when: When, entry: str, arg: str, error: str, bad: Bad) -> BadCall:
    return BadCall(rank, when, entry, arg, bad, error)


OUTPUT_BAD: dict[str, st.SearchStrategy[Bad]] = {
    "sampled_token_ids": int_tensor("sampled_token_ids", _tokens(BASE_R),
                                    bad_widths=[0, L + 1, L + 4]),
    "num_sampled": int_tensor("num_sampled", torch.tensor(NUM_SAMPLED), lo=0, hi=L),
    "num_rejected": int_tensor("num_rejected", torch.tensor(NUM_REJECTED), lo=0, hi=K),
    "draft_tokens": int_tensor("draft_tokens", _drafts(BASE_R), optional=True,
                               bad_widths=[0, 1, K + 1]),
}
TABLE_BAD = int_tensor("draft_tokens_to_update", torch.full((MAX_NUM_REQS, K), -1),
                       optional=True, bad_widths=[0, 1, K + 1])
FREE_BAD = bad_int("req_idx", 0, MAX_NUM_REQS)
# drafts_np of send(): a [num_reqs, K] int array; a shape it cannot have, or
# not an array at all
SEND_DRAFTS_BAD = uniform([
    st.sampled_from([(0, K), (2, K), (4, K), (3, 0), (3, 1), (3, K + 1), (3 * K,),
                     (3, K, 1)]).map(
        lambda s: Bad("drafts", "shape", f"shape {s}", np.zeros(s, dtype=np.int64))),
    st.sampled_from([("list", _drafts(BASE_R).tolist()), ("int", 1)]).map(
        lambda tv: Bad("drafts", "type", tv[0], tv[1])),
])
NOT_A_STEP = st.sampled_from([("None", None), ("batch view", BASE)]).map(
    lambda tv: Bad("step", "type", tv[0], tv[1]))


def _last_targets() -> list[st.SearchStrategy[BadCall]]:
    w: When = "before_publish"
    out: list[st.SearchStrategy[BadCall]] = []
    for entry in ("publish", "prepare"):
        out += _view_calls(LAST, w, entry)
        out += [OUTPUT_BAD[a].map(functools.partial(_call, LAST, w, entry, a, "BatchError"))
                for a in sorted(OUTPUT_BAD)]
    out += [
        SEND_DRAFTS_BAD.map(functools.partial(_call, LAST, w, "send", "drafts_np", "BatchError")),
        NOT_A_STEP.map(functools.partial(_call, LAST, w, "send", "step", "BatchError")),
        FREE_BAD.map(functools.partial(_call, LAST, w, "free", "req_idx", "BatchError")),
        st.sampled_from([
            ("post", "receive()"), ("consume", "get_prev_sampled_outputs()"),
            ("require_role", "receive()"),
        ]).map(lambda ef: BadCall(LAST, w, ef[0], "", Bad(ef[1], "role", ef[0], None),
                                  "RoleError")),
    ]
    return out


def _receiver_targets() -> list[st.SearchStrategy[BadCall]]:
    hooks = st.sampled_from(RECEIVER_HOOKS)
    orders: list[tuple[When, str, str]] = [
        ("before_consume", "post", "post()"), ("after_post", "post", "post()"),
        ("after_consume", "consume", "consume()"),
    ]
    return [
        *_view_calls(RECEIVER, "after_consume", "post"),
        TABLE_BAD.map(functools.partial(_call, RECEIVER, "before_consume", "consume",
                                        "draft_tokens_to_update", "BatchError")),
        st.tuples(hooks, FREE_BAD).map(
            lambda hb: BadCall(RECEIVER, hb[0], "free", "req_idx", hb[1], "BatchError")),
        st.sampled_from(orders).map(
            lambda o: BadCall(RECEIVER, o[0], o[1], "", Bad(o[2], "order", o[0], None),
                              "ProtocolError")),
        st.tuples(hooks, st.sampled_from(["publish", "prepare", "send", "require_role"])).map(
            lambda he: BadCall(RECEIVER, he[0], he[1], "",
                               Bad("broadcast()", "role", he[1], None), "RoleError")),
    ]


def bad_calls() -> st.SearchStrategy[BadCall]:
    """Any bad call: first an entry and argument (a target), uniformly, then
    how the argument is broken."""
    return uniform(_receiver_targets() + _last_targets())


# -- known bugs ---------------------------------------------------------------------


def known_bug(entry: str, arg: str, kind: str) -> str:
    """Which known ppsync bug a bad call hits; "" for none."""
    if entry in ("post", "publish", "prepare") and arg == "view":
        return "view-type-unchecked"
    if entry == "send" and arg == "step":
        return "send-step-unchecked"
    if entry == "send" and arg == "drafts_np" and kind == "type":
        return "send-drafts-unchecked"
    return ""


# -- making the calls ------------------------------------------------------------------


def _make(path: TokenPath, call: BadCall) -> None:
    """Make ``call`` on ``path`` (every other argument valid)."""
    bad, arg = call.bad, call.arg
    view = BASE
    if arg == "view":
        view = bad.value  # type: ignore[assignment]
    elif arg in VIEW_BAD:
        view = replace_field(BASE, arg, bad.value)
    outputs = _outputs(BASE_R)
    drafts: object = _drafts(BASE_R)
    if arg == "draft_tokens":
        drafts = bad.value
    elif arg in OUTPUT_BAD:
        outputs[arg] = bad.value
    if call.entry == "post":
        path.post(view)
    elif call.entry in ("prepare", "publish"):
        entry = path.prepare if call.entry == "prepare" else path.publish
        entry(view, draft_tokens=drafts, **outputs)  # type: ignore[arg-type]
    elif call.entry == "send":
        step: PreparedStep
        if call.rank == LAST and arg != "step":
            step, _ = path.prepare(BASE, **outputs)  # type: ignore[arg-type]
        elif arg == "step":
            step = bad.value  # type: ignore[assignment]
        else:  # a receiver cannot prepare; a well-formed step all the same
            step = PreparedStep(BASE, np.ones(3, dtype=bool), _tokens(BASE_R).numpy(),
                                np.array(NUM_SAMPLED), np.array(NUM_REJECTED))
        drafts_np = bad.value if arg == "drafts_np" else _drafts(BASE_R).numpy()
        path.send(step, drafts_np)  # type: ignore[arg-type]
    elif call.entry == "consume":
        path.consume(bad.value if arg else None)  # type: ignore[arg-type]
    elif call.entry == "free":
        path.free(bad.value)  # type: ignore[arg-type]
    elif call.entry == "require_role":
        path.require_role(call.bad.field.removesuffix("()"), last=call.rank == RECEIVER)
    else:
        raise AssertionError(f"unknown entry {call.entry}")


State = tuple[int, int, int, int]


def _state(path: TokenPath) -> State:
    return (path.seq, path.steps, len(list(path.ring.pending())),
            len(list(path.inflight_works())))


@dataclass(frozen=True)
class Attempt:
    """A bad call and what it did, for the parent to check."""

    call: str  # BadCall.describe()
    entry: str
    arg: str
    kind: str
    field: str
    expected: str  # error type name
    error: str  # the raised type's name, "" when nothing was raised
    is_ppsync: bool  # whether it was a PPSyncError
    message: str
    before: State
    after: State


def _attempt(path: TokenPath, call: BadCall) -> Attempt:
    before = _state(path)
    error, is_ppsync, message = "", False, ""
    try:
        _make(path, call)
    except Exception as e:  # recorded; the parent checks type and message
        error, is_ppsync, message = type(e).__name__, isinstance(e, PPSyncError), str(e)
    return Attempt(call.describe(), call.entry, call.arg, call.bad.kind, call.bad.field,
                   call.error, error, is_ppsync, message, before, _state(path))


# -- the ranks -------------------------------------------------------------------------


@dataclass(frozen=True)
class RankRun:
    rounds: int
    attempts: list[Attempt]
    releases: int  # consumes that released a step
    wrong: list[str]  # released steps that were not intact
    sent: list[int]  # last rank: rows of each valid publish
    probes: list[Attempt]  # last rank: known-bug calls that could issue, on a no-transfer step
    after_close: list[Attempt]


def _check_release(path: TokenPath, table: torch.Tensor, r: int, wrong: list[str]) -> int:
    """Consume (releasing round r - 1's step) and compare it with what was sent."""
    released = path.consume(table)
    if r == 0:
        if released is not None:
            wrong.append("round 0 released a step from an empty ring")
        return 0
    s = r - 1
    if released is None:
        wrong.append(f"round {s}'s step was not released")
        return 0
    got = (released.seq, released.sampled_tokens.tolist(), released.num_sampled.tolist(),
           released.num_rejected.tolist(), released.idx_mapping.tolist(),
           None if released.draft_tokens is None else released.draft_tokens.tolist(),
           table[torch.tensor(_idx(s))].tolist())
    want = (s, _tokens(s).tolist(), NUM_SAMPLED, NUM_REJECTED, _idx(s), _drafts(s).tolist(),
            _drafts(s).tolist())
    if got != want:
        wrong.append(f"round {s}: got {got}, sent {want}")
    return 1


def _agree(env: RankEnv, what: str, items: list[BadCall]) -> None:
    """Both ranks generated the same schedule, or stop here."""
    mine = fingerprint([c.describe() for c in items] + [repr(c.bad.value) for c in items])
    env.store.set(f"fuzz/{what}/{env.rank}", mine)
    theirs = env.store.get(f"fuzz/{what}/{1 - env.rank}").decode()
    if theirs != mine:
        raise AssertionError(f"rank {env.rank}: hypothesis generated another {what} schedule "
                             "than the peer rank; the rounds would not match")


def _after_close_calls(rank: int) -> st.SearchStrategy[BadCall]:
    """Any call, valid or not, after close(): a ProtocolError naming close()."""
    closed = Bad("close()", "order", "after close()", None)

    def as_closed(c: BadCall) -> BadCall:
        return dataclasses.replace(c, rank=rank, bad=dataclasses.replace(
            closed, value=c.bad.value), error="ProtocolError")

    valid = st.sampled_from(["post", "consume", "free", "publish", "prepare", "send",
                             "require_role"]).map(
        lambda e: BadCall(rank, "after_post", e, "", closed, "ProtocolError"))
    return uniform([valid, bad_calls().map(as_closed)])


def _fuzz_rank(env: RankEnv) -> RankRun:
    watchdog(TIMEOUT_S + 30)
    schedule = collect(bad_calls(), EXAMPLES)
    _agree(env, "rounds", schedule)
    group = token_group(dist.group.WORLD, timeout_s=TIMEOUT_S)  # type: ignore[arg-type]
    path = TokenPath(CONFIG, group, board=env.failure_board(group))
    attempts: list[Attempt] = []
    wrong: list[str] = []
    sent: list[int] = []
    releases = 0
    table = torch.full((MAX_NUM_REQS, K), -1, dtype=torch.int64)  # [max_num_reqs, K]

    def bad(when: When, call: BadCall) -> None:
        if call.rank == env.rank and call.when == when:
            attempts.append(_attempt(path, call))

    for r, call in enumerate(schedule):
        if path.is_last:
            bad("before_publish", call)
            sent.append(path.publish(_view(_idx(r)), draft_tokens=_drafts(r),
                                     **_outputs(r)))  # type: ignore[arg-type]
        else:
            bad("before_consume", call)
            releases += _check_release(path, table, r, wrong)
            bad("after_consume", call)
            path.post(_view(_idx(r)))
            bad("after_post", call)
    probes: list[Attempt] = []
    if path.is_last:
        probes = _probes(path)
    else:
        releases += _check_release(path, table, len(schedule), wrong)
        path.post(_view([]))
    path.close()
    closed = collect(_after_close_calls(env.rank), AFTER_CLOSE_EXAMPLES)
    after_close = [_attempt(path, c) for c in closed]
    return RankRun(len(schedule), attempts, releases, wrong, sent, probes, after_close)


# Known-bug calls that, when accepted, would issue a frame in a step with a
# transfer: probed on the last rank with a view whose rows all are non-final
# prefill chunks (no row samples, so even an accepted call issues nothing).
PREFILL = _view(BASE_IDX, computed=0, scheduled=1)
HUGE = 2**62  # each count valid on its own; their sum overflows int64


def _probes(path: TokenPath) -> list[Attempt]:
    float_drafts = Bad("drafts", "dtype", "float64 drafts_np", np.full((3, K), 0.5))
    bool_drafts = Bad("drafts", "dtype", "bool drafts_np", np.ones((3, K), dtype=bool))
    huge = Bad("num_computed_tokens", "range", f"computed = scheduled = {HUGE}",
               replace_field(BASE, "num_computed_tokens_np", np.full(3, HUGE)))
    out = []
    for b in (float_drafts, bool_drafts):
        step, _ = path.prepare(PREFILL, **_outputs(BASE_R))  # type: ignore[arg-type]
        before = _state(path)
        error, message, is_ppsync = "", "", False
        try:
            path.send(step, b.value)  # type: ignore[arg-type]
        except Exception as e:
            error, message, is_ppsync = type(e).__name__, str(e), isinstance(e, PPSyncError)
        out.append(Attempt(f"send(PREFILL step, {b.label})", "send", "drafts_np", b.kind,
                           b.field, "BatchError", error, is_ppsync, message, before,
                           _state(path)))
    view = replace_field(huge.value, "num_scheduled_tokens_np", np.full(3, HUGE))
    out.append(_attempt(path, BadCall(LAST, "before_publish", "prepare", "view",
                                      dataclasses.replace(huge, value=view), "BatchError")))
    return out


@pytest.fixture(scope="module")
def world() -> list[RankRun]:
    return spawn_ranks(_fuzz_rank, 2, timeout_s=TIMEOUT_S + 20)


# -- the checks ---------------------------------------------------------------------------


def _problems(a: Attempt) -> list[str]:
    out = []
    if not a.is_ppsync or a.error != a.expected:
        out.append(f"raised {a.error or 'nothing'}, not {a.expected}")
    if a.field not in a.message:
        out.append(f"message does not name {a.field!r}")
    if a.after != a.before:
        out.append(f"state (seq, steps, ring, in flight) {a.before} -> {a.after}")
    return out


def _report(attempts: list[Attempt]) -> list[str]:
    return [f"{a.call}: {'; '.join(p)} [{a.error}: {a.message}]"
            for a in attempts if (p := _problems(a))]


def test_schedule_covers_every_entry_and_kind(world: list[RankRun]) -> None:
    receiver, last = world
    assert receiver.rounds == last.rounds == EXAMPLES
    attempts = receiver.attempts + last.attempts
    assert len(attempts) == EXAMPLES  # one bad call per round, on one rank
    entries = {(a.entry, a.error == "RoleError") for a in attempts}
    for entry in ("post", "consume", "free", "publish", "prepare", "send"):
        assert (entry, False) in entries, entry
    kinds = {a.kind for a in attempts}
    assert kinds >= {"type", "dtype", "shape", "range", "duplicate", "mismatch", "role",
                     "order"}, kinds


def test_every_bad_call_raises_a_typed_error_before_any_collective(
    world: list[RankRun],
) -> None:
    attempts = [a for run in world for a in run.attempts
                if not known_bug(a.entry, a.arg, a.kind)]
    assert len(attempts) > EXAMPLES // 2
    assert _report(attempts) == []


def test_the_group_completes_a_valid_step_after_every_bad_call(world: list[RankRun]) -> None:
    receiver, last = world
    assert last.sent == [3] * EXAMPLES  # every valid publish issued its frame
    assert receiver.wrong == []
    assert receiver.releases == EXAMPLES  # every valid step arrived, intact


def test_every_entry_after_close_is_a_protocol_error(world: list[RankRun]) -> None:
    for run in world:
        assert len(run.after_close) == AFTER_CLOSE_EXAMPLES
        assert {a.entry for a in run.after_close} >= {"post", "consume", "free", "publish",
                                                      "prepare", "send"}
        assert _report(run.after_close) == []
        assert all(a.message.endswith("token path used after close()") for a in run.after_close)


class KnownBug(AssertionError):
    """A bad call that ppsync does not yet turn into a typed error."""


def _known(world: list[RankRun], bug: str) -> list[Attempt]:
    return [a for run in world for a in run.attempts if known_bug(a.entry, a.arg, a.kind) == bug]


@pytest.mark.xfail(strict=True, raises=KnownBug, reason=(
    "ppsync bug: post/publish/prepare read view.num_reqs without checking that view is a "
    "BatchView: None (or any other object) raises AttributeError, not BatchError"))
def test_known_bug_view_type_unchecked(world: list[RankRun]) -> None:
    attempts = _known(world, "view-type-unchecked")
    assert attempts  # the explicit menu makes hypothesis draw some
    if problems := _report(attempts):
        raise KnownBug("\n".join(problems))


@pytest.mark.xfail(strict=True, raises=KnownBug, reason=(
    "ppsync bug: TokenPath.send does not check its arguments: a step that is not a "
    "PreparedStep raises AttributeError after counting a step; drafts_np that is not an "
    "ndarray raises AttributeError; float or bool drafts_np are cast into the frame silently"))
def test_known_bug_send_arguments_unchecked(world: list[RankRun]) -> None:
    attempts = _known(world, "send-step-unchecked") + _known(world, "send-drafts-unchecked")
    attempts += [p for p in world[LAST].probes if p.entry == "send"]
    assert attempts
    if problems := _report(attempts):
        raise KnownBug("\n".join(problems))


@pytest.mark.xfail(strict=True, raises=KnownBug, reason=(
    "ppsync bug: validate_batch bounds counts below only; num_computed_tokens + "
    "num_scheduled_tokens can overflow int64 in need_sampled_mask, and the rows then "
    "silently need no sample"))
def test_known_bug_count_overflow_unchecked(world: list[RankRun]) -> None:
    attempts = [p for p in world[LAST].probes if p.entry == "prepare"]
    assert len(attempts) == 1
    if problems := _report(attempts):
        raise KnownBug("\n".join(problems))
