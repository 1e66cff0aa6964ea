"""A rank whose view of the batch diverges: every rank ends with a
DesyncError that shows both views, bounded, never a hang.

P = 3 ranks (receivers 0 and 1, last rank 2) run explicit decode steps whose
request slots rotate from step to step (every row needs a sample). From step
``DIVERGE_AT`` on, receiver ``DIV`` holds another view:

- ``num_reqs``: one row fewer;
- ``permuted``: the same rows in another order (same size, other idx_mapping);
- ``skipped``: it skips step ``DIVERGE_AT`` entirely (no consume, no post), so
  from then on each of its receives pairs with the sender's previous frame;
- ``spec``: another K in its SyncConfig, which the start-up configuration
  handshake (ppsync.core.path.handshake) catches on every rank before any frame.

In the fixed wire mode the divergent receiver's header check raises; the
other ranks stop on a transfer that cannot complete (or on the divergent
rank's exit) and learn from the failure board that a desync, not a lost peer,
is the cause: their DesyncError says "rank DIV reported" and carries the
divergent rank's two views.

The exact wire mode sizes each frame from num_reqs, so a num_reqs mismatch is
a size mismatch on gloo:

- the receiver's buffer is LARGER than the frame (its num_reqs is bigger):
  gloo part-fills it without an error, and the header check names the
  disagreement, exactly as in the fixed mode;
- the receiver's buffer is SMALLER: gloo aborts that process
  (``gloo::EnforceNotMet``, SIGABRT, not catchable), so that rank dies with
  exit code -6 (about one run in twenty, -11: a SIGSEGV instead); the sender
  and the other receiver end with a typed PPSyncError (PeerLost naming the
  dead rank), not a hang. That is why the fixed wire mode is the default.

A skipped step is caught because the views of adjacent steps differ: ``seq``
counts frames, not steps, but every frame row carries the sender's
num_computed_tokens, which advances each step, so even when the skipped step
and the next one schedule the same request slots (a steady decode batch,
``skipped-same-slots``) the skipping receiver's check names the row.
"""

from __future__ import annotations

import faulthandler
import functools
import json
import re
import signal
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist
from fault_tools import watchdog, write_json

from ppsync.core import SampledStep
from ppsync.core.path.token_path import TokenPath
from ppsync.core.rules import BatchView
from ppsync.core.wire.groups import token_group
from ppsync.errors import PPSyncError, RankFailed
from ppsync.harness.launcher import RankEnv, spawn_ranks
from ppsync.schemas.config import SyncConfig, WireMode

PP_SIZE = 3
LAST = PP_SIZE - 1
DIV = 0  # the receiver whose view diverges
MAX_NUM_REQS = 8
K = 1
TIMEOUT_S = 10.0
DIVERGE_AT = 5  # the ring (D = P = 3) is full by then
STEPS = 400  # far more than any rank can run once the divergence stops the group


def _config(wire: WireMode, spec: int = K) -> SyncConfig:
    return SyncConfig.build(pp_size=PP_SIZE, max_num_reqs=MAX_NUM_REQS,
                            num_speculative_steps=spec, timeout_s=TIMEOUT_S, wire=wire)


def _slots(t: int, case: str) -> list[int]:
    """The agreed request slots of step t: they rotate from step to step, except
    in the steady ``skipped-same-slots`` batch."""
    if case == "skipped-same-slots":
        return [1, 4, 6]
    return [t % MAX_NUM_REQS, (t + 3) % MAX_NUM_REQS, (t + 5) % MAX_NUM_REQS]


def _divergent_slots(t: int, case: str) -> list[int]:
    agreed = _slots(t, case)
    if case == "num_reqs":
        return agreed[:-1]
    if case == "permuted":
        return agreed[1:] + agreed[:1]
    if case == "exact-larger":
        return [*agreed, (t + 7) % MAX_NUM_REQS]
    if case == "exact-smaller":
        return agreed[:-1]
    return agreed


def _view(slots: list[int], t: int) -> BatchView:
    """Decode rows: every row needs a sample; computed counts advance per step."""
    n = len(slots)
    return BatchView(
        num_reqs=n,
        idx_mapping_np=np.array(slots, dtype=np.int64),
        num_computed_tokens_np=np.full(n, 10 + t, dtype=np.int64),
        num_scheduled_tokens_np=np.ones(n, dtype=np.int64),
        prefill_len_np=np.full(n, 5, dtype=np.int64),
    )


