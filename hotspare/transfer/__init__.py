"""Move training state between workers: bucketed, streamed, verified."""
from hotspare.transfer.broadcast import TransferStats, broadcast_state, plan_buckets

__all__ = ["TransferStats", "broadcast_state", "plan_buckets"]
