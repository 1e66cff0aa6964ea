"""Error paths of the anyio services on real gloo ranks.

- A call that belongs to the other role is a RoleError, raised before any
  collective, through :class:`ppsync.services.runtime.Rank`.
- A bad batch view or sampler output given to ``post``/``publish`` (and a bad
  draft table given to ``take``) is a BatchError raised before any collective:
  the group then completes a valid step, intact.
- A peer that never sends: ``take()`` ends with SyncTimeout within the
  configured ``timeout_s``, and leaves the block as that error itself.

Errors raised inside a rank come back to the parent as (type name, message);
the parent checks them with ``re``.
"""

from __future__ import annotations

import functools
import re
import threading
import time
from collections.abc import Awaitable
from dataclasses import dataclass

import anyio
import pytest
import torch
import torch.distributed as dist
from helpers import decode_view
from twin_mode import Mode, in_mode, mode_group

from ppsync.core import SampledStep
from ppsync.core.wire.groups import token_group
from ppsync.harness.driver import Framework
from ppsync.harness.launcher import RankEnv, spawn_ranks
from ppsync.schemas.config import SyncConfig
from ppsync.services.runtime import Rank, open_rank

TIMEOUT_S = 10.0
MAX_NUM_REQS = 8
IDX = [4, 1]



def _group(config: SyncConfig) -> dist.ProcessGroup:
    return token_group(dist.group.WORLD, timeout_s=config.timeout_s)  # type: ignore[arg-type]




Outcome = tuple[str, str]  # (exception type name, message), or ("ok", what it returned)


async def _outcome(label: str, call: Awaitable[object]) -> tuple[str, Outcome]:
    """Await ``call`` and describe how it ended."""
    try:
        result = await call
    except Exception as e:
        return label, (type(e).__name__, str(e))
    return label, ("ok", repr(result))


# -- role and input errors, before any collective ---------------------------------


def _publish_args(n: int, *, num_sampled: int = 1) -> SampledStep:
    return SampledStep(
        torch.tensor([[500 + i] for i in range(n)], dtype=torch.int64),
        torch.full((n,), num_sampled, dtype=torch.int32),
        torch.zeros(n, dtype=torch.int32),
    )


async def _last_rank_calls(rank: Rank) -> list[tuple[str, Outcome]]:
    n = len(IDX)
    return [
        await _outcome("post", rank.post(decode_view(IDX))),
        await _outcome("take", rank.take()),
        await _outcome("publish idx out of range",
                       rank.publish(decode_view([IDX[0], MAX_NUM_REQS + 3]), _publish_args(n))),
        await _outcome("publish num_sampled > w",
                       rank.publish(decode_view(IDX), _publish_args(n, num_sampled=2))),
        await _outcome("publish", rank.publish(decode_view(IDX), _publish_args(n))),
    ]


async def _receiver_calls(rank: Rank) -> list[tuple[str, Outcome]]:
    n = len(IDX)
    out = [
        await _outcome("publish", rank.publish(decode_view(IDX), _publish_args(n))),
        await _outcome("take bad draft table", rank.take(torch.zeros(3, 2, dtype=torch.int64))),
        await _outcome("take", rank.take()),  # the ring starts with an empty slot
        await _outcome("post idx out of range", rank.post(decode_view([IDX[0], MAX_NUM_REQS + 3]))),
        await _outcome("post", rank.post(decode_view(IDX))),
        # errors speak the services' API, not the token path's consume()
        await _outcome("post again", rank.post(decode_view(IDX))),
    ]
    released = await rank.take()
    assert released is not None
    tokens = tuple(int(x) for x in released.sampled_tokens[:, 0])
    idx = tuple(int(x) for x in released.idx_mapping)
    out.append(("released", ("ok", repr((tokens, idx)))))
    return out


async def _bad_calls(config: SyncConfig, group: dist.ProcessGroup) -> list[tuple[str, Outcome]]:
    async with open_rank(config, group) as rank:
        return await (_last_rank_calls(rank) if rank.is_last else _receiver_calls(rank))


def _bad_calls_rank(
    config: SyncConfig, framework: Framework, env: RankEnv
) -> list[tuple[str, Outcome]]:
    return anyio.run(_bad_calls, config, _group(config), backend=framework)


