"""The state transfer as a recovery makes it (``runtime/statesync.py``: the source sends its
registry's snapshot, the receiver prepares its tensors from the manifest, receives, loads), for
the benches that time it against a raw broadcast of the same bytes (recovery.py, host_transfer.py)."""
from __future__ import annotations


def copy_state(reg, manifest: dict, rank: int) -> None:
    """Rank 0 sends ``reg``'s state to rank 1 over the default group; rank 1 loads it."""
    import torch

    from hotspare.transfer import broadcast_state
    if rank == 0:
        broadcast_state([t.detach() for _, t in reg.snapshot().tensors], src=0, group=None, is_source=True,
                        receivers=[1])
        return
    dsts, needs = reg.prepare_receive(manifest)
    broadcast_state(dsts, src=0, group=None, is_source=False, receivers=[1])
    with torch.no_grad():
        reg.finish_receive(manifest, dsts, needs)