def _tokens(t: int, n: int) -> torch.Tensor:  # [n, 1] int64
    return (torch.arange(n, dtype=torch.int64) + 1000 * t).reshape(n, 1)


@dataclass(frozen=True, slots=True)
class Outcome:
    """How one rank's run ended (also written to ``rank<N>.json``)."""

    rank: int
    error: str  # type name; "" when the run ended without one
    message: str = ""
    expected: dict[str, int] = field(default_factory=dict)
    received: dict[str, int] = field(default_factory=dict)
    peer: int | None = None
    elapsed_s: float = 0.0  # from the first step (or the handshake) to the error
    steps: int = 0  # steps begun
    wrong_tokens: int = 0  # released steps whose tokens were not their step's


def _run(path: TokenPath, case: str, rank: int) -> tuple[int, int]:
    """The engine loop; returns (steps begun, released steps with wrong tokens)."""
    depth = path.config.depth
    wrong = 0
    for t in range(STEPS):
        if path.is_last:
            n = len(_slots(t, case))
            path.publish(_view(_slots(t, case), t), SampledStep(
                _tokens(t, n), torch.ones(n, dtype=torch.int32), torch.zeros(n, dtype=torch.int32)))
            continue
        diverged = rank == DIV and t >= DIVERGE_AT
        if diverged and case.startswith("skipped") and t == DIVERGE_AT:
            continue  # neither consume nor post: this rank skips the step
        released = path.consume()
        if released is not None and t >= depth:
            # step t releases step t - D; after a skip, this rank's receives pair
            # with the sender's frames one step late, and it is handed those
            wrong += int(released.sampled_tokens[0, 0]) != 1000 * (t - depth)
        slots = _divergent_slots(t, case) if diverged else _slots(t, case)
        path.post(_view(slots, t))
    path.close()
    return STEPS, wrong


def _rank(case: str, out_dir: Path, env: RankEnv) -> Outcome:
    watchdog(TIMEOUT_S + 8)
    if case == "exact-smaller" and env.rank == DIV:
        # gloo aborts this rank on purpose: no fatal-error trace in the test output
        # (the watchdog's timer dump is separate from the fatal-signal handler)
        faulthandler.disable()
    group = token_group(dist.group.WORLD, timeout_s=TIMEOUT_S)  # type: ignore[arg-type]
    wire: WireMode = "exact" if case.startswith("exact") else "fixed"
    spec = K + 1 if case == "spec" and env.rank == DIV else K
    start = time.monotonic()
    steps = wrong = 0
    try:
        path = TokenPath(_config(wire, spec), group, board=env.failure_board(group))
        start = time.monotonic()  # every rank is past the handshake
        steps, wrong = _run(path, case, env.rank)
    except PPSyncError as e:
        outcome = Outcome(
            env.rank, type(e).__name__, str(e), getattr(e, "expected", {}),
            getattr(e, "received", {}), getattr(e, "peer", None), time.monotonic() - start,
        )
    else:
        outcome = Outcome(env.rank, "", steps=steps, wrong_tokens=wrong)
    write_json(out_dir / f"rank{env.rank}.json", asdict(outcome))
    return outcome


class NoDesync(AssertionError):
    """A rank did not end with a DesyncError."""


def _check_desync(outcomes: list[Outcome], case: str) -> None:
    for o in outcomes:
        if o.error != "DesyncError":
            raise NoDesync(f"{case}: rank {o.rank} ended with {o.error or 'no error'}: {o}")
        # both views, never a hang
        assert o.expected and o.received, o
        assert o.expected != o.received, o
        assert o.elapsed_s <= TIMEOUT_S + 5, o


FIXED_CASES = [
    pytest.param("num_reqs", id="fixed-num_reqs"),
    pytest.param("permuted", id="fixed-permuted-idx"),
    pytest.param("skipped", id="fixed-skipped-step"),
    pytest.param("exact-larger", id="exact-receiver-buffer-larger"),
    pytest.param("skipped-same-slots", id="fixed-skipped-step-same-slots"),
]


