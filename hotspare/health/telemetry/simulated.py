"""Simulated device telemetry for CPU machines and tests — named as such in every reading.

``SimulatedSource(n)`` presents devices ``"<node>/cpu0" .. "<node>/cpu{n-1}"`` whose readings look
like a healthy GPU's (55 C, 30 C of thermal margin, zero ECC counters, PCIe gen 5 x16, ...) until
the fault injector changes them with :meth:`SimulatedSource.apply`. The source object lives in the
process that owns it (the launcher); the injector, in that same process, calls ``apply`` directly.
All methods are thread-safe: the poller thread reads while the injector writes.

Readings carry ``source="simulated"`` so nothing downstream mistakes them for hardware.
"""
from __future__ import annotations

import inspect
import threading
import time
from typing import Any

from hotspare.errors import ConfigError
from hotspare.health import types as T
from hotspare.health.telemetry.base import TelemetrySource, default_node
from hotspare.health.types import Reading

SLOWDOWN_C = 85.0            # simulated slowdown temperature: margin = SLOWDOWN_C - temp
MEM_OFFSET_C = 5.0           # HBM runs this much warmer than the core
HW_THERMAL_SLOWDOWN = 0x40   # nvmlClocksEventReasonHwThermalSlowdown
SW_THERMAL_SLOWDOWN = 0x20   # nvmlClocksEventReasonSwThermalSlowdown
SW_THERMAL_MARGIN_C = 5.0    # the driver's software slowdown starts this close to the limit

NOMINAL: dict[str, Any] = {
    T.TEMP_C: 55.0, T.MEM_TEMP_C: 55.0 + MEM_OFFSET_C, T.THERMAL_MARGIN_C: SLOWDOWN_C - 55.0,
    T.CLOCK_EVENT_REASONS: 0, T.POWER_W: 350.0,
    T.ECC_SBE_VOLATILE: 0, T.ECC_DBE_VOLATILE: 0, T.REMAP_PENDING: False, T.REMAP_FAILED: False,
    T.PCIE_GEN: 5, T.PCIE_GEN_MAX: 5, T.PCIE_WIDTH: 16, T.PCIE_WIDTH_MAX: 16, T.PCIE_REPLAY: 0,
    T.NVLINK_CRC_ERRORS: 0, T.NVLINK_REPLAY_ERRORS: 0, T.NVLINK_RECOVERY_ERRORS: 0,
    T.RECOVERY_ACTION: "none",
}
RECOVERY_ACTIONS = ("none", "gpu_reset", "node_reboot", "drain_p2p", "drain_and_reset")

FAULTS = {
    "thermal": "temp=C  core temperature C (HBM follows at C+5); margin becomes 85-C; at 80 C the "
               "SW thermal bit 0x20 and at 85 C the HW thermal slowdown bit 0x40 are set",
    "ecc": "kind=correctable|uncorrectable [count=N]  add N (default 1) to the volatile SBE or DBE counter",
    "xid": "code=N  one Xid event, reported once in the next reading's xids",
    "pcie": "[gen=G] [width=W] [replay=N]  link trained below its maximum (default gen 4 x8 of "
            "gen 5 x16); replay adds N to the replay counter",
    "nvlink": "[crc=N] [replay=N] [recovery=N]  add to the NVLink error counters",
    "remap": "[pending=0|1] [failed=0|1]  row-remapper state (default pending=1)",
    "recovery": f"action={'|'.join(RECOVERY_ACTIONS)}  the driver's recovery action",
    "clear": "back to nominal readings, volatile counters zeroed and queued Xids dropped, as after a GPU reset",
}


def _num(fault: str, key: str, value, kind=float, lo=None, hi=None):
    try:
        v = kind(value)
    except (TypeError, ValueError):
        raise ConfigError(f"{fault}: {key}={value!r} is not a number; e.g. {key}=3") from None
    if (lo is not None and v < lo) or (hi is not None and v > hi):
        rng = f"{lo if lo is not None else '-inf'}..{hi if hi is not None else 'inf'}"
        raise ConfigError(f"{fault}: {key}={value!r} is out of range {rng}")
    return v


