"""What the coordinator believes of a worker's message: only what that worker may claim.

The node endpoint has already checked that the relaying node runs the worker and that the
message is well formed (``hotspare.protocol.messages``); here a worker's claims are held
against the coordinator's own picture: it speaks only for the rank it was given (a spare that
holds none speaks for no rank), and of no generation that has not been formed yet."""
from __future__ import annotations

from hotspare.errors import ProtocolError
from hotspare.protocol.messages import Message


def check_claims(msg: Message, held_rank: int | None, generation: int, world_size: int) -> None:
    """Raise ProtocolError when ``msg`` claims what its worker cannot: a rank other than
    ``held_rank`` (or outside the job's ``world_size``), or a generation after ``generation``."""
    gen, rank = msg.get("gen"), msg.get("rank")
    if isinstance(gen, int) and gen > generation:
        raise ProtocolError(f"{msg['type']!r} of generation {gen}, but generation {generation} is the newest")
    if isinstance(rank, int) and (rank >= world_size or rank != held_rank):
        held = "no rank" if held_rank is None else f"rank {held_rank}"
        raise ProtocolError(f"{msg['type']!r} for rank {rank} from a worker that holds {held}")
