"""The SGLang guard between two real processes on gloo (no SGLang: a
stand-in scheduler drives the plugin's hooks the way SGLang's PP loop
calls them): views checked across the wire, a lost stage named, a stopped
stage named silent (by the waiting stage's watcher, which then ends that
stage: its scheduler is blocked in a gloo wait), a stuck but alive stage
named at the timeout, a slow stage waited for, a desync named on both
stages."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from rank_procs import free_port

CHILD = textwrap.dedent('''
    import os, sys, time
    from datetime import timedelta
    import torch, torch.distributed as dist
    from ppsync.compat.sglang import hooks
    from ppsync.compat.sglang.hooks import RECEIVE, SEND, bounded
    from ppsync.errors import PPSyncError

    rank, port, case = int(sys.argv[1]), sys.argv[2], sys.argv[3]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=2, timeout=timedelta(seconds=60))
    dist.irecv = bounded(dist.irecv, RECEIVE)
    dist.isend = bounded(dist.isend, SEND)
    cpu = dist.new_group([0, 1], backend="gloo")

    class Req:
        def __init__(self, rid):
            self.rid, self.origin_input_ids, self.output_ids = rid, [1, 2], []
            self.req_pool_idx = int(rid[1:])

    class Batch:
        forward_mode = 2
        def __init__(self, reqs): self.reqs = reqs

    class Group:
        world_size, cpu_group, device_group = 2, cpu, cpu
        rank_in_group = rank
        is_last_rank = rank == 1

    class Scheduler:  # what the hooks read of SGLang's scheduler
        pp_group = Group()
        cur_batch_for_debug = None

    def send(sched, tensor_dict, async_send=True, msg_type="default"):
        views = torch.tensor(tensor_dict["__ppsync_view__"], dtype=torch.int64)
        return [dist.isend(views, 1 - rank, group=cpu)]

    def recv(sched, expected_kind="default"):
        buf = torch.zeros(8, dtype=torch.int64)
        dist.irecv(buf, 1 - rank, group=cpu).wait()
        return {"__ppsync_view__": tuple(int(v) for v in buf)}, None

    sched = Scheduler()
    try:
        for step in range(3):
            sched.cur_batch_for_debug = Batch([Req("r0"), Req("r1" if step != 2 or rank == 0
                                                               or case != "desync" else "r9")])
            if rank == 0:
                if case == "kill" and step == 1:
                    time.sleep(0.5)
                for work in hooks.send_dict(send, sched, {}, msg_type="proxy"):
                    work.wait()
                if step == 2:  # then wait for a reply that a failed stage never sends
                    hooks.recv_typed_dict(recv, sched, expected_kind="proxy")
            else:
                if case == "kill" and step == 1:
                    os._exit(3)
                if case == "stuck" and step == 1:
                    time.sleep(30)
                if case == "slow" and step == 1:
                    time.sleep(6)  # alive, slower than silent_s, within the timeout
                if case == "stop" and step == 1:
                    os.kill(os.getpid(), 19)  # SIGSTOP
                hooks.recv_typed_dict(recv, sched, expected_kind="proxy")
                if step == 2:
                    for work in hooks.send_dict(send, sched, {}, msg_type="proxy"):
                        work.wait()
        print("DONE", flush=True)
    except PPSyncError as e:
        print(f"RAISED {type(e).__name__} peer={getattr(e, 'peer', None)}: {e}", flush=True)
        os._exit(1)
''')


def _run(case: str, tmp: Path) -> list[str]:
    port = str(free_port())
    env = {"PPSYNC_SGLANG": "1", "PPSYNC_TIMEOUT_S": "3" if case != "slow" else "10",
           "PPSYNC_SILENT_S": "2", "PPSYNC_DUMP_DIR": str(tmp)}
    import os

    procs = [subprocess.Popen([sys.executable, "-c", CHILD, str(r), port, case],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              env={**os.environ, **env}) for r in (0, 1)]
    outs = []
    for p in procs:
        try:
            out, _ = p.communicate(timeout=30 if case == "stop" else 60)
        except subprocess.TimeoutExpired:
            p.kill()  # the stopped stage
            out, _ = p.communicate()
        outs.append(out)
    return outs


def _raised(out: str) -> str:
    return next((line for line in out.splitlines() if line.startswith("RAISED")), "")


def test_healthy_views_agree(tmp_path: Path) -> None:
    outs = _run("healthy", tmp_path)
    assert all("DONE" in o for o in outs), outs


def test_a_killed_stage_is_named_lost(tmp_path: Path) -> None:
    out0, _ = _run("kill", tmp_path)
    assert "RAISED PeerLost peer=1: SGLang PP stage 0 (global rank 0): PP stage 1 (global " \
           "rank 1) is lost" in _raised(out0), out0
    assert (tmp_path / "ppsync-rank0.jsonl").exists()


def test_a_stuck_stage_is_named_alive_at_the_timeout(tmp_path: Path) -> None:
    out0, _out1 = _run("stuck", tmp_path)
    assert "RAISED SyncTimeout peer=1: SGLang PP stage 0 (global rank 0): PP stage 1 (global " \
           "rank 1) is alive but made no progress" in _raised(out0), out0


def test_a_slow_stage_is_waited_for(tmp_path: Path) -> None:
    outs = _run("slow", tmp_path)
    assert all("DONE" in o for o in outs), outs


def test_a_stopped_stage_is_named_silent_and_the_waiting_stage_ends(tmp_path: Path) -> None:
    out0, _out1 = _run("stop", tmp_path)
    assert "SyncTimeout: SGLang PP stage 0 (global rank 0): PP stage 1 (global rank 1) is " \
           "silent" in out0, out0
    assert "ending this stage (status 70)" in out0, out0


def test_a_desync_is_named_on_both_stages(tmp_path: Path) -> None:
    out0, out1 = _run("desync", tmp_path)
    assert _raised(out1).startswith("RAISED DesyncError peer=None: SGLang PP stage 1: proxy "
                                    "message 2 from stage 0: first differing field rids"), out1
    # stage 0 waits for a reply that will not come: its watcher reads the
    # notice, names the desync and ends the stage (or its wait raises first)
    assert "another stage found: SGLang PP stage 1: proxy message 2" in out0, out0


@pytest.mark.parametrize("case", ["desync"])
def test_without_the_view_check_the_desync_goes_unseen(tmp_path: Path, case: str,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PPSYNC_SGLANG_CHECK", "0")
    _out0, out1 = _run(case, tmp_path)
    assert "DesyncError" not in out1 and "DONE" in out1, out1