@pytest.mark.parametrize("case", FIXED_CASES)
def test_divergent_view_is_a_desync_error_on_every_rank(case: str, tmp_path: Path) -> None:
    outcomes = spawn_ranks(functools.partial(_rank, case, tmp_path), PP_SIZE,
                           timeout_s=TIMEOUT_S)
    _check_desync(outcomes, case)
    divergent = outcomes[DIV]
    # the divergent receiver's own check: "mine" is its view
    mine, sender = divergent.expected, divergent.received
    first = DIVERGE_AT  # the first frame this receiver disagrees with
    assert mine["seq"] == sender["seq"] == first, divergent
    if case in ("num_reqs", "exact-larger"):
        theirs = len(_divergent_slots(first, case))
        assert (mine["num_reqs"], sender["num_reqs"]) == (theirs, 3), divergent
        assert re.search(r"^rank 0: frame disagrees with this rank's view of the step \(",
                         divergent.message), divergent.message
        assert f"num_reqs: mine {theirs} vs sender 3" in divergent.message
    else:
        # same size, other request slots (permuted, or the next step's) or other
        # computed counts (a skipped step): the frame's row facts name the row
        assert mine["num_reqs"] == sender["num_reqs"] == 3, divergent
        assert mine["idx_digest"] != sender["idx_digest"], divergent
        assert re.search(rf"^rank 0: frame seq {first} row (\d+) disagrees with this rank's "
                         r"view: (idx_mapping|num_computed_tokens)\[\1\] mine \d+ vs sender \d+$",
                         divergent.message), divergent.message
        row = mine["row"]
        field_name = "idx_mapping" if "idx_mapping" in mine else "num_computed_tokens"
        assert mine[field_name] != sender[field_name] and sender["row"] == row, divergent
    # the others learnt it from the board: the divergent rank's views, named
    for o in outcomes:
        if o.rank == DIV:
            continue
        assert re.search(rf"^rank {o.rank}: rank {DIV} reported: rank {DIV}: frame ",
                         o.message), o.message
        assert (o.expected, o.received) == (mine, sender), o


def test_other_spec_steps_fail_the_handshake_on_every_rank(tmp_path: Path) -> None:
    """Another K on one rank: every rank raises at start-up, before any frame
    (the handshake is an all-gather, so every rank sees every configuration
    and none needs the board)."""
    outcomes = spawn_ranks(functools.partial(_rank, "spec", tmp_path), PP_SIZE,
                           timeout_s=TIMEOUT_S)
    _check_desync(outcomes, "spec")
    for o in outcomes:
        assert o.steps == 0, o
        mine, theirs = (K + 1, K) if o.rank == DIV else (K, K + 1)
        other = 1 if o.rank == DIV else DIV  # the first group rank that differs
        assert o.message == (
            f"rank {o.rank}: group rank {other} has another configuration "
            f"(num_speculative_steps: mine {mine} vs rank {other} {theirs})"
        ), o
        assert o.expected["num_speculative_steps"] == mine, o
        assert o.received["num_speculative_steps"] == theirs, o
        assert {k: v for k, v in o.expected.items() if k != "num_speculative_steps"} == {
            k: v for k, v in o.received.items() if k != "num_speculative_steps"
        }, o


def test_exact_wire_smaller_receive_buffer_aborts_that_rank_only(tmp_path: Path) -> None:
    """Exact wire, the divergent receiver's num_reqs smaller than the
    sender's: gloo aborts it (SIGABRT) on the oversized message; the sender
    and the other receiver end with a typed error naming it, not a hang."""
    with pytest.raises(RankFailed) as info:
        spawn_ranks(functools.partial(_rank, "exact-smaller", tmp_path), PP_SIZE,
                    timeout_s=TIMEOUT_S)
    # SIGABRT as a rule; gloo has been seen to crash with SIGSEGV instead (1 run in ~20)
    died = {DIV: f"rank {DIV} died (exit code -{int(signal.SIGABRT)})"}
    crashed = {DIV: f"rank {DIV} died (exit code -{int(signal.SIGSEGV)})"}
    assert info.value.errors in (died, crashed), info.value.errors
    assert not (tmp_path / f"rank{DIV}.json").exists()  # it never got to write
    for rank in range(PP_SIZE):
        if rank == DIV:
            continue
        o = Outcome(**json.loads((tmp_path / f"rank{rank}.json").read_text()))
        assert o.error == "PeerLost", o
        assert o.peer == DIV, o
        assert o.message.startswith(f"lost peer rank(s) {DIV} (global)"), o.message
        assert o.elapsed_s <= TIMEOUT_S + 5, o
