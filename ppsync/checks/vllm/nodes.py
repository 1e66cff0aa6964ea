"""Two "hosts" on one machine for ``vllm-check --nodes 2``: network namespaces
joined by one veth pair.

Each namespace is a host: its own loopback, one veth end (address
``10.77.<n>.1`` or ``.2``/24) and nothing else, so any byte between a
process in one and a process in the other crosses the veth, and the veth's
counters (``/sys/class/net/<veth>/statistics``, read inside the namespace)
count it. Names carry this process's pid and a run number, so two checks
never collide. Every process started in a namespace here is one of the
check's (the namespaces are new), so :meth:`HostPair.kill_all` may signal
whatever ``ip netns pids`` lists, and :meth:`HostPair.remove` deletes both
namespaces (and so the veth) even after a half-made pair.

Root only (``ip netns add``): :func:`netns_unavailable` says why not.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["HostPair", "VethBytes", "netns_unavailable"]

_CMD_TIMEOUT_S = 30.0  # one `ip` command; it returns in milliseconds when well


def _ip(*args: str, ns: str | None = None, check: bool = True) -> subprocess.CompletedProcess[str]:
    cmd = ["ip", *args] if ns is None else ["ip", "-n", ns, *args]
    return subprocess.run(cmd, check=check, capture_output=True, text=True,
                          timeout=_CMD_TIMEOUT_S)


def netns_unavailable() -> str | None:
    """Why two namespaces cannot be made here, or None when they can."""
    if shutil.which("ip") is None:
        return "the `ip` command (iproute2) is not installed"
    probe = f"ppsync-vc-probe-{os.getpid()}"
    proc = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True,
                          timeout=_CMD_TIMEOUT_S, check=False)
    if proc.returncode != 0:
        return f"`ip netns add` is not permitted here (root is needed): {proc.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True,
                   timeout=_CMD_TIMEOUT_S, check=False)
    return None


@dataclass(frozen=True)
class VethBytes:
    """One veth end's counters, as its namespace's kernel counted them."""

    tx: int
    rx: int

    def __sub__(self, before: VethBytes) -> VethBytes:
        return VethBytes(self.tx - before.tx, self.rx - before.rx)


class HostPair:
    """Two namespaces (host 0 and host 1) joined by a veth pair; see the
    module docstring. ``run`` numbers the pair within this process (each
    run of the check gets a fresh pair)."""

    def __init__(self, run: int = 0) -> None:
        pid = os.getpid()
        self.names = (f"ppsync-vc{pid}-{run}-a", f"ppsync-vc{pid}-{run}-b")
        # an interface name holds 15 bytes: the pid and run keep them apart
        self.ifnames = (f"pv{pid % 10**7}{run % 10}a", f"pv{pid % 10**7}{run % 10}b")
        self.subnet = f"10.77.{run % 250}"
        self.made: list[str] = []
        try:
            self._make()
        except BaseException:
            self.remove()
            raise

    def addr(self, host: int) -> str:
        return f"{self.subnet}.{host + 1}"

    def _make(self) -> None:
        for name in self.names:
            _ip("netns", "add", name)
            self.made.append(name)
            _ip("link", "set", "lo", "up", ns=name)
        a, b = self.ifnames
        _ip("link", "add", a, "netns", self.names[0], "type", "veth", "peer", "name", b,
            "netns", self.names[1])
        for host in (0, 1):
            ns, ifname = self.names[host], self.ifnames[host]
            _ip("addr", "add", f"{self.addr(host)}/24", "dev", ifname, ns=ns)
            _ip("link", "set", ifname, "up", ns=ns)

    def exec_prefix(self, host: int) -> list[str]:
        """Run a command on ``host``: ``[*prefix, cmd...]``."""
        return ["ip", "netns", "exec", self.names[host]]

    def veth_bytes(self, host: int) -> VethBytes:
        """``host``'s veth counters (bytes sent, received)."""
        out = subprocess.run(
            [*self.exec_prefix(host), "cat",
             *(f"/sys/class/net/{self.ifnames[host]}/statistics/{c}_bytes" for c in ("tx", "rx"))],
            check=True, capture_output=True, text=True, timeout=_CMD_TIMEOUT_S).stdout.split()
        return VethBytes(int(out[0]), int(out[1]))

    def pids(self, host: int) -> list[int]:
        """The processes running on ``host`` (zombies included: gone but for
        their parent's reaping)."""
        proc = _ip("netns", "pids", self.names[host], check=False)
        return [int(p) for p in proc.stdout.split() if p.isdigit()]

    def live(self, host: int) -> list[str]:
        """``host``'s live processes as "pid state name" (zombies left out)."""
        out = []
        for pid in self.pids(host):
            try:
                with open(f"/proc/{pid}/stat") as f:
                    stat = f.read()
            except OSError:
                continue
            name = stat[stat.find("(") + 1:stat.rfind(")")]
            state = stat[stat.rfind(")") + 2:].split()[0]
            if state != "Z":
                out.append(f"{pid} {state} {name}")
        return out

    def signal_all(self, host: int, sig: signal.Signals) -> list[int]:
        """Send ``sig`` to every process on ``host``; the pids signalled."""
        done = []
        for pid in self.pids(host):
            try:
                os.kill(pid, sig)
                done.append(pid)
            except ProcessLookupError:
                continue
        return done

    def kill_all(self, host: int, wait_s: float = 10.0) -> list[str]:
        """SIGKILL every process on ``host`` (a stopped one too: SIGKILL
        ends it; SIGCONT after lets it be reaped) until none is live or
        ``wait_s`` passed; what is still live then."""
        deadline = time.monotonic() + wait_s
        while True:
            self.signal_all(host, signal.SIGKILL)
            self.signal_all(host, signal.SIGCONT)
            left = self.live(host)
            if not left or time.monotonic() > deadline:
                return left
            time.sleep(0.1)

    def link_down(self, host: int) -> None:
        """Take ``host``'s veth end down: its packets go nowhere, no reset
        reaches either side (a cut cable, a dead switch port)."""
        _ip("link", "set", self.ifnames[host], "down", ns=self.names[host])

    def remove(self) -> list[str]:
        """Kill what runs in either namespace, delete both (the veth goes
        with them); the processes that would not die (reported, then the
        namespaces are deleted anyway)."""
        left: list[str] = []
        for host, name in enumerate(self.names):
            if name in self.made:
                left += self.kill_all(host)
        for name in reversed(self.made):
            subprocess.run(["ip", "netns", "del", name], capture_output=True,
                           timeout=_CMD_TIMEOUT_S, check=False)
        self.made.clear()
        return left


def namespaces_left(prefix: str = "ppsync-vc") -> Sequence[str]:
    """Namespaces named ``prefix``... that exist now (a test's cleanup check)."""
    proc = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True,
                          timeout=_CMD_TIMEOUT_S, check=False)
    return [line.split()[0] for line in proc.stdout.splitlines()
            if line.startswith(prefix)]
