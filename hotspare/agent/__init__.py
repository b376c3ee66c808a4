"""Node agent: spawns and supervises workers and spares (fault injection: hotspare.testing.faults)."""
from hotspare.agent.agent import NodeAgent

__all__ = ["NodeAgent"]
