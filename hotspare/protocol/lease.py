"""What both ends of a node lease agree on (``hotspare.agent.lease``, ``hotspare.coordinator.lease``):
how often it is renewed, and how the launcher's welcome proves it holds the job secret."""
from __future__ import annotations

from hotspare.protocol import auth

COORDINATOR = "coordinator"     # the role the welcome's proof is made for


def period(lease: float) -> float:
    """How often an agent renews: several renewals fit in one lease, so one late or lost
    renewal costs nothing."""
    return max(0.05, lease / 6)


def welcome_proof(secret: bytes, node: str, nonce: str) -> str:
    """The launcher's answer to the nonce in node ``node``'s hello: only a holder of the job
    secret can make it, so an agent runs no job for an impostor."""
    return auth.proof(auth.node_key(secret), COORDINATOR, node, nonce)
