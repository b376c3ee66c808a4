"""The launcher's endpoint for node agents on other hosts (``hotspare run --listen``).

It is a ``NodeEndpoint`` bound to the address given (never a wildcard), whose nodes hold
leases (``hotspare.coordinator.lease``) and are welcomed with the job: the script and its
arguments, the worker contract and the rendezvous address, with a proof that the launcher
holds the job secret, and how often to send its host's device telemetry. A node whose lease
expires is reported to the coordinator exactly as one whose link closed (``NodeLost``): its
workers are lost with it and fail over to spares elsewhere.
"""
from __future__ import annotations

import queue
import time
from typing import Callable

from hotspare.coordinator.events import NodeLost
from hotspare.coordinator.lease import Leases
from hotspare.coordinator.nodes import NodeEndpoint
from hotspare.protocol.channel import Channel
from hotspare.protocol.lease import welcome_proof
from hotspare.protocol.messages import Message, make


def remote_endpoint(events: "queue.Queue", secret: bytes, owner: Callable[[str], str | None], host: str,
                    port: int, lease: float, margin: float, script: str, args: list[str], env: dict[str, str],
                    log: Callable[[str], None], telemetry_period: float = 0.0) -> NodeEndpoint:
    """``telemetry_period``: how often each agent polls its host's devices and sends the readings
    (``hotspare.agent.telemetry``); 0: not at all (the job's telemetry is off)."""
    def welcome(hello: Message) -> Message:
        nonce = hello.get("nonce")
        proof = welcome_proof(secret, hello["node"], nonce) if isinstance(nonce, str) else ""
        return make("welcome", lease=lease, script=script, args=list(args), env=dict(env), proof=proof,
                    telemetry_period=telemetry_period)

    def expired(node: str, channel: Channel, silent: float) -> None:
        log(f"NODE    {node}: no lease renewal for {silent:.1f} s (lease {lease:g} s + margin {margin:g} s): "
            "declared lost")
        events.put(NodeLost(node, channel, time.time()))
        channel.close()          # nothing it sends from now on is read; a stale agent must join anew

    return NodeEndpoint(events, secret, owner, host=host, port=port, welcome=welcome,
                        leases=Leases(lease, margin, expired))
