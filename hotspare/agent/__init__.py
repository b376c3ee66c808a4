"""Node agent: spawns and supervises workers and spares, injects faults."""
from hotspare.agent.agent import NodeAgent, describe_exit

__all__ = ["NodeAgent", "describe_exit"]
