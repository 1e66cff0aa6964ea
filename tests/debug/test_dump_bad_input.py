"""A bad input leaving the token path is recorded and, with a dump
directory, dumped before it reaches the caller, on real gloo ranks: the
BatchError's message names the file, the file validates against schemas/,
its footer holds the error, and the group then completes a valid step."""

from __future__ import annotations

import re
from pathlib import Path

import torch
import torch.distributed as dist
from helpers import decode_view

from ppsync.cli import main
from ppsync.core import SampledStep
from ppsync.core.path.token_path import TokenPath
from ppsync.core.wire.groups import token_group
from ppsync.errors import BatchError
from ppsync.harness.launcher import RankEnv, spawn_ranks
from ppsync.schemas.config import SyncConfig
from ppsync.schemas.dump import DUMP_DIR_ENV

TIMEOUT_S = 10.0
IDX = [2, 5]


def _rank(env: RankEnv) -> tuple[str, int]:
    config = SyncConfig.build(pp_size=2, max_num_reqs=8, ring_depth=1, timeout_s=TIMEOUT_S)
    group = token_group(dist.group.WORLD, timeout_s=TIMEOUT_S)  # type: ignore[arg-type]
    path = TokenPath(config, group)
    message, released = "", -1
    if path.is_last:
        try:  # num_sampled 2 > the width 1 sent: rejected before any collective
            path.publish(decode_view(IDX), SampledStep(
                torch.tensor([[7], [8]]), torch.full((2,), 2, dtype=torch.int32),
                torch.zeros(2, dtype=torch.int32)))
        except BatchError as e:  # the message as raised; the dump named in a note
            message = "\n".join([str(e), *getattr(e, "__notes__", [])])
        path.publish(decode_view(IDX), SampledStep(
            torch.tensor([[7], [8]]), torch.ones(2, dtype=torch.int32),
            torch.zeros(2, dtype=torch.int32)))
    else:
        path.consume()
        path.post(decode_view(IDX))
        step = path.consume()
        assert step is not None
        released = int(step.sampled_tokens[1, 0])
        path.post(decode_view([]))
    path.close()
    return message, released


def test_a_bad_input_is_dumped_and_named_before_it_reaches_the_caller(tmp_path: Path) -> None:
    receiver, last = spawn_ranks(_rank, 2, timeout_s=TIMEOUT_S,
                                 env={DUMP_DIR_ENV: str(tmp_path)})
    assert receiver[1] == 8  # the valid step after the rejected one arrived intact
    message = last[0]
    match = re.search(r"num_sampled\[0\] = 2 outside \[0, w = 1\][^\n]*\nflight record: (\S+)$",
                      message)
    assert match, message
    dump = Path(match.group(1))
    assert dump.parent == tmp_path and dump.exists(), dump
    assert main(["dump", "validate", str(dump)]) == 0
    footer = dump.read_text().splitlines()[-1]
    assert "BatchError" in footer and "num_sampled[0] = 2" in footer, footer
