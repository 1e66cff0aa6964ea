"""The last rank owns what it sends before publish returns (docs/design.md,
"Own what you send"): an engine that writes its sampler's tensors in place
right after each publish never changes what the receivers get.

On the CPU twin of NCCL (ppsync.core.wire.completion.twin) the token path's side
stream runs later than the host, as a GPU's does; here it runs LAG_S behind
the host (a device behind a host that queues ahead), so anything the side
stream read of the engine's tensors it would read after the engine
overwrote them. Both device kernel sets.
"""

from __future__ import annotations

import functools

import numpy as np
import pytest
import torch
import torch.distributed as dist

from ppsync.core import SampledStep
from ppsync.core.codec.device_kernels import triton_error
from ppsync.core.path.token_path import TokenPath
from ppsync.core.rules import BatchView
from ppsync.core.wire.completion import STATS, emulate
from ppsync.core.wire.groups import token_group
from ppsync.harness.launcher import RankEnv, spawn_ranks
from ppsync.schemas.config import SyncConfig

N, K, STEPS, TIMEOUT_S = 4, 2, 8, 20.0
LAG_S = 0.05  # how far the twin's side streams run behind the host


def _view() -> BatchView:
    return BatchView(N, np.arange(N, dtype=np.int64), np.full(N, 9, dtype=np.int64),
                     np.ones(N, dtype=np.int64), np.full(N, 5, dtype=np.int64))


def _tokens(t: int) -> torch.Tensor:
    return torch.arange(N * (K + 1), dtype=torch.int64).reshape(N, K + 1) + 1000 * t


def _rank(kernels: str, carrier: str, env: RankEnv) -> list[list[list[int]]]:
    config = SyncConfig.build(pp_size=2, max_num_reqs=8, num_speculative_steps=K,
                              timeout_s=TIMEOUT_S, codec="device", device_kernels=kernels,
                              carrier=carrier)
    group = token_group(dist.group.WORLD, timeout_s=TIMEOUT_S)  # type: ignore[arg-type]
    emulate(group, carrier=carrier, lag_s=LAG_S)
    path = TokenPath(config, group, board=None)
    assert path.codec.device_kernels_name == kernels
    got: list[list[list[int]]] = []
    # the engine's own tensors, reused every step (as a sampler's output buffers)
    tokens = torch.empty((N, K + 1), dtype=torch.int64)
    num_sampled = torch.empty(N, dtype=torch.int32)
    num_rejected = torch.empty(N, dtype=torch.int32)
    for t in range(STEPS + 2):
        if path.is_last:
            if t >= STEPS:
                continue
            tokens.copy_(_tokens(t))
            num_sampled.fill_(K + 1)
            num_rejected.zero_()
            path.publish(_view(), SampledStep(tokens, num_sampled, num_rejected))
            # at once: the engine writes the next step's values in place
            tokens.fill_(-5)
            num_sampled.fill_(99)
            continue
        released = path.consume()
        if released is not None:
            got.append(released.sampled_tokens.tolist())
        if t < STEPS:
            path.post(_view())
    path.close()
    assert STATS.engine_waits_unconsumed == 0, STATS.where
    return got


def _kernel_sets() -> list[object]:
    why = triton_error()
    return ["torch", pytest.param("triton", marks=pytest.mark.skipif(
        why is not None, reason=f"Triton cannot be loaded ({why}); install ppsync[triton]"))]


@pytest.mark.parametrize("carrier", ["device", "host"])
@pytest.mark.parametrize("kernels", _kernel_sets())
def test_receivers_get_what_was_published_though_the_engine_overwrote_it(
        kernels: str, carrier: str) -> None:
    got = spawn_ranks(functools.partial(_rank, kernels, carrier), 2, timeout_s=TIMEOUT_S)[0]
    assert got == [_tokens(t).tolist() for t in range(STEPS)]
