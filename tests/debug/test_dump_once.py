"""One failure, one error event and one dump, however many of a rank's
tasks see it.

In the async services the engine's call and the transfer watcher each turn
one lost peer into their own error (two objects, same kind, same peer);
both leave the token path, and both used to be recorded and dumped. Here
two real ranks open a token path and rank 0 raises one failure twice the
way the services do (``TokenPath.failed``), then a later one of another
kind: the path failed already, so that is its failure again (the first),
not a failure of its own.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch.distributed as dist

from ppsync.core.path.token_path import TokenPath
from ppsync.core.wire.groups import token_group
from ppsync.errors import PeerLost, SyncTimeout
from ppsync.harness.launcher import RankEnv, spawn_ranks
from ppsync.schemas.config import SyncConfig
from ppsync.schemas.dump import DUMP_DIR_ENV


def _errors(file: Path) -> list[str]:
    lines = [json.loads(t) for t in file.read_text().splitlines()]
    return [e["error"] for e in lines if e.get("kind") == "error"]


def _seen_twice(env: RankEnv) -> list[list[str]]:
    config = SyncConfig.build(pp_size=2, max_num_reqs=8, timeout_s=10.0)
    group = token_group(dist.group.WORLD, timeout_s=10.0)  # type: ignore[arg-type]
    path = TokenPath(config, group, board=None)
    notes: list[list[str]] = []
    counts: list[list[str]] = []
    if env.rank == 0:
        file = Path(os.environ[DUMP_DIR_ENV]) / "ppsync-rank0.jsonl"
        for err in (PeerLost("the engine's call", peer=1),
                    PeerLost("the transfer watcher", peer=1),
                    SyncTimeout("a later wait", peer=1)):
            raised = path.failed(err)
            notes.append(getattr(raised, "__notes__", []))
            counts.append(_errors(file))
    path.close(drain=False)
    return [*notes, *counts] if env.rank == 0 else []


def test_one_failure_seen_by_two_tasks_is_recorded_and_dumped_once(tmp_path: Path) -> None:
    got = spawn_ranks(_seen_twice, 2, timeout_s=30, env={DUMP_DIR_ENV: str(tmp_path)})[0]
    notes, counts = got[:3], got[3:]
    file = tmp_path / "ppsync-rank0.jsonl"
    assert notes[0] == [f"flight record: {file}"]
    assert notes[1] == notes[0]  # the second view names the same dump
    assert notes[2] == notes[0]  # the path's failure, raised again
    assert counts[0] == ["PeerLost"]
    assert counts[1] == ["PeerLost"], counts  # not recorded, not dumped again
    assert counts[2] == ["PeerLost"], counts
