"""The device codec on CPU tensors over real gloo ranks: the whole workload
arrives exactly (sync, and the anyio services on asyncio and trio), and bad
values raise the deferred typed errors on every rank, one step late, while
the group stays usable."""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass, field

import pytest
import torch
import torch.distributed as dist
from helpers import decode_view

from ppsync.core import SampledStep
from ppsync.core.codec.device_kernels import triton_error
from ppsync.core.path.token_path import TokenPath
from ppsync.core.wire.groups import token_group
from ppsync.core.wire.platform import Platform, StepEvent
from ppsync.errors import BatchError, DesyncError
from ppsync.harness.driver import Framework
from ppsync.harness.launcher import RankEnv, spawn_ranks
from ppsync.harness.local_run import format_table, run_local
from ppsync.schemas.config import SyncConfig

TIMEOUT_S = 20.0


@pytest.mark.parametrize("framework", [None, "asyncio", "trio"])
def test_device_codec_carries_the_workload_exactly(framework: Framework | None) -> None:
    config = SyncConfig.build(pp_size=3, max_num_reqs=16, num_speculative_steps=2,
                              timeout_s=TIMEOUT_S, codec="device")
    report = run_local(config, steps=300, seed=4, framework=framework)
    assert report.ok, format_table(report)
    *receivers, last = report.ranks
    for r in receivers:
        assert r.rows_delivered == r.rows_expected > 0
        assert last.rows_sent == r.rows_delivered + r.excluded
        assert (r.lost, r.stale, r.duplicated, r.corrupt) == (0, 0, 0, 0)
    assert "codec=device" in format_table(report)


# -- bad values: deferred, typed, on every rank ----------------------------------

K, L, N, P, STEPS = 2, 3, 3, 3, 10
BAD = {2: ("num_sampled", 1, L + 1), 6: ("num_rejected", 0, -1)}
"""step -> (field, row, value) the last rank sends."""


@dataclass
class Seen:
    errors: dict[int, str] = field(default_factory=dict)  # step of the call -> message
    released: list[int] = field(default_factory=list)  # seqs released intact


def _outputs(t: int) -> SampledStep:
    tokens = torch.arange(N * L, dtype=torch.int64).view(N, L) + 100 * t
    ns = torch.full((N,), L, dtype=torch.int32)
    nr = torch.zeros(N, dtype=torch.int32)
    if t in BAD:
        name, row, value = BAD[t]
        (ns if name == "num_sampled" else nr)[row] = value
    return SampledStep(tokens, ns, nr)


class LaggingEvent:
    """An event whose device work completes one query late, as a busy GPU's."""

    def __init__(self) -> None:
        self.queries = 0

    def query(self) -> bool:
        self.queries += 1
        return self.queries > 1

    def synchronize(self) -> None:
        self.queries = 2


class LaggingPlatform(Platform):
    """The CPU platform, except that each step's event completes late."""

    def record_event(self, stream: object) -> StepEvent:
        return LaggingEvent()


def _consume(path: TokenPath, seen: Seen) -> None:
    out = path.consume()
    if out is not None:
        seen.released.append(out.seq)


def _bad_values_rank(lag: bool, env: RankEnv) -> Seen:
    config = SyncConfig.build(pp_size=P, max_num_reqs=8, num_speculative_steps=K,
                              timeout_s=TIMEOUT_S, codec="device")
    group = token_group(dist.group.WORLD, timeout_s=TIMEOUT_S)  # type: ignore[arg-type]
    path = TokenPath(config, group,
                     platform=LaggingPlatform(torch.device("cpu")) if lag else None)
    seen = Seen()
    view = decode_view([1, 4, 6])
    for t in range(STEPS + P):  # the last P steps only drain the receivers' rings
        if path.is_last:
            if t >= STEPS:
                continue
            try:
                path.publish(view, _outputs(t))
            except BatchError as e:
                seen.errors[t] = str(e)
                path.publish(view, _outputs(t))  # nothing was sent: the step goes now
            continue
        try:
            _consume(path, seen)
        except BatchError as e:
            seen.errors[t] = str(e)
            if lag:  # the verdict of a step released before: the ring has not moved
                _consume(path, seen)
        if t < STEPS:
            path.post(view)
    path.close()
    return seen


