"""Shared vocabulary of the health service. Imports nothing from torch or the network.

A *device* is named ``"<node>/<kind><index>"``, e.g. ``"gpu-node-07/gpu3"`` or ``"myhost/cpu1"``;
the part before the slash is the node name Slurm knows.

A ``Reading`` is one poll of one device by one telemetry source (or one report of the runtime's
in-process signals). Metric names are fixed below so that sources, rules and dashboards agree;
a source leaves out what it cannot read. Counters are cumulative as the driver reports them;
rules take deltas.
"""
from __future__ import annotations

import dataclasses
import re
from typing import Mapping, Union

MetricValue = Union[int, float, bool, str, tuple]

# --- device metrics (NVML names them; the simulated source mimics them) ------------------------
TEMP_C = "temp_c"                          # GPU core temperature, deg C
MEM_TEMP_C = "mem_temp_c"                  # HBM temperature, deg C
THERMAL_MARGIN_C = "thermal_margin_c"      # degrees left before slowdown (nvmlDeviceGetMarginTemperature)
CLOCK_EVENT_REASONS = "clock_event_reasons"  # bitmask (nvmlDeviceGetCurrentClocksEventReasons)
POWER_W = "power_w"
ECC_SBE_VOLATILE = "ecc_sbe_volatile"      # counter: corrected (single-bit) ECC errors
ECC_DBE_VOLATILE = "ecc_dbe_volatile"      # counter: uncorrected (double-bit) ECC errors
REMAP_PENDING = "remap_pending"            # bool: row remap pending (needs a reset)
REMAP_FAILED = "remap_failed"              # bool: row remap failed
PCIE_GEN = "pcie_gen"
PCIE_GEN_MAX = "pcie_gen_max"
PCIE_WIDTH = "pcie_width"
PCIE_WIDTH_MAX = "pcie_width_max"
PCIE_REPLAY = "pcie_replay"                # counter
NVLINK_CRC_ERRORS = "nvlink_crc_errors"    # counter (flit + data)
NVLINK_REPLAY_ERRORS = "nvlink_replay_errors"      # counter
NVLINK_RECOVERY_ERRORS = "nvlink_recovery_errors"  # counter
XIDS = "xids"                              # tuple of Xid codes seen since the previous reading
RECOVERY_ACTION = "recovery_action"        # str: none|gpu_reset|node_reboot|drain_p2p|drain_and_reset

# --- in-process signals from the training runtime -----------------------------------------------
STEP_COMPUTE_S = "step_compute_s"          # forward+backward time of the last step on this rank
STEP_COMM_S = "step_comm_s"                # time waiting on the gradient exchange
STRAGGLER_SCORE = "straggler_score"        # peers' median compute time / this rank's (1.0 = typical, <1 slower)
NONFINITE = "nonfinite"                    # bool: NaN/Inf in this rank's gradients this step
FINGERPRINT_MISMATCH = "fingerprint_mismatch"  # bool: this rank lost the cross-replica parameter vote
# Added by the telemetry layer (telemetry/poller.py, telemetry/nvml.py); human-readable strings,
# present only when something is wrong.
MONITOR_UNRESPONSIVE = "monitor_unresponsive"  # str: why the source is considered wedged (row 30)
MONITOR_STALLED_PERIODS = "monitor_stalled_periods"  # number: how long the poll in progress has hung, in periods
DEVICE_ERROR = "device_error"                  # str: the error the device answered with, e.g. "GPU is lost"

# What a node's telemetry may report (a remote agent's readings, hotspare.agent.telemetry): the
# device metrics and the telemetry layer's own, never the runtime's signals (those come from the
# workers themselves, through the coordinator).
TELEMETRY_METRICS = frozenset({
    TEMP_C, MEM_TEMP_C, THERMAL_MARGIN_C, CLOCK_EVENT_REASONS, POWER_W, ECC_SBE_VOLATILE, ECC_DBE_VOLATILE,
    REMAP_PENDING, REMAP_FAILED, PCIE_GEN, PCIE_GEN_MAX, PCIE_WIDTH, PCIE_WIDTH_MAX, PCIE_REPLAY,
    NVLINK_CRC_ERRORS, NVLINK_REPLAY_ERRORS, NVLINK_RECOVERY_ERRORS, XIDS, RECOVERY_ACTION,
    MONITOR_UNRESPONSIVE, MONITOR_STALLED_PERIODS, DEVICE_ERROR})

# --- actions, mildest first ----------------------------------------------------------------------
IGNORE = "ignore"
WATCH = "watch"            # record, trend, alert a human
MIGRATE = "migrate"        # preemptive live migration at the next step boundary; memory still good
FAILOVER = "failover"      # the rank's state on this device is lost or untrusted: replace from a replica
QUARANTINE = "quarantine"  # cordon + quarantine diagnostics; back to the pool on pass
RETIRE = "retire"          # out of service for good (RMA)
ACTIONS = (IGNORE, WATCH, MIGRATE, FAILOVER, QUARANTINE, RETIRE)
SEVERITY = {a: i for i, a in enumerate(ACTIONS)}


@dataclasses.dataclass(frozen=True)
class Reading:
    device: str
    time: float                      # time.time() of the poll
    source: str                      # "nvml", "simulated", "runtime"
    metrics: Mapping[str, MetricValue]
    rank: int | None = None          # the training rank on this device when known


@dataclasses.dataclass(frozen=True)
class Verdict:
    device: str
    action: str                      # one of ACTIONS
    rule: str                        # the rule's name
    reason: str                      # human-readable, shown in logs, reports and `hotspare health`
    trust_memory: bool = True        # False: the state on this device must come from a replica
    rank: int | None = None


_NAME = re.compile(r"^(?P<node>[^/]+)/(?P<kind>cpu|gpu)(?P<index>\d+)$")


def split_device(device: str) -> tuple[str, str, int]:
    """``"node/gpu3" -> ("node", "gpu", 3)``; ValueError for a name of another shape."""
    m = _NAME.match(device)
    if not m:
        raise ValueError(f"device name {device!r} must look like 'NODE/KINDINDEX', e.g. 'host1/gpu0'")
    return m["node"], m["kind"], int(m["index"])


def node_of(device: str) -> str:
    """``"node/gpu3" -> "node"``."""
    if "/" not in device:
        raise ValueError(f"device name {device!r} must look like 'NODE/KINDINDEX', e.g. 'host1/gpu0'")
    return device.split("/", 1)[0]