@pytest.mark.parametrize("framework", ["asyncio", "trio"])
def test_wrong_role_and_bad_input_raise_before_any_collective(framework: Framework) -> None:
    config = SyncConfig.build(
        pp_size=2, max_num_reqs=MAX_NUM_REQS, ring_depth=1, timeout_s=TIMEOUT_S
    )
    receiver, last = spawn_ranks(
        functools.partial(_bad_calls_rank, config, framework), 2, timeout_s=TIMEOUT_S
    )
    bad = f"idx_mapping\\[1\\] = {MAX_NUM_REQS + 3} outside \\[0, max_num_reqs = {MAX_NUM_REQS}\\)"
    expect_last = [
        ("post", "RoleError",
         r"post\(\) belongs to a non-last rank; group rank 1 of pp_size 2 is the last rank"),
        ("take", "RoleError",
         r"take\(\) belongs to a non-last rank; group rank 1 of pp_size 2 is the last rank"),
        ("publish idx out of range", "BatchError", bad),
        ("publish num_sampled > w", "BatchError", r"num_sampled\[0\] = 2 outside \[0, w = 1\]"),
        ("publish", "ok", r"2"),  # rows needing a sample: the step went out
    ]
    expect_receiver = [
        ("publish", "RoleError",
         r"publish\(\) belongs to the last rank; group rank 0 of pp_size 2 is not the last rank"),
        ("take bad draft table", "BatchError", r"num_speculative_steps = 0"),
        ("take", "ok", r"None"),
        ("post idx out of range", "BatchError", bad),
        ("post", "ok", r"2"),
        ("post again", "ProtocolError",
         r"^rank 0: post\(\) without a take\(\) before it; each step is take\(\) then post\(\)$"),
        # the one valid step arrived intact after every rejected call
        ("released", "ok", re.escape(repr(((500, 501), tuple(IDX))))),
    ]
    for got, expected in ((last, expect_last), (receiver, expect_receiver)):
        assert [label for label, _ in got] == [label for label, _, _ in expected], got
        for (label, (kind, message)), (_, want_kind, pattern) in zip(got, expected, strict=True):
            assert kind == want_kind, (label, kind, message)
            assert re.fullmatch(pattern, message) if want_kind == "ok" else re.search(
                pattern, message), (label, message)


# -- a peer alive but stuck in its engine ------------------------------------------------

SHORT_TIMEOUT_S = 1.0
SILENT_S = 1.8  # the peer stays alive, in its engine, sending nothing, past the timeout


@dataclass(frozen=True, slots=True)
class Silence:
    """What the receiver saw while its peer stayed silent."""

    kind: str  # type name of the exception that left open_rank; "" for none
    message: str
    after_s: float  # from the receive being posted to the error
    threads_before: list[str]  # after the groups exist, before anyio.run
    threads_after: list[str]  # after anyio.run returned


async def _silent_last(config: SyncConfig, group: dist.ProcessGroup) -> tuple[str, str, float]:
    async with open_rank(config, group):
        await anyio.sleep(SILENT_S)
    return "", "", 0.0


async def _waiting_receiver(
    config: SyncConfig, group: dist.ProcessGroup
) -> tuple[str, str, float]:
    posted = time.perf_counter()
    try:
        async with open_rank(config, group) as rank:
            assert await rank.take() is None
            await rank.post(decode_view(IDX))
            posted = time.perf_counter()
            await rank.take()
    except Exception as e:
        return type(e).__name__, str(e), time.perf_counter() - posted
    return "", "take() returned", time.perf_counter() - posted


def _threads() -> list[str]:
    return sorted(f"{t.name}:{t.ident}" for t in threading.enumerate())


def _silence_rank(config: SyncConfig, framework: Framework, mode: Mode, env: RankEnv) -> Silence:
    group = mode_group(_group(config), mode)
    before = _threads()
    main = _silent_last if env.rank == config.pp_size - 1 else _waiting_receiver
    kind, message, after_s = anyio.run(main, config, group, backend=framework)
    return Silence(kind, message, after_s, before, _threads())


@pytest.mark.parametrize(("framework", "mode"), [("asyncio", "gloo"), ("trio", "gloo"),
                                             ("asyncio", "twin"), ("trio", "twin")])
def test_a_stuck_peer_is_a_sync_timeout_at_timeout_s_saying_what_it_does(
        framework: Framework, mode: Mode) -> None:
    """A peer alive (its heartbeat runs) but stuck in its engine: the wait
    ends at timeout_s from its start, and the error says the peer is alive
    and what it was doing, never that it is silent."""
    config = in_mode(SyncConfig.build(
        pp_size=2, max_num_reqs=MAX_NUM_REQS, ring_depth=1, timeout_s=SHORT_TIMEOUT_S
    ), mode)
    receiver, last = spawn_ranks(
        functools.partial(_silence_rank, config, framework, mode), 2, timeout_s=TIMEOUT_S
    )
    assert last.kind == "", last
    assert receiver.kind == "SyncTimeout", receiver
    assert re.search(r"rank 0: .*no completion within timeout_s = 1\.0", receiver.message), (
        receiver.message
    )
    assert re.search(r"rank 1 \(PP stage 1\): alive, in its engine's step \d+",
                     receiver.message), receiver.message
    assert "silent" not in receiver.message, receiver.message
    # bounded by the configured timeout, not by gloo's or the launcher's
    assert SHORT_TIMEOUT_S * 0.9 <= receiver.after_s < SHORT_TIMEOUT_S + 1.5, receiver
    # the error path leaves no thread of ppsync's behind either
    assert receiver.threads_after == receiver.threads_before, receiver
