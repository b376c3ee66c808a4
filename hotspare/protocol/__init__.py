"""Versioned control messages between worker runtimes, node agents and the coordinator."""
from hotspare.protocol.messages import VERSION, Message, decode, encode

__all__ = ["VERSION", "Message", "decode", "encode"]
