"""A node agent on another host: ``hotspare agent --coordinator ADDR:PORT``.

It proves the job secret to the launcher's node endpoint (``hotspare run --listen``), checks
the launcher's proof in return (the welcome answers the agent's own nonce: a process without
the secret cannot make this host run anything), learns the job from the welcome (the script
and its arguments, the worker contract, ``MASTER_ADDR``), holds a lease it renews
(``hotspare.agent.lease``) and from then on is the same ``NodeAgent`` as a local one. It fences
itself (kills its workers and exits) once its lease runs out or its coordinator is gone.
The script must be at the same path on every host.
"""
from __future__ import annotations

import hmac
import os
import queue
import secrets
import sys
import threading
import time
from typing import Callable

from hotspare.agent.agent import NodeAgent
from hotspare.agent.lease import AgentLease
from hotspare.protocol.netif import gloo_interface
from hotspare.agent.telemetry import NodeTelemetry
from hotspare.errors import ConfigError, ProtocolError
from hotspare.protocol import auth
from hotspare.protocol.channel import Channel
from hotspare.protocol.lease import welcome_proof
from hotspare.protocol.messages import Message
from hotspare.protocol.workerenv import without_contract

EXIT_FENCED = 3                 # the lease ran out: this node fenced itself


def parse_devices(spec: str | None, node: str) -> list[str]:
    """``cpu:N`` -> N CPU device slots named ``NODE/cpu0``...; ``gpu``: every GPU NVML sees
    here, ``NODE/gpuI`` (I its NVML index); None or "none": no slots."""
    if spec in (None, "none"):
        return []
    if spec == "gpu":
        from hotspare.health.telemetry import NvmlSource
        nvml = NvmlSource(node)
        ok, why = nvml.status()
        names = nvml.devices() if ok else []
        nvml.close()
        if not names:
            raise ConfigError(f"--devices gpu: no GPU readable here ({why}); use cpu:N")
        return names
    kind, _, count = spec.partition(":")
    if kind != "cpu" or not count.isdigit() or not 1 <= int(count) <= 4096:
        raise ConfigError(f"--devices {spec!r}: use cpu:N with N in 1..4096, gpu, or none")
    return [f"{node}/cpu{i}" for i in range(int(count))]


def worker_env(welcome: Message, base: dict[str, str], say) -> dict[str, str]:
    """This host's environment less any stale worker contract, plus the job's, plus the gloo
    interface that reaches the store (unless GLOO_SOCKET_IFNAME is set already)."""
    env = {**without_contract(base), **welcome["env"]}
    if "GLOO_SOCKET_IFNAME" not in env and "MASTER_ADDR" in env:
        name, why = gloo_interface(env["MASTER_ADDR"])
        if name is not None:
            env["GLOO_SOCKET_IFNAME"] = name
        say(f"gloo interface: {why}")
    return env


def _serve_pool(ch: Channel, registered: Message, hello_at: float, coordinator: str, secret: bytes, node: str,
                devices: list[str], spare: bool, spawn: str, say, telemetry: NodeTelemetry) -> int:
    from hotspare.agent.pooled import ServiceLink, serve_pool
    link = ServiceLink(coordinator, secret, node, devices, spare, say, device_faults=telemetry.injectable)
    link.attach(ch, registered, hello_at)
    say(f"registered with the coordinator service at {coordinator}: {len(devices)} device slot(s)"
        + (", a spare host" if spare else "") + f", lease {registered['lease']:g} s")
    try:
        return serve_pool(link, sys.executable, dict(os.environ), spawn,
                          lambda assign: worker_env(assign, dict(os.environ), say), telemetry)
    finally:
        telemetry.close()


class LeasedUplink:
    """The agent's link to the coordinator, read by a thread of its own: lease answers
    (``renewed``) and a refusal are handled the moment they arrive, even while the agent's
    command thread is busy (a spawn waits for the zygote to import torch: seconds); every other
    message waits in order for the agent's ``recv``. Sends go straight to the channel."""

    def __init__(self, channel: Channel, lease: AgentLease, on_refused: Callable[[str], None]):
        self.channel, self._lease, self._on_refused = channel, lease, on_refused
        self._queue: "queue.Queue[Message | None | Exception]" = queue.Queue()
        threading.Thread(target=self._read, name="agent-uplink", daemon=True).start()

    def _read(self) -> None:
        while True:
            try:
                msg = self.channel.recv()
            except ProtocolError as e:    # one bad line: the agent's loop answers it, the link goes on
                self._queue.put(e)
                continue
            except OSError:
                msg = None
            if msg is not None and msg["type"] == "renewed":
                self._lease.renewed(msg)
                continue
            if msg is not None and msg["type"] == "refused":
                self._on_refused(msg["message"])
                continue
            self._queue.put(msg)
            if msg is None:
                return

    def recv(self) -> Message | None:
        item = self._queue.get()
        if isinstance(item, Exception):
            raise item
        return item

    def send(self, msg: Message) -> None:
        self.channel.send(msg)

    def close(self) -> None:
        self.channel.close()