def test_bad_values_raise_one_step_late_on_every_rank() -> None:
    seen = spawn_ranks(functools.partial(_bad_values_rank, False), P, timeout_s=TIMEOUT_S)
    *receivers, last = seen
    # the last rank: at its next call, naming field, row and value
    assert sorted(last.errors) == [3, 7]
    assert re.search(r"^num_sampled\[1\] = 4 outside \[0, w = 3\] .*step seq 2 was sent",
                     last.errors[3]), last.errors[3]
    assert re.search(r"^num_rejected\[0\] = -1 outside \[0, K = 2\] .*step seq 6 was sent",
                     last.errors[7]), last.errors[7]
    for rank, r in enumerate(receivers):
        # receivers: at the consume of that step (D = 3 steps after it was posted)
        assert sorted(r.errors) == [2 + P, 6 + P]
        assert re.search(rf"rank {rank}: frame seq 2 from the last rank \(global rank 2\) "
                         r"carries num_sampled\[1\] = 4 outside \[0, w = 3\]",
                         r.errors[2 + P]), r.errors[2 + P]
        assert re.search(r"frame seq 6 .* carries num_rejected\[0\] = -1 outside \[0, K = 2\]",
                         r.errors[6 + P]), r.errors[6 + P]
        # every other step arrived, in order: the group stayed usable
        assert r.released == [s for s in range(STEPS) if s not in BAD]


def _mixed_rank(fields: list[dict[str, str]], env: RankEnv) -> str:
    config = SyncConfig.build(pp_size=2, max_num_reqs=8, timeout_s=TIMEOUT_S,
                              **fields[env.rank])
    group = token_group(dist.group.WORLD, timeout_s=TIMEOUT_S)  # type: ignore[arg-type]
    try:
        TokenPath(config, group, board=None)
    except DesyncError as e:
        return str(e)
    return ""


def test_a_group_mixing_codecs_is_a_desync_at_the_handshake() -> None:
    """The codecs write the same bytes but report bad values at different
    times, so a group uses one: the handshake names the difference."""
    fields = [{"codec": "device"}, {"codec": "host"}]
    mixed = functools.partial(_mixed_rank, fields)
    for rank, msg in enumerate(spawn_ranks(mixed, 2, timeout_s=TIMEOUT_S)):
        mine, theirs = (1, 0) if rank == 0 else (0, 1)
        assert re.search(rf"device_codec: mine {mine} vs rank {1 - rank} {theirs}", msg), msg
        ks = ("torch", "none")
        assert re.search(rf"device_kernels: mine {ks[rank]} vs rank {1 - rank} "
                         rf"{ks[1 - rank]}", msg), msg


@pytest.mark.skipif(triton_error() is not None,
                    reason=f"Triton cannot be loaded ({triton_error()}): install ppsync[triton]")
def test_a_group_mixing_device_kernels_is_a_desync_at_the_handshake() -> None:
    """Both sets write the same frames, but a group uses one (the issue's
    rule: the handshake compares the set with the codec)."""
    ks = ("triton", "torch")
    fields = [{"codec": "device", "device_kernels": k} for k in ks]
    mixed = functools.partial(_mixed_rank, fields)
    for rank, msg in enumerate(spawn_ranks(mixed, 2, timeout_s=TIMEOUT_S)):
        assert "device_codec" not in msg, msg
        assert re.search(rf"device_kernels: mine {ks[rank]} vs rank {1 - rank} "
                         rf"{ks[1 - rank]}", msg), msg


def test_a_verdict_whose_event_is_late_raises_at_the_next_call() -> None:
    """Events that complete one query late (a busy GPU): the last rank still
    raises at its next call (prepare looks, then send looks again, before
    anything is issued); receivers at the next consume, before their ring
    moves, so that consume can be made again; the bad frame itself was
    already handed out."""
    seen = spawn_ranks(functools.partial(_bad_values_rank, True), P, timeout_s=TIMEOUT_S)
    *receivers, last = seen
    assert sorted(last.errors) == [3, 7]
    assert "num_sampled[1] = 4 outside [0, w = 3]" in last.errors[3]
    assert "num_rejected[0] = -1 outside [0, K = 2]" in last.errors[7]
    for r in receivers:
        assert sorted(r.errors) == [2 + P + 1, 6 + P + 1]
        assert "frame seq 2 from the last rank" in r.errors[2 + P + 1]
        assert "frame seq 6 from the last rank" in r.errors[6 + P + 1]
        assert r.released == list(range(STEPS))
