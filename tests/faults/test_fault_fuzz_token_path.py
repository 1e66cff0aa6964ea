"""Hypothesis fuzzing of every public entry of TokenPath, on real gloo ranks.

The world of fault_fuzz_calls: P = 2 (rank 0 receives, rank 1 is the last
rank), D = 1, K = 2. Each rank runs hypothesis itself, derandomized, over the
same strategy, so both generate the same schedule of bad calls (the ranks
compare a digest of it through the run's store before starting). Round r of
the schedule: the offending rank makes its one bad call at its place in the
engine order, then both ranks make a valid step r; the receiver checks, one
round later, that step r arrived intact. A bad call that had issued a
collective would shift every later frame (a DesyncError or wrong rows) or
leave the peer waiting.

Bad calls: a batch view with one field broken (type, dtype, shape, range,
a repeated request slot, a num_reqs that is not the arrays'), an argument
that is no batch view at all, bad sampler outputs and drafts, a bad draft
table, a bad step or drafts for send(), a bad freed slot, a call that belongs
to the other role, calls out of order (post before consume, post twice,
consume twice), and, once both ranks closed, every entry after close(). Every
one must raise a PPSyncError subclass whose message names the field (or the
call), leaving seq, the step count, the ring and the works in flight as they
were.

Two more kinds are made on the last rank after the schedule (``_probes``) and
held to the same rules: float or bool drafts for send(), on a step that has
no transfer (were ppsync to accept them in a step with one, they would send a
frame and derail every later round), and counts each valid on its own whose
sum overflows int64.
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
from fault_fuzz_calls import (
    BASE_IDX,
    BASE_R,
    COMPUTED,
    FREE_BAD,
    LAST,
    MAX_NUM_REQS,
    NUM_REJECTED,
    NUM_SAMPLED,
    OUTPUT_BAD,
    PREFILL_LEN,
    RECEIVER,
    SCHEDULED,
    TIMEOUT_S,
    VIEW_BAD,
    Attempt,
    BadCall,
    K,
    agree,
    attempt,
    calls,
    drafts,
    outputs,
    path_state,
    report,
    slots,
    tokens,
)
from fault_fuzz_inputs import Bad, collect, int_tensor, replace_field, uniform
from fault_tools import watchdog
from hypothesis import strategies as st

from ppsync.core import SampledStep
from ppsync.core.codec.steps import PreparedStep
from ppsync.core.path.token_path import TokenPath
from ppsync.core.rules import BatchView
from ppsync.core.rules.facts import batch_facts
from ppsync.core.wire.groups import token_group
from ppsync.harness.launcher import RankEnv, spawn_ranks
from ppsync.schemas.config import SyncConfig

EXAMPLES = 240  # bad calls, one per round
AFTER_CLOSE_EXAMPLES = 60  # calls after close(), per rank
KERNELS = ("numpy", "numba")
"""The CPU kernel sets (SyncConfig.cpu_kernels): each runs the whole fuzz."""


def _config(kernels: str) -> SyncConfig:
    return SyncConfig.build(
        pp_size=2, max_num_reqs=MAX_NUM_REQS, num_speculative_steps=K, ring_depth=1,
        timeout_s=TIMEOUT_S, wire="fixed", cpu_kernels=kernels,
    )

# -- valid values ---------------------------------------------------------------


def _view(idx: list[int], *, computed: int = COMPUTED, scheduled: int = SCHEDULED) -> BatchView:
    """Rows in request slots ``idx``; by default decode rows, each needing a sample."""
    n = len(idx)
    return BatchView(
        num_reqs=n,
        idx_mapping_np=np.array(idx, dtype=np.int64),
        num_computed_tokens_np=np.full(n, computed, dtype=np.int64),
        num_scheduled_tokens_np=np.full(n, scheduled, dtype=np.int64),
        prefill_len_np=np.full(n, PREFILL_LEN, dtype=np.int64),
    )


def _drafts(r: int) -> torch.Tensor:  # [3, K] int64
    return torch.from_numpy(drafts(r))


BASE = _view(BASE_IDX)

# -- the schedule ------------------------------------------------------------------

When = Literal["before_consume", "after_consume", "after_post", "before_publish"]
RECEIVER_HOOKS: list[When] = ["before_consume", "after_consume", "after_post"]

# Not a batch view at all.
NOT_A_VIEW = st.sampled_from([
    ("None", None), ("dict", {"num_reqs": 3}), ("tuple", (3,)), ("str", "view"), ("int", 3),
]).map(lambda tv: Bad("view", "type", tv[0], tv[1]))
STEP_OUTPUT_BAD = {**OUTPUT_BAD, "draft_tokens": int_tensor(
    "draft_tokens", _drafts(BASE_R), optional=True, bad_widths=[0, 1, K + 1])}
TABLE_BAD = int_tensor("draft_tokens_to_update", torch.full((MAX_NUM_REQS, K), -1),
                       optional=True, bad_widths=[0, 1, K + 1])
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


def _view_calls(rank: int, when: When, entry: str) -> list[st.SearchStrategy[BadCall]]:
    """One target per batch-view attribute, and one for a view that is none."""
    out = [calls(VIEW_BAD[a], rank, when, entry, a, "BatchError") for a in sorted(VIEW_BAD)]
    out.append(calls(NOT_A_VIEW, rank, when, entry, "view", "BatchError"))
    return out


def _last_targets() -> list[st.SearchStrategy[BadCall]]:
    w: When = "before_publish"
    out: list[st.SearchStrategy[BadCall]] = []
    for entry in ("publish", "prepare"):
        out += _view_calls(LAST, w, entry)
        out += [calls(STEP_OUTPUT_BAD[a], LAST, w, entry, a, "BatchError")
                for a in sorted(STEP_OUTPUT_BAD)]
    out += [
        calls(SEND_DRAFTS_BAD, LAST, w, "send", "drafts_np", "BatchError"),
        calls(NOT_A_STEP, LAST, w, "send", "step", "BatchError"),
        calls(FREE_BAD, LAST, w, "free", "req_idx", "BatchError"),
        st.sampled_from([
            ("post", "post()"), ("consume", "consume()"),
            ("require_role", "receive()"),
        ]).map(lambda ef: BadCall(LAST, w, ef[0], "", "RoleError",
                                  Bad(ef[1], "role", ef[0], None))),
    ]
    return out


def _receiver_targets() -> list[st.SearchStrategy[BadCall]]:
    hooks = st.sampled_from(RECEIVER_HOOKS)
    orders: list[tuple[When, str, str]] = [
        ("before_consume", "post", "post()"), ("after_post", "post", "post()"),
    ]  # consume() twice is an empty-schedule step, not an error
    return [
        *_view_calls(RECEIVER, "after_consume", "post"),
        calls(TABLE_BAD, RECEIVER, "before_consume", "consume", "draft_tokens_to_update",
              "BatchError"),
        st.tuples(hooks, FREE_BAD).map(
            lambda hb: BadCall(RECEIVER, hb[0], "free", "req_idx", "BatchError", hb[1])),
        st.sampled_from(orders).map(
            lambda o: BadCall(RECEIVER, o[0], o[1], "", "ProtocolError",
                              Bad(o[2], "order", o[0], None))),
        st.tuples(hooks, st.sampled_from(["publish", "prepare", "send", "require_role"])).map(
            lambda he: BadCall(RECEIVER, he[0], he[1], "", "RoleError",
                               Bad("broadcast()" if he[1] == "require_role" else "publish()",
                                   "role", he[1], None))),
    ]


def bad_calls() -> st.SearchStrategy[BadCall]:
    """Any bad call: first an entry and argument (a target), uniformly, then
    how the argument is broken."""
    return uniform(_receiver_targets() + _last_targets())


# -- making the calls ------------------------------------------------------------------


def _sampled(outs: dict[str, object], drafts: object = None) -> SampledStep:
    """The engine's outputs (a bad value among them, as given) in the record
    publish takes."""
    return SampledStep(outs["sampled_token_ids"], outs["num_sampled"],  # type: ignore[arg-type]
                       outs["num_rejected"], drafts)  # type: ignore[arg-type]


def _make(path: TokenPath, call: BadCall) -> None:
    """Make ``call`` on ``path`` (every other argument valid)."""
    bad, arg = call.bad, call.arg
    view = BASE
    if arg == "view":
        view = bad.value  # type: ignore[assignment]
    elif arg in VIEW_BAD:
        view = replace_field(BASE, arg, bad.value)
    outs = outputs(BASE_R)
    draft_tokens: object = _drafts(BASE_R)
    if arg == "draft_tokens":
        draft_tokens = bad.value
    elif arg in OUTPUT_BAD:
        outs[arg] = bad.value
    if call.entry == "post":
        path.post(view)
    elif call.entry in ("prepare", "publish"):
        entry = path.prepare if call.entry == "prepare" else path.publish
        entry(view, _sampled(outs, draft_tokens))
    elif call.entry == "send":
        step: PreparedStep
        if call.rank == LAST and arg != "step":
            step, _ = path.prepare(BASE, _sampled(outs))
        elif arg == "step":
            step = bad.value  # type: ignore[assignment]
        else:  # a receiver cannot prepare; a well-formed step all the same
            step = PreparedStep(BASE, batch_facts(BASE, MAX_NUM_REQS), SampledStep(
                tokens(BASE_R).numpy(), np.array(NUM_SAMPLED), np.array(NUM_REJECTED)))
        drafts_np = bad.value if arg == "drafts_np" else drafts(BASE_R)
        path.send(step, drafts_np)  # type: ignore[arg-type]
    elif call.entry == "consume":
        path.consume(bad.value if arg else None)  # type: ignore[arg-type]
    elif call.entry == "free":
        path.free(bad.value)  # type: ignore[arg-type]
    elif call.entry == "require_role":
        path.require_role(call.bad.field.removesuffix("()"), last=call.rank == RECEIVER)
    else:
        raise AssertionError(f"unknown entry {call.entry}")


def _attempt(path: TokenPath, call: BadCall) -> Attempt:
    return attempt(call, functools.partial(_make, path, call),
                   functools.partial(path_state, path))


# Probes. Drafts of a dtype send() must refuse go with a step whose rows all
# are non-final prefill chunks: no row samples, so even an accepted call
# issues nothing.
PREFILL = _view(BASE_IDX, computed=0, scheduled=1)
HUGE = 2**62  # each count valid on its own; their sum overflows int64


def _probes(path: TokenPath) -> list[Attempt]:
    out = []
    for label, value in (("float64", np.full((3, K), 0.5)), ("bool", np.ones((3, K), dtype=bool))):
        step, _ = path.prepare(PREFILL, _sampled(outputs(BASE_R)))
        call = BadCall(LAST, "probe", "send", "drafts_np", "BatchError",
                       Bad("drafts", "dtype", f"{label} drafts_np, no transfer", value))
        out.append(attempt(call, functools.partial(path.send, step, value),
                           functools.partial(path_state, path)))
    huge = replace_field(replace_field(BASE, "num_computed_tokens_np", np.full(3, HUGE)),
                         "num_scheduled_tokens_np", np.full(3, HUGE))
    out.append(_attempt(path, BadCall(
        LAST, "probe", "prepare", "view", "BatchError",
        Bad("num_computed_tokens", "range", f"computed = scheduled = {HUGE}", huge))))
    return out


# -- the ranks -------------------------------------------------------------------------


@dataclass(frozen=True)
class RankRun:
    rounds: int
    attempts: list[Attempt]
    releases: int  # consumes that released a step
    wrong: list[str]  # released steps that were not intact
    sent: list[int]  # last rank: rows of each valid publish
    probes: list[Attempt]  # last rank: calls that could send a frame, on a no-transfer step
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
           table[torch.tensor(slots(s))].tolist())
    want = (s, tokens(s).tolist(), NUM_SAMPLED, NUM_REJECTED, slots(s), drafts(s).tolist(),
            drafts(s).tolist())
    if got != want:
        wrong.append(f"round {s}: got {got}, sent {want}")
    return 1


def _after_close_calls(rank: int) -> st.SearchStrategy[BadCall]:
    """Any call, valid or not, after close(): a ProtocolError naming close()."""
    closed = Bad("close()", "order", "after close()", None)

    def as_closed(c: BadCall) -> BadCall:
        return dataclasses.replace(c, rank=rank, bad=dataclasses.replace(
            closed, value=c.bad.value), error="ProtocolError")

    valid = st.sampled_from(["post", "consume", "free", "publish", "prepare", "send",
                             "require_role"]).map(
        lambda e: BadCall(rank, "after_post", e, "", "ProtocolError", closed))
    return uniform([valid, bad_calls().map(as_closed)])


def _fuzz_rank(kernels: str, env: RankEnv) -> RankRun:
    watchdog(TIMEOUT_S + 30)
    schedule = collect(bad_calls(), EXAMPLES)
    agree(env, "rounds", schedule)
    group = token_group(dist.group.WORLD, timeout_s=TIMEOUT_S)  # type: ignore[arg-type]
    path = TokenPath(_config(kernels), group, board=env.failure_board(group))
    assert path.codec.kernels.name == kernels
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
            sent.append(path.publish(_view(slots(r)), _sampled(outputs(r), _drafts(r))))
        else:
            bad("before_consume", call)
            releases += _check_release(path, table, r, wrong)
            bad("after_consume", call)
            path.post(_view(slots(r)))
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


_WORLDS: dict[str, list[RankRun]] = {}


def _world(kernels: str) -> list[RankRun]:
    if kernels not in _WORLDS:
        _WORLDS[kernels] = spawn_ranks(functools.partial(_fuzz_rank, kernels), 2,
                                       timeout_s=TIMEOUT_S + 20)
    return _WORLDS[kernels]


@pytest.fixture(scope="module", params=KERNELS)
def world(request: pytest.FixtureRequest) -> list[RankRun]:
    return _world(request.param)


# -- the checks ---------------------------------------------------------------------------


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
    targets = {(a.entry, a.arg, a.kind) for a in attempts}
    assert targets >= {("post", "view", "type"), ("publish", "view", "type"),
                       ("prepare", "view", "type"), ("send", "step", "type"),
                       ("send", "drafts_np", "type")}, targets
    assert {(p.entry, p.kind) for p in last.probes} == {("send", "dtype"), ("prepare", "range")}


def test_every_bad_call_raises_a_typed_error_before_any_collective(
    world: list[RankRun],
) -> None:
    attempts = [a for run in world for a in run.attempts + run.probes]
    assert len(attempts) == EXAMPLES + 3  # the schedule, and the last rank's 3 probes
    assert report(attempts) == []


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
        assert report(run.after_close) == []
        assert all(a.message.endswith("token path used after close()") for a in run.after_close)


def test_every_kernel_set_raises_the_same_errors() -> None:
    """The same schedule through each CPU kernel set: the same error type
    and message for every bad call, on every rank."""
    ref = _world(KERNELS[0])
    for kernels in KERNELS[1:]:
        got = _world(kernels)
        for r, (a, b) in enumerate(zip(ref, got, strict=True)):
            assert [(x.call, x.error, x.message) for x in a.attempts + a.probes] == [
                (x.call, x.error, x.message) for x in b.attempts + b.probes], (kernels, r)
