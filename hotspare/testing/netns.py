"""Hosts on one machine: Linux network namespaces joined by veth pairs on a bridge.

``Hosts(["a", "b", "c"])`` makes one namespace per host, each with its own address on a
private /24 and its own loopback, plus a hub namespace that holds the bridge and has the
``.1`` address itself (the launcher runs there). Nothing is added to the caller's namespace.
Every port of the bridge is the hub's end of one host's veth pair, so ``cut(host)`` takes that
port down (a switch port failing: the host's link loses its carrier, no FIN or RST reaches
anyone) and ``heal(host)`` brings it back. ``close()`` kills whatever still runs in the
namespaces and removes them (deleting a namespace deletes its veth ends).

Needs root (CAP_NET_ADMIN and CAP_SYS_ADMIN) and ``ip`` from iproute2; ``unavailable()`` says
why not, for a test to skip with.
"""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass

SUBNET = "10.77.0"


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check)


def unavailable() -> str | None:
    """Why namespaces cannot be made here (None: they can)."""
    if shutil.which("ip") is None:
        return "no `ip` command (iproute2)"
    if os.geteuid() != 0:
        return "network namespaces need root (CAP_NET_ADMIN, CAP_SYS_ADMIN)"
    probe = f"hsprobe{os.getpid()}"
    made = _ip("netns", "add", probe, check=False)
    if made.returncode != 0:
        return f"cannot create a network namespace: {made.stderr.strip()}"
    _ip("netns", "del", probe, check=False)
    return None


@dataclass(frozen=True)
class Host:
    name: str
    ns: str
    addr: str
    port: str          # the hub's end of its veth pair (its bridge port)


class Hosts:
    def __init__(self, names: list[str], subnet: str = SUBNET):
        tag = f"hs{os.getpid() % 100000}"
        self.hub = f"{tag}-hub"
        self.hub_addr = f"{subnet}.1"
        self.hosts: dict[str, Host] = {}
        self._made: list[str] = []
        try:
            self._add_ns(self.hub)
            _ip("-n", self.hub, "link", "add", "br0", "type", "bridge")
            _ip("-n", self.hub, "addr", "add", f"{self.hub_addr}/24", "dev", "br0")
            _ip("-n", self.hub, "link", "set", "br0", "up")
            for i, name in enumerate(names):
                host = Host(name, f"{tag}-{name}", f"{subnet}.{10 + i}", f"p{i}")
                self._add_ns(host.ns)
                # both ends are made in the hub, then one moves into the host as its eth0
                _ip("-n", self.hub, "link", "add", host.port, "type", "veth", "peer", "name", f"h{i}")
                _ip("-n", self.hub, "link", "set", f"h{i}", "netns", host.ns)
                _ip("-n", host.ns, "link", "set", f"h{i}", "name", "eth0")
                _ip("-n", host.ns, "addr", "add", f"{host.addr}/24", "dev", "eth0")
                _ip("-n", host.ns, "link", "set", "eth0", "up")
                _ip("-n", self.hub, "link", "set", host.port, "master", "br0")
                _ip("-n", self.hub, "link", "set", host.port, "up")
                self.hosts[name] = host
        except BaseException:
            self.close()
            raise

    def _add_ns(self, ns: str) -> None:
        _ip("netns", "add", ns)
        self._made.append(ns)
        _ip("-n", ns, "link", "set", "lo", "up")

    def __getitem__(self, name: str) -> Host:
        return self.hosts[name]

    def argv(self, ns: str, argv: list[str], env: dict[str, str] | None = None) -> list[str]:
        """``argv`` run inside namespace ``ns`` (with ``env`` added to the caller's environment)."""
        return ["ip", "netns", "exec", ns, "env", *[f"{k}={v}" for k, v in (env or {}).items()], *argv]

    def pids(self, ns: str) -> list[int]:
        """Every process whose network namespace is ``ns`` (`ip netns pids`)."""
        out = _ip("netns", "pids", ns, check=False).stdout
        return [int(p) for p in out.split()]

    def kill_all(self, ns: str, sig: signal.Signals = signal.SIGKILL) -> list[int]:
        """Signal every process of ``ns`` at once: a host dying. The pids signalled."""
        pids = self.pids(ns)
        for pid in pids:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        return pids

    def cut(self, name: str) -> None:
        _ip("-n", self.hub, "link", "set", self.hosts[name].port, "down")

    def heal(self, name: str) -> None:
        _ip("-n", self.hub, "link", "set", self.hosts[name].port, "up")
        for ns in (self.hub, self.hosts[name].ns):      # forget the neighbours that failed meanwhile
            _ip("-n", ns, "neigh", "flush", "all", check=False)

    def reachable(self, name: str, timeout: float = 10.0) -> bool:
        """Wait until host ``name`` reaches the hub: a TCP connect to a closed port there is
        answered (refused) once the link carries traffic again (bounded retries)."""
        probe = ("import socket, sys\n"
                 "try: socket.create_connection((sys.argv[1], 9), timeout=1)\n"
                 "except ConnectionRefusedError: pass\n")
        deadline = time.time() + timeout
        while time.time() < deadline:
            done = subprocess.run(self.argv(self.hosts[name].ns, [sys.executable, "-c", probe, self.hub_addr]),
                                  capture_output=True)
            if done.returncode == 0:
                return True
        return False

    def close(self) -> None:
        for ns in reversed(self._made):
            for _ in range(3):            # a process may fork while the first ones die
                if not self.kill_all(ns):
                    break
            _ip("netns", "del", ns, check=False)
        self._made.clear()
