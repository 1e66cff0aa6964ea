"""Network namespaces joined by a bridge: several "hosts" on one machine.

``Hosts(n)`` makes a bridge namespace holding a Linux bridge, and ``n`` host
namespaces, each with one veth (``veth0``, address 10.231.0.<i+1>/24) whose
peer is a port of the bridge. Every interface and address lives inside a
namespace made here; names carry this process's pid so parallel runs do not
collide; :meth:`Hosts.remove` deletes every namespace (and so every veth) and
runs even when creation failed half-way.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Sequence

IFNAME = "veth0"  # the host end, inside each host namespace
SUBNET = "10.231.0"


def _ip(*args: str, ns: str | None = None) -> None:
    cmd = ["ip", *args] if ns is None else ["ip", "netns", "exec", ns, "ip", *args]
    subprocess.run(cmd, check=True, capture_output=True, timeout=30)


def netns_unavailable() -> str | None:
    """Why network namespaces cannot be made here, or None when they can."""
    if shutil.which("ip") is None:
        return "the `ip` command (iproute2) is not installed"
    probe = f"ppsync-probe-{os.getpid()}"
    proc = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True,
                          timeout=30, check=False)
    if proc.returncode != 0:
        return f"`ip netns add` is not permitted here: {proc.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True, timeout=30, check=False)
    return None


class Hosts:
    """``n`` host namespaces on one bridge; see the module docstring."""

    def __init__(self, n: int, tag: str = "") -> None:
        base = f"pps{os.getpid()}{tag}"
        self.bridge = f"{base}-br"
        self.names = [f"{base}-h{i}" for i in range(n)]
        self.made: list[str] = []
        try:
            self._make()
        except BaseException:
            self.remove()
            raise

    def addr(self, i: int) -> str:
        return f"{SUBNET}.{i + 1}"

    def _add(self, name: str) -> None:
        _ip("netns", "add", name)
        self.made.append(name)
        _ip("link", "set", "lo", "up", ns=name)

    def _make(self) -> None:
        self._add(self.bridge)
        _ip("link", "add", "br0", "type", "bridge", ns=self.bridge)
        _ip("link", "set", "br0", "up", ns=self.bridge)
        for i, name in enumerate(self.names):
            self._add(name)
            port = f"p{i}"
            _ip("link", "add", IFNAME, "type", "veth", "peer", "name", port,
                "netns", self.bridge, ns=name)
            _ip("link", "set", port, "master", "br0", ns=self.bridge)
            _ip("link", "set", port, "up", ns=self.bridge)
            _ip("addr", "add", f"{self.addr(i)}/24", "dev", IFNAME, ns=name)
            _ip("link", "set", IFNAME, "up", ns=name)

    def exec_prefix(self, i: int) -> Sequence[str]:
        """Run a command in host ``i``: ``[*prefix, cmd...]``."""
        return ["ip", "netns", "exec", self.names[i]]

    def cut(self, i: int) -> None:
        """Take host ``i``'s link down (its packets go nowhere, no reset)."""
        _ip("link", "set", IFNAME, "down", ns=self.names[i])

    def remove(self) -> None:
        for name in reversed(self.made):
            subprocess.run(["ip", "netns", "del", name], capture_output=True, timeout=30,
                           check=False)
        self.made.clear()
