"""An aborted receive is never released (docs/design.md, "When they fail").

On NCCL, once ``group.abort()`` returned, every pending work reports
*completed*, without an error, its buffer never filled: read back from the
work, an aborted receive looks like a good one. The CPU twin reproduces that
(the buffer is poisoned instead of left unfilled). A receiver whose last
rank went silent times out on frame 1 and its path aborts the token group;
an engine that then calls consume again, or closes with a drain, must get
the abort's cause, never frame 2's poisoned buffer handed out as tokens.
"""

from __future__ import annotations

import functools
import json
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from helpers import decode_view

from ppsync.core import SampledStep
from ppsync.core.path.token_path import TokenPath
from ppsync.core.wire.completion import emulate
from ppsync.core.wire.groups import token_group
from ppsync.errors import PPSyncError
from ppsync.harness.launcher import RankEnv, spawn_ranks
from ppsync.schemas.config import SyncConfig

TIMEOUT_S = 1.0
SILENT_S = 4 * TIMEOUT_S  # the last rank stays alive, sending nothing more
IDX = [0, 1]


def _describe(call: str, fn: object) -> dict[str, object]:
    try:
        out = fn()  # type: ignore[operator]
    except PPSyncError as e:
        return {"call": call, "error": type(e).__name__, "message": str(e)}
    return {"call": call, "error": "", "returned": repr(out)[:300]}


def _rank(backend: str, out: Path, env: RankEnv) -> None:
    group = token_group(dist.group.WORLD, timeout_s=60.0)  # type: ignore[arg-type]
    emulate(group, backend)
    config = SyncConfig.build(pp_size=2, max_num_reqs=8, timeout_s=TIMEOUT_S,
                              codec="device", carrier="device", ring_depth=2)
    path = TokenPath(config, group, board=None)
    view = decode_view(IDX)
    if path.is_last:
        n = len(IDX)  # frame 0 is a real one
        path.publish(view, SampledStep(
            torch.full((n, 1), 7, dtype=torch.int64), torch.ones(n, dtype=torch.int32),
            torch.zeros(n, dtype=torch.int32)))
        time.sleep(SILENT_S)  # frames 1 and 2 never come
        path.close(drain=False)
        return
    seen = []
    for _ in range(3):  # frames 0, 1, 2 posted; frame 0 released
        path.consume()
        path.post(view)
    seen.append(_describe("consume frame 1", path.consume))  # times out: the abort
    seen.append(_describe("consume again", path.consume))  # frame 2 "completed" now
    seen.append(_describe("close(drain=True)", lambda: path.close(drain=True)))
    (out / "seen.json").write_text(json.dumps(seen))


@pytest.mark.parametrize("backend", ["nccl", "xccl"])
def test_an_aborted_receive_is_never_released(backend: str, tmp_path: Path) -> None:
    spawn_ranks(functools.partial(_rank, backend, tmp_path), 2, timeout_s=SILENT_S + 20)
    first, again, close = json.loads((tmp_path / "seen.json").read_text())
    assert first["error"] == "SyncTimeout", first
    assert "receive of frame 1: no completion within timeout_s" in first["message"], first
    # every later call raises the abort's cause; nothing of the group is released
    assert again["error"] == "SyncTimeout", again
    assert "aborted earlier" in again["message"], again
    # a drain of an aborted group neither waits on nor checks its buffers
    assert close == {"call": "close(drain=True)", "error": "", "returned": "None"}, close
