"""The Kubernetes preflight (services/k8s/): the LeaderWorkerSet manifest's
shape, and the command its pods run, rendered from the manifest with the
values LeaderWorkerSet gives a group, run in two network namespaces as two
pods of two ranks each (TP 2 x PP 2, the pipeline across the pods): exact
delivery, the table and exit codes in the logs, the report and the dumps on
the shared volume. The namespace test is skipped, with the reason, where
network namespaces cannot be made.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml
from netns import IFNAME, Hosts, netns_unavailable

from ppsync.schemas.run_report import RunReport

K8S = Path(__file__).resolve().parents[2] / "services" / "k8s"
MANIFEST = K8S / "preflight-lws.yaml"
SCRIPT = K8S / "preflight.sh"
PREFLIGHT = "ppsync-preflight"  # the init container
GROUP_INDEX_LABEL = "leaderworkerset.sigs.k8s.io/group-index"
LEADER_NAME = "vllm-0.vllm.default"  # LWS_LEADER_ADDRESS: <lws>-<group>.<lws>.<namespace>

Obj = dict[str, Any]


def _documents() -> dict[str, Obj]:
    docs = [d for d in yaml.safe_load_all(MANIFEST.read_text()) if d is not None]
    kinds = [d["kind"] for d in docs]
    assert len(set(kinds)) == len(kinds), kinds
    return {d["kind"]: d for d in docs}


def _pod_specs(lws: Obj) -> dict[str, Obj]:
    tpl = lws["spec"]["leaderWorkerTemplate"]
    return {"leader": tpl["leaderTemplate"]["spec"], "worker": tpl["workerTemplate"]["spec"]}


def _one(containers: list[Obj], name: str) -> Obj:
    found = [c for c in containers if c["name"] == name]
    assert len(found) == 1, [c["name"] for c in containers]
    return found[0]


def _env_value(container: Obj, name: str) -> Obj:
    return _one(container.get("env", []), name)


def _mounts(container: Obj) -> dict[str, str]:
    return {m["name"]: m["mountPath"] for m in container.get("volumeMounts", [])}


def test_the_manifest_is_a_leaderworkerset_whose_every_pod_runs_the_preflight() -> None:
    docs = _documents()
    lws = docs["LeaderWorkerSet"]
    assert lws["apiVersion"] == "leaderworkerset.x-k8s.io/v1"
    tpl = lws["spec"]["leaderWorkerTemplate"]
    assert isinstance(tpl["size"], int) and tpl["size"] >= 2, tpl["size"]
    # a failed check restarts its pod, and the whole group is made again
    assert tpl["restartPolicy"] == "RecreateGroupOnPodRestart"
    specs = _pod_specs(lws)
    preflights = {role: _one(spec["initContainers"], PREFLIGHT) for role, spec in specs.items()}
    assert preflights["leader"] == preflights["worker"]  # the same command, env, mounts
    assert specs["leader"]["volumes"] == specs["worker"]["volumes"]
    pre = preflights["leader"]
    volumes = {v["name"]: v for v in specs["leader"]["volumes"]}
    mounts = _mounts(pre)

    # the command is the script, from the ConfigMap made of services/k8s/preflight.sh
    assert pre["command"] == ["sh", f"/opt/ppsync-preflight/{SCRIPT.name}"]
    script_volume = next(n for n, p in mounts.items() if p == "/opt/ppsync-preflight")
    assert volumes[script_volume]["configMap"]["name"] == PREFLIGHT
    # LeaderWorkerSet sets its variables itself: the manifest must not shadow them
    names = {e["name"] for e in pre["env"]}
    assert not {n for n in names if n.startswith("LWS_")}, names
    group = _env_value(pre, "PPSYNC_GROUP_INDEX")["valueFrom"]["fieldRef"]["fieldPath"]
    assert group == f"metadata.labels['{GROUP_INDEX_LABEL}']"

    for role, spec in specs.items():
        serving = spec["containers"]
        assert serving, role
        for c in serving:
            # the serving set's size of pod: accelerators, NCCL environment, /dev/shm
            assert c["resources"] == pre["resources"], (role, c["name"])
            assert c["envFrom"] == pre["envFrom"], (role, c["name"])
            assert _mounts(c)["dshm"] == mounts["dshm"] == "/dev/shm", (role, c["name"])
    assert volumes["dshm"]["emptyDir"]["medium"] == "Memory"
    gpus = pre["resources"]["limits"]["nvidia.com/gpu"]
    assert _env_value(pre, "PPSYNC_NPROC_PER_NODE")["value"] == gpus
    assert _env_value(pre, "PPSYNC_DEVICE")["value"] == "cuda"
    env_from = [e["configMapRef"]["name"] for e in pre["envFrom"]]
    assert env_from == [docs["ConfigMap"]["metadata"]["name"]]
    assert docs["ConfigMap"]["data"]["NCCL_SOCKET_IFNAME"]

    # the report and the dumps land on a volume every pod of a group shares
    out_dir = _env_value(pre, "PPSYNC_OUT_DIR")["value"]
    out_volume = next(n for n, p in mounts.items() if p == out_dir)
    claim = volumes[out_volume]["persistentVolumeClaim"]["claimName"]
    pvc = docs["PersistentVolumeClaim"]
    assert claim == pvc["metadata"]["name"]
    assert "ReadWriteMany" in pvc["spec"]["accessModes"]


def render_pod(role: str, lws_env: dict[str, str], volume: Path,
               overrides: dict[str, str]) -> tuple[list[str], dict[str, str]]:
    """The preflight container of ``role`` ("leader" or "worker") as a
    process: its command, the ConfigMap's path mapped to services/k8s/, and
    its environment as the kubelet makes it (envFrom, then env; the group
    index from the pod's label), with LeaderWorkerSet's variables, the
    output volume at ``volume`` and ``overrides`` for this machine."""
    docs = _documents()
    spec = _pod_specs(docs["LeaderWorkerSet"])[role]
    pre = _one(spec["initContainers"], PREFLIGHT)
    mounts = _mounts(pre)
    script_dir = next(p for n, p in mounts.items()
                      if "configMap" in _one(spec["volumes"], n))
    command = [str(K8S / Path(a).relative_to(script_dir)) if a.startswith(script_dir + "/")
               else a for a in pre["command"]]
    venv_bin = str(Path(sys.executable).parent)  # torchrun, as on the image's PATH
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("TORCHELASTIC_") and k not in ("RANK", "WORLD_SIZE",
                                                              "LOCAL_RANK", "MASTER_ADDR",
                                                              "MASTER_PORT")}
    env["PATH"] = venv_bin + os.pathsep + env.get("PATH", "")
    for source in pre.get("envFrom", []):
        assert docs["ConfigMap"]["metadata"]["name"] == source["configMapRef"]["name"]
        env.update(docs["ConfigMap"]["data"])
    labels = {GROUP_INDEX_LABEL: "0"}
    for e in pre["env"]:
        if "value" in e:
            env[e["name"]] = e["value"]
        else:
            path = e["valueFrom"]["fieldRef"]["fieldPath"]
            key = re.fullmatch(r"metadata\.labels\['(.+)'\]", path)
            assert key is not None, path
            env[e["name"]] = labels[key.group(1)]
    env[_env_value(pre, "PPSYNC_OUT_DIR")["name"]] = str(volume)
    env.update(lws_env)
    env.update(overrides)
    return command, env


def test_the_script_refuses_a_worker_index_outside_the_group(tmp_path: Path) -> None:
    lws = {"LWS_LEADER_ADDRESS": "127.0.0.1", "LWS_GROUP_SIZE": "2", "LWS_WORKER_INDEX": "2"}
    command, env = render_pod("worker", lws, tmp_path, {})
    proc = subprocess.run(command, env=env, capture_output=True, text=True, timeout=30,
                          check=False)
    assert proc.returncode == 2, proc.stderr
    assert "LWS_WORKER_INDEX = 2 must be < LWS_GROUP_SIZE = 2" in proc.stderr
    del env["LWS_LEADER_ADDRESS"]
    proc = subprocess.run(command, env=env, capture_output=True, text=True, timeout=30,
                          check=False)
    assert proc.returncode == 2 and "LWS_LEADER_ADDRESS is not set" in proc.stderr


BAD_VALUES = [
    pytest.param({"PPSYNC_PP_SIZE": "abc"}, "PPSYNC_PP_SIZE = 'abc' must be an integer",
                 id="pp-size-abc"),
    pytest.param({"PPSYNC_PP_SIZE": "0"}, "PPSYNC_PP_SIZE = 0 must be >= 1", id="pp-size-0"),
    pytest.param({"PPSYNC_PP_SIZE": "3"}, "pp_size = 3 must divide world_size = 2",
                 id="pp-size-not-a-divisor"),
    pytest.param({"PPSYNC_STEPS": "-5"}, "argument --steps", id="steps-negative"),
    pytest.param({"PPSYNC_DEVICE": "cuda"}, "--device cuda", id="cuda-without-one"),
    pytest.param({"PPSYNC_TIMEOUT": "0"}, "argument --timeout", id="timeout-0"),
    pytest.param({"PPSYNC_PORT": "70000"}, "PPSYNC_PORT = 70000 must be >= 1 and <= 65535",
                 id="port-70000"),
    pytest.param({"PPSYNC_OUT_DIR": "/proc/preflight"}, "PPSYNC_OUT_DIR: cannot make",
                 id="out-dir-unwritable"),
    pytest.param({"LWS_GROUP_SIZE": "99999999999999999999"},
                 "LWS_GROUP_SIZE = 99999999999999999999 must be an integer >= 1",
                 id="group-size-oversized"),
]


@pytest.mark.timeout(120)
@pytest.mark.parametrize(("bad", "says"), BAD_VALUES)
def test_a_bad_value_exits_2_with_one_line_and_the_last_line(
    tmp_path: Path, bad: dict[str, str], says: str
) -> None:
    """Found before torchrun starts: one line naming the value on stderr, the
    documented last line on stdout, exit 2 (never torchrun's traceback)."""
    lws = {"LWS_LEADER_ADDRESS": "127.0.0.1", "LWS_GROUP_SIZE": "2", "LWS_WORKER_INDEX": "0"}
    command, env = render_pod("leader", lws, tmp_path,
                              {"PPSYNC_DEVICE": "cpu", "PPSYNC_NPROC_PER_NODE": "1", **bad})
    if env.get("PPSYNC_DEVICE") == "cuda" and torch.cuda.is_available():
        pytest.skip("this host has a CUDA device")
    proc = subprocess.run(command, env=env, capture_output=True, text=True, timeout=90,
                          check=False)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr and "Illegal number" not in proc.stderr, proc.stderr
    err = proc.stderr.strip().splitlines()
    assert len(err) == 1 and says in err[0], proc.stderr
    assert proc.stdout.strip().splitlines()[-1].endswith(": exit code 2"), proc.stdout


WHY_NOT = netns_unavailable()


@pytest.fixture
def pods() -> Iterator[Hosts]:
    """Two pods: network namespaces on a bridge, where the leader's LWS name
    resolves to pod 0's address (``ip netns exec`` puts /etc/netns/<ns>/hosts
    over /etc/hosts), as the group's headless service resolves it."""
    hosts = Hosts(2, tag="k8s")
    made: list[Path] = []
    try:
        for name in hosts.names:
            d = Path("/etc/netns") / name
            d.mkdir(parents=True)
            made.append(d)
            (d / "hosts").write_text(f"127.0.0.1 localhost\n{hosts.addr(0)} {LEADER_NAME}\n")
        yield hosts
    finally:
        for d in made:
            shutil.rmtree(d, ignore_errors=True)
        hosts.remove()


@pytest.mark.timeout(300)
@pytest.mark.skipif(WHY_NOT is not None, reason=str(WHY_NOT))
def test_two_pods_of_two_ranks_run_the_rendered_preflight_exactly(
    pods: Hosts, tmp_path: Path
) -> None:
    volume = tmp_path / "preflight"  # the shared claim
    overrides = {
        "GLOO_SOCKET_IFNAME": IFNAME,  # the pod's interface here
        "PPSYNC_DEVICE": "cpu", "PPSYNC_NPROC_PER_NODE": "2", "PPSYNC_STEPS": "150",
        "PPSYNC_SPEC": "1", "PPSYNC_MAX_NUM_REQS": "8", "PPSYNC_TIMEOUT": "30",
        "PPSYNC_JOIN_TIMEOUT": "90",
    }
    procs = []
    for index, role in enumerate(("leader", "worker")):
        lws = {"LWS_LEADER_ADDRESS": LEADER_NAME, "LWS_GROUP_SIZE": "2",
               "LWS_WORKER_INDEX": str(index)}
        command, env = render_pod(role, lws, volume, overrides)
        logs = open(tmp_path / f"pod{index}.log", "wb")  # noqa: SIM115 (closed below)
        procs.append((subprocess.Popen([*pods.exec_prefix(index), *command], env=env,
                                       stdout=logs, stderr=subprocess.STDOUT,
                                       start_new_session=True), logs))
    try:
        codes = [p.wait(timeout=240) for p, _ in procs]
    finally:
        for p, logs in procs:
            if p.poll() is None:  # the pod's shell, torchrun and its ranks
                os.killpg(p.pid, signal.SIGKILL)
                p.wait(timeout=10)
            logs.close()
    texts = [(tmp_path / f"pod{i}.log").read_text(errors="replace") for i in range(2)]
    assert codes == [0, 0], [t[-3000:] for t in texts]
    for i, text in enumerate(texts):  # the pod's log ends with the exit code
        assert text.rstrip().splitlines()[-1] == f"ppsync preflight: group 0 pod {i}: " \
            "exit code 0", text[-2000:]
    # the leader's log holds the one table: TP 2 x PP 2, pipeline across the pods
    assert "rank group role" in texts[0] and "rank group role" not in texts[1]
    lines = texts[0].splitlines()
    start = next(i for i, line in enumerate(lines) if "rank group role" in line)
    rows = [line.split() for line in lines[start + 1: start + 5]]
    assert [r[:3] for r in rows] == [["0", "0", "receiver"], ["1", "1", "receiver"],
                                     ["2", "0", "last"], ["3", "1", "last"]]
    for r in rows[:2]:
        expected, delivered, faults = int(r[6]), int(r[8]), r[9:13]
        assert delivered == expected > 0 and faults == ["0"] * 4, r
    assert re.search(r"world=4 pp_size=2 K=1 .* -> OK: 0 lost / 0 stale / 0 duplicated "
                     r"/ 0 corrupt", lines[start + 5]), lines[start + 5]
    # the report and every rank's dump, from both pods, on the volume
    report = RunReport.model_validate_json((volume / "group-0" / "report.json").read_text())
    assert report.ok and report.world_size == 4 and len(report.ranks) == 4
    for rank in report.ranks:
        if rank.role == "receiver":
            assert rank.rows_delivered == rank.rows_expected > 0, rank
    dumps = sorted(p.name for p in (volume / "group-0" / "dumps").iterdir())
    assert dumps == [f"ppsync-rank{r}.jsonl" for r in range(4)], dumps