def serve(coordinator: str, secret: bytes, node: str, devices: list[str], spawn: str = "fork",
          spare: bool = False, allow_inject: bool = False) -> int:
    """Run this host's agent until the job ends (0), or the lease runs out (EXIT_FENCED). At a
    coordinator service (``hotspare coordinator``) the agent joins its pool instead and works
    for the jobs placed on it (``hotspare.agent.pooled``); ``spare``: this host holds spares.
    ``allow_inject``: load the fault plug-in (its device faults drive this host's simulated telemetry)."""
    def say(line: str) -> None:
        print(f"hotspare agent {node}: {line}", file=sys.stderr, flush=True)

    # --- this host's device telemetry, polled here, sent up as readings (hotspare.agent.telemetry)
    telemetry = NodeTelemetry(node, devices, say, allow_inject)

    nonce = secrets.token_hex(16)
    hello_at = time.monotonic()        # this side's lease counts from before the hello went out
    try:
        ch = auth.connect(coordinator, auth.NODE, auth.node_key(secret), node=node, pid=os.getpid(),
                          devices=devices, nonce=nonce, spare=spare, job="", alive=[],
                          device_faults=telemetry.injectable)
    except OSError as e:
        raise ConfigError(f"cannot reach the coordinator at {coordinator}: {e}") from None
    welcome = ch.recv(any_version=True)     # a refusal of a coordinator of another version, too
    if welcome is not None and welcome["type"] == "registered":
        if not hmac.compare_digest(welcome_proof(secret, node, nonce), welcome["proof"]):
            ch.close()
            raise ProtocolError(f"{coordinator} could not prove it holds the secret; not working for it")
        return _serve_pool(ch, welcome, hello_at, coordinator, secret, node, devices, spare, spawn, say, telemetry)
    if welcome is None or welcome["type"] != "welcome":
        why = welcome["message"] if welcome and welcome["type"] == "refused" else "it closed the link"
        ch.close()
        raise ProtocolError(f"the coordinator at {coordinator} did not welcome node {node}: {why}")
    if not hmac.compare_digest(welcome_proof(secret, node, nonce), welcome["proof"]):
        ch.close()
        raise ProtocolError(f"{coordinator} could not prove it holds the job secret; not running its job")
    env = worker_env(welcome, dict(os.environ), say)
    cmd = [sys.executable, welcome["script"], *welcome["args"]]
    fenced, refused = threading.Event(), []
    holder: list[NodeAgent] = []

    def on_refused(message: str) -> None:       # the coordinator would not take this node
        refused.append(message)
        say(f"refused by the coordinator: {message}")

    def fence(silent: float) -> None:
        fenced.set()
        agent = holder[0]
        say(f"FENCE   lease of {welcome['lease']:g} s ran out ({silent:.1f} s since the last answered renewal "
            f"was sent): killing this node's {len(agent.alive())} worker(s) and leaving the job")
        agent.shutdown(grace=0.0)

    lease = AgentLease(float(welcome["lease"]), send=ch.send, fence=fence, granted_at=hello_at)
    uplink = LeasedUplink(ch, lease, on_refused)
    agent = NodeAgent(cmd, env, coordinator, secret, node=node, devices=devices, spawn=spawn,
                      uplink=uplink, faults=telemetry.job_faults())  # type: ignore[arg-type]   # a Channel's send/recv/close
    holder.append(agent)
    telemetry.start(agent, welcome.get("telemetry_period"))     # --- telemetry: the period is the launcher's
    lease.start()
    say(f"joined {coordinator}: {len(devices)} device slot(s), lease {welcome['lease']:g} s")
    agent.wait_closed()
    telemetry.close()                                            # --- telemetry
    lease.stop()
    if fenced.is_set():
        return EXIT_FENCED
    if refused:
        raise ProtocolError(f"the coordinator at {coordinator} refused node {node}: {refused[0]}")
    say("the job ended (or the launcher is gone); this node's workers are ended")
    return 0