def _flag(fault: str, key: str, value) -> bool:
    s = str(value).strip().lower()
    if s in ("1", "true", "yes"):
        return True
    if s in ("0", "false", "no"):
        return False
    raise ConfigError(f"{fault}: {key}={value!r} must be 0 or 1")


class SimulatedSource(TelemetrySource):
    """``n`` simulated devices ``"<node>/cpu<i>"`` whose readings the fault injector drives."""

    name = "simulated"

    def __init__(self, n: int = 2, node: str | None = None):
        if not isinstance(n, int) or n < 1:
            raise ConfigError(f"SimulatedSource needs n >= 1 devices, got {n!r}")
        self.node = node or default_node()
        if "/" in self.node:
            raise ConfigError(f"node name {self.node!r} must not contain '/'")
        self._names = [f"{self.node}/cpu{i}" for i in range(n)]
        self._lock = threading.Lock()
        self._metrics = {d: dict(NOMINAL) for d in self._names}
        self._xids: dict[str, list[int]] = {d: [] for d in self._names}
        self._ranks: dict[str, int | None] = {d: None for d in self._names}
        self._stall_s = 0.0
        self.fallback_reason: str | None = None   # set by auto_source: why NVML was not used

    # --- TelemetrySource ------------------------------------------------------------------------
    def status(self) -> tuple[bool, str]:
        why = f" (no GPU telemetry: {self.fallback_reason})" if self.fallback_reason else ""
        return True, f"simulated: {len(self._names)} device(s) on {self.node}, driven by fault injection{why}"

    def devices(self) -> list[str]:
        return list(self._names)

    def poll(self) -> list[Reading]:
        with self._lock:
            stall, self._stall_s = self._stall_s, 0.0
        if stall:
            time.sleep(stall)         # a wedged driver call, for the poller's unresponsive path
        now = time.time()
        with self._lock:
            out = []
            for d in self._names:
                m = dict(self._metrics[d])
                m[T.XIDS] = tuple(self._xids[d])
                self._xids[d].clear()
                out.append(Reading(device=d, time=now, source=self.name, metrics=m, rank=self._ranks[d]))
            return out

    # --- driving it -----------------------------------------------------------------------------
    def device(self, device: str | int) -> str:
        """The full name of ``device``, given as a full name, ``"cpu1"``, or an index."""
        if isinstance(device, int) and not isinstance(device, bool):
            if 0 <= device < len(self._names):
                return self._names[device]
        elif isinstance(device, str):
            full = device if "/" in device else f"{self.node}/{device}"
            if full in self._metrics:
                return full
        raise ConfigError(f"unknown simulated device {device!r}; this source has {', '.join(self._names)}")

    def assign(self, device: str | int, rank: int | None) -> None:
        """Record which training rank runs on ``device``; its readings then carry that rank."""
        with self._lock:
            self._ranks[self.device(device)] = rank

    def stall(self, seconds: float) -> None:
        """Make the next ``poll()`` block for ``seconds``, as a wedged driver call would."""
        s = _num("stall", "seconds", seconds, float, 0.0)
        with self._lock:
            self._stall_s = s

    def apply(self, device: str | int, fault: str, **params) -> dict[str, Any]:
        """Change ``device``'s readings as ``fault`` says; returns the metrics it now reports.

        Faults and their parameters are listed in ``FAULTS``; a bad name or value raises
        ``ConfigError`` saying what to fix.
        """
        dev = self.device(device)
        if fault not in FAULTS:
            raise ConfigError(f"unknown simulated fault {fault!r}; choose one of {', '.join(FAULTS)}")
        handler = getattr(self, f"_apply_{fault}")
        allowed = set(inspect.signature(handler).parameters) - {"dev"}
        extra = set(params) - allowed
        if extra:
            raise ConfigError(f"{fault}: unknown parameter(s) {', '.join(sorted(extra))}; "
                              f"{fault} takes {FAULTS[fault]}")
        with self._lock:
            handler(dev, **params)
            return dict(self._metrics[dev])

    def clear(self, device: str | int) -> None:
        self.apply(device, "clear")

    # Each handler runs under the lock; its keyword names are the fault's parameters.
    def _apply_thermal(self, dev, temp=None):
        if temp is None:
            raise ConfigError(f"thermal needs temp=C, e.g. thermal:temp=92 ({FAULTS['thermal']})")
        t = _num("thermal", "temp", temp, float, -40.0, 150.0)
        m = self._metrics[dev]
        m[T.TEMP_C] = t
        m[T.MEM_TEMP_C] = t + MEM_OFFSET_C
        m[T.THERMAL_MARGIN_C] = SLOWDOWN_C - t
        bits = m[T.CLOCK_EVENT_REASONS] & ~(HW_THERMAL_SLOWDOWN | SW_THERMAL_SLOWDOWN)
        if t >= SLOWDOWN_C - SW_THERMAL_MARGIN_C:
            bits |= SW_THERMAL_SLOWDOWN
        if t >= SLOWDOWN_C:
            bits |= HW_THERMAL_SLOWDOWN
        m[T.CLOCK_EVENT_REASONS] = bits

    def _apply_ecc(self, dev, kind=None, count=1):
        key = {"correctable": T.ECC_SBE_VOLATILE, "uncorrectable": T.ECC_DBE_VOLATILE}.get(kind)
        if key is None:
            raise ConfigError(f"ecc needs kind=correctable or kind=uncorrectable, got kind={kind!r}")
        self._metrics[dev][key] += _num("ecc", "count", count, int, 1)

    def _apply_xid(self, dev, code=None):
        if code is None:
            raise ConfigError("xid needs code=N, e.g. xid:code=79")
        self._xids[dev].append(_num("xid", "code", code, int, 1, 1 << 16))

    def _apply_pcie(self, dev, gen=None, width=None, replay=0):
        m = self._metrics[dev]
        if gen is None and width is None and not replay:
            gen, width = m[T.PCIE_GEN_MAX] - 1, m[T.PCIE_WIDTH_MAX] // 2
        if gen is not None:
            m[T.PCIE_GEN] = _num("pcie", "gen", gen, int, 1, m[T.PCIE_GEN_MAX])
        if width is not None:
            w = _num("pcie", "width", width, int, 1, m[T.PCIE_WIDTH_MAX])
            if w not in (1, 2, 4, 8, 16, 32):
                raise ConfigError(f"pcie: width={width!r} is not a PCIe link width (1, 2, 4, 8 or 16)")
            m[T.PCIE_WIDTH] = w
        m[T.PCIE_REPLAY] += _num("pcie", "replay", replay, int, 0)

    def _apply_nvlink(self, dev, crc=0, replay=0, recovery=0):
        m = self._metrics[dev]
        m[T.NVLINK_CRC_ERRORS] += _num("nvlink", "crc", crc, int, 0)
        m[T.NVLINK_REPLAY_ERRORS] += _num("nvlink", "replay", replay, int, 0)
        m[T.NVLINK_RECOVERY_ERRORS] += _num("nvlink", "recovery", recovery, int, 0)

    def _apply_remap(self, dev, pending=1, failed=0):
        self._metrics[dev][T.REMAP_PENDING] = _flag("remap", "pending", pending)
        self._metrics[dev][T.REMAP_FAILED] = _flag("remap", "failed", failed)

    def _apply_recovery(self, dev, action=None):
        if action not in RECOVERY_ACTIONS:
            raise ConfigError(f"recovery needs action= one of {', '.join(RECOVERY_ACTIONS)}, got {action!r}")
        self._metrics[dev][T.RECOVERY_ACTION] = action

    def _apply_clear(self, dev):
        self._metrics[dev] = dict(NOMINAL)
        self._xids[dev].clear()
