"""Move training state between workers: bucketed, streamed, verified; and snapshot device state."""
from hotspare.transfer.broadcast import TransferStats, broadcast_state, checksum, plan_buckets, wire_device
from hotspare.transfer.snapshot import DeviceSnapshot, SnapshotStats, digest_of

__all__ = ["DeviceSnapshot", "SnapshotStats", "TransferStats", "broadcast_state", "checksum",
           "digest_of", "plan_buckets", "wire_device"]
