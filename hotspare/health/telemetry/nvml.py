"""NVML telemetry for NVIDIA GPUs, through ``nvidia-ml-py`` (import name ``pynvml``).

Per GPU, each poll reads every metric of ``hotspare.health.types`` that NVML offers (calls from
section 1.4 of ``shared/reference/health-signals.md``)::

    temp_c                  nvmlDeviceGetTemperature(h, NVML_TEMPERATURE_GPU)
    mem_temp_c              field NVML_FI_DEV_MEMORY_TEMP (82)
    thermal_margin_c        nvmlDeviceGetMarginTemperature(h)
    clock_event_reasons     nvmlDeviceGetCurrentClocksEventReasons(h)   (bitmask; before r535:
                            ...ClocksThrottleReasons, the same bits)
    power_w                 nvmlDeviceGetPowerUsage(h) / 1000
    ecc_{sbe,dbe}_volatile  nvmlDeviceGetTotalEccErrors(h, CORRECTED|UNCORRECTED, VOLATILE)
    remap_{pending,failed}  nvmlDeviceGetRemappedRows(h)[2], [3]
    pcie_gen[_max], pcie_width[_max], pcie_replay
                            nvmlDeviceGet{Curr,Max}PcieLink{Generation,Width}, ...PcieReplayCounter
    nvlink_crc_errors       fields NVML_FI_DEV_NVLINK_CRC_{FLIT,DATA}_ERROR_COUNT_TOTAL (38 + 45)
    nvlink_{replay,recovery}_errors   fields ..._{REPLAY,RECOVERY}_ERROR_COUNT_TOTAL (52, 59)
    recovery_action         field NVML_FI_DEV_GET_GPU_RECOVERY_ACTION (230), as a name
    xids                    Xid events from an NVML event set, drained without blocking

A call that answers NOT_SUPPORTED (or a function the installed driver lacks) leaves its metric
out. Any other error is recorded in the reading as ``device_error``; a lost GPU stops the
queries of that device for this poll. Nothing here raises out of ``status()`` or ``poll()``.

Device names are ``"<node>/gpu<i>"`` with ``i`` the NVML index, which follows PCI bus order; set
``CUDA_DEVICE_ORDER=PCI_BUS_ID`` so CUDA numbers the GPUs the same way.

The code that turns NVML answers into metrics (:func:`read_device`, :func:`field_value`,
:func:`drain_xids`) takes the NVML function table as an argument, so tests can drive it with a
small table that stands in for the driver.
"""
from __future__ import annotations

import ctypes
import logging
import threading
import time
from typing import Any

from hotspare.health import types as T
from hotspare.health.telemetry.base import DEVICE_ERROR, TelemetrySource, default_node
from hotspare.health.types import Reading

log = logging.getLogger("hotspare.health")

RECOVERY_ACTIONS = {0: "none", 1: "gpu_reset", 2: "node_reboot", 3: "drain_p2p", 4: "drain_and_reset",
                    5: "recover_imex_domain", 6: "bus_reset", 7: "system_reboot"}
MAX_EVENTS_PER_POLL = 1000   # a storm of events must not keep one poll busy forever

# metric -> the field ids summed into it (field ids from nvml.h; names in pynvml)
_FIELDS = {
    T.MEM_TEMP_C: ("NVML_FI_DEV_MEMORY_TEMP",),
    T.NVLINK_CRC_ERRORS: ("NVML_FI_DEV_NVLINK_CRC_FLIT_ERROR_COUNT_TOTAL",
                          "NVML_FI_DEV_NVLINK_CRC_DATA_ERROR_COUNT_TOTAL"),
    T.NVLINK_REPLAY_ERRORS: ("NVML_FI_DEV_NVLINK_REPLAY_ERROR_COUNT_TOTAL",),
    T.NVLINK_RECOVERY_ERRORS: ("NVML_FI_DEV_NVLINK_RECOVERY_ERROR_COUNT_TOTAL",),
    T.RECOVERY_ACTION: ("NVML_FI_DEV_GET_GPU_RECOVERY_ACTION",),
}


def _pynvml():
    import pynvml  # noqa: PLC0415 - optional dependency, imported when first used
    return pynvml


class _Skip(Exception):
    """The metric is not offered by this GPU or driver: leave it out."""


class _Lost(Exception):
    """The GPU is gone: stop querying it for this poll."""


def _guard(nv, errors: list[str], what: str, fn, *args):
    """Call ``fn``; NOT_SUPPORTED and missing functions become ``_Skip``, others are recorded."""
    try:
        return fn(*args)
    except nv.NVMLError as e:
        code = getattr(e, "value", None)
        if code in (nv.NVML_ERROR_NOT_SUPPORTED, nv.NVML_ERROR_FUNCTION_NOT_FOUND):
            raise _Skip from None
        errors.append(f"{what}: {e}")
        if code == nv.NVML_ERROR_GPU_IS_LOST:
            raise _Lost from None
        raise _Skip from None
    except Exception as e:  # a binding bug or ctypes trouble: record it, keep polling
        errors.append(f"{what}: {type(e).__name__}: {e}")
        raise _Skip from None


def field_value(nv, fv) -> int | float:
    """The number in one ``c_nvmlFieldValue_t``, per its ``valueType``."""
    vt = fv.valueType
    v = fv.value
    if vt == nv.NVML_VALUE_TYPE_DOUBLE:
        return float(v.dVal)
    return int({nv.NVML_VALUE_TYPE_UNSIGNED_INT: v.uiVal, nv.NVML_VALUE_TYPE_UNSIGNED_LONG: v.ulVal,
                nv.NVML_VALUE_TYPE_UNSIGNED_LONG_LONG: v.ullVal, nv.NVML_VALUE_TYPE_SIGNED_LONG_LONG: v.sllVal,
                nv.NVML_VALUE_TYPE_SIGNED_INT: v.siVal, nv.NVML_VALUE_TYPE_UNSIGNED_SHORT: v.usVal}
               .get(vt, v.ullVal))


def _read_fields(lib, nv, h, errors: list[str], metrics: dict) -> None:
    wanted = [(metric, getattr(nv, name)) for metric, names in _FIELDS.items() for name in names
              if hasattr(nv, name)]
    values = _guard(nv, errors, "nvmlDeviceGetFieldValues", lib.nvmlDeviceGetFieldValues, h,
                    [fid for _m, fid in wanted])
    sums: dict[str, int | float] = {}
    for (metric, fid), fv in zip(wanted, values):
        if fv.nvmlReturn == nv.NVML_SUCCESS:
            sums[metric] = sums.get(metric, 0) + field_value(nv, fv)
        elif fv.nvmlReturn not in (nv.NVML_ERROR_NOT_SUPPORTED, nv.NVML_ERROR_FUNCTION_NOT_FOUND):
            errors.append(f"field {fid}: {nv.NVMLError(fv.nvmlReturn)}")
    if T.RECOVERY_ACTION in sums:
        code = int(sums[T.RECOVERY_ACTION])
        sums[T.RECOVERY_ACTION] = RECOVERY_ACTIONS.get(code, f"unknown_{code}")
    metrics.update(sums)


def read_device(lib, nv, h) -> tuple[dict[str, Any], list[str]]:
    """Every metric NVML offers for one GPU handle: ``(metrics, errors)``.

    ``lib`` is the NVML function table (the ``pynvml`` module, or a stand-in for the driver in
    tests); ``nv`` supplies constants and ``NVMLError`` (always the real ``pynvml``).
    """
    metrics: dict[str, Any] = {}
    errors: list[str] = []

    def read(metric, what, fn, *args, convert=lambda x: x):
        try:
            metrics[metric] = convert(_guard(nv, errors, what, fn, *args))
        except _Skip:
            pass

    steps = [
        lambda: read(T.TEMP_C, "temperature", lib.nvmlDeviceGetTemperature, h, nv.NVML_TEMPERATURE_GPU,
                     convert=float),
        lambda: read(T.THERMAL_MARGIN_C, "margin temperature", lib.nvmlDeviceGetMarginTemperature, h,
                     convert=float),
        lambda: _clock_event_reasons(lib, nv, h, errors, metrics),
        lambda: read(T.POWER_W, "power", lib.nvmlDeviceGetPowerUsage, h, convert=lambda mw: mw / 1000.0),
        lambda: read(T.ECC_SBE_VOLATILE, "ecc corrected", lib.nvmlDeviceGetTotalEccErrors, h,
                     nv.NVML_MEMORY_ERROR_TYPE_CORRECTED, nv.NVML_VOLATILE_ECC, convert=int),
        lambda: read(T.ECC_DBE_VOLATILE, "ecc uncorrected", lib.nvmlDeviceGetTotalEccErrors, h,
                     nv.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, nv.NVML_VOLATILE_ECC, convert=int),
        lambda: _remapped_rows(lib, nv, h, errors, metrics),
        lambda: read(T.PCIE_GEN, "pcie gen", lib.nvmlDeviceGetCurrPcieLinkGeneration, h, convert=int),
        lambda: read(T.PCIE_GEN_MAX, "pcie gen max", lib.nvmlDeviceGetMaxPcieLinkGeneration, h, convert=int),
        lambda: read(T.PCIE_WIDTH, "pcie width", lib.nvmlDeviceGetCurrPcieLinkWidth, h, convert=int),
        lambda: read(T.PCIE_WIDTH_MAX, "pcie width max", lib.nvmlDeviceGetMaxPcieLinkWidth, h, convert=int),
        lambda: read(T.PCIE_REPLAY, "pcie replay", lib.nvmlDeviceGetPcieReplayCounter, h, convert=int),
        lambda: _try(_read_fields, lib, nv, h, errors, metrics),
    ]
    for step in steps:
        try:
            step()
        except _Lost:
            break
    return metrics, errors


def _try(fn, *args):
    try:
        fn(*args)
    except _Skip:
        pass


def _clock_event_reasons(lib, nv, h, errors, metrics):
    """The clock-event (formerly "throttle") reasons bitmask. Drivers before r535 lack
    ``nvmlDeviceGetCurrentClocksEventReasons``; they answer the same bitmask under its old name."""
    for name in ("nvmlDeviceGetCurrentClocksEventReasons", "nvmlDeviceGetCurrentClocksThrottleReasons"):
        fn = getattr(lib, name, None)
        if fn is None:
            continue
        recorded = len(errors)
        try:
            metrics[T.CLOCK_EVENT_REASONS] = int(_guard(nv, errors, "clock event reasons", fn, h))
            return
        except _Skip:
            if len(errors) > recorded:
                return           # a real error, recorded: the old name would not do better


def _remapped_rows(lib, nv, h, errors, metrics):
    try:
        _corr, _unc, pending, failed = _guard(nv, errors, "remapped rows", lib.nvmlDeviceGetRemappedRows, h)
    except _Skip:
        return
    metrics[T.REMAP_PENDING] = bool(pending)
    metrics[T.REMAP_FAILED] = bool(failed)


def _handle_key(h) -> int | None:
    try:
        return ctypes.cast(h, ctypes.c_void_p).value
    except (TypeError, ctypes.ArgumentError):
        return None


def drain_xids(lib, nv, event_set, index_of: dict, errors: list[str]) -> dict[int, list[int]]:
    """Xid codes waiting in ``event_set``, per device index; returns at once (timeout 0 ms)."""
    out: dict[int, list[int]] = {}
    for _ in range(MAX_EVENTS_PER_POLL):
        try:
            data = lib.nvmlEventSetWait_v2(event_set, 0)
        except nv.NVMLError as e:
            if getattr(e, "value", None) != nv.NVML_ERROR_TIMEOUT:   # TIMEOUT: nothing waiting
                errors.append(f"event wait: {e}")
            break
        except Exception as e:
            errors.append(f"event wait: {type(e).__name__}: {e}")
            break
        if data.eventType & nv.nvmlEventTypeXidCriticalError:
            idx = index_of.get(_handle_key(data.device))
            if idx is None:
                errors.append(f"Xid {data.eventData} from a GPU this source does not know")
                continue
            out.setdefault(idx, []).append(int(data.eventData))
    return out


class NvmlSource(TelemetrySource):
    """NVML telemetry for the GPUs of this node. Never raises out of ``status``/``poll``.

    ``lib`` replaces the NVML function table (default: the ``pynvml`` module); tests use it to
    stand in for the driver. On a machine without the driver ``status()`` answers
    ``(False, "NVML not available: ...")`` and ``poll()`` returns ``[]``.
    """

    name = "nvml"

    def __init__(self, node: str | None = None, *, lib=None):
        self.node = node or default_node()
        self._lock = threading.Lock()
        self._handles: list = []
        self._index_of: dict = {}
        self._events = None
        self._xid_devices: set[int] = set()
        self._detail = ""
        self._ok = False
        self._closed = False
        try:
            self._nv = _pynvml()
        except ImportError as e:
            self._nv = None
            self._detail = f"NVML not available: the nvidia-ml-py package is not installed ({e}); pip install nvidia-ml-py"
            return
        self._lib = lib if lib is not None else self._nv
        self._open()

    def _open(self) -> None:
        lib, nv = self._lib, self._nv
        try:
            lib.nvmlInit()
        except Exception as e:
            why = str(e)
            if isinstance(e, nv.NVMLError) and e.value == nv.NVML_ERROR_LIBRARY_NOT_FOUND:
                why += " (libnvidia-ml.so.1 is missing: no NVIDIA driver on this machine)"
            elif isinstance(e, nv.NVMLError) and e.value == nv.NVML_ERROR_DRIVER_NOT_LOADED:
                why += " (the NVIDIA kernel module is not loaded)"
            self._detail = f"NVML not available: {why}"
            return
        try:
            driver = lib.nvmlSystemGetDriverVersion()
            driver = driver.decode() if isinstance(driver, bytes) else str(driver)
            count = lib.nvmlDeviceGetCount()
            self._handles = [lib.nvmlDeviceGetHandleByIndex(i) for i in range(count)]
        except Exception as e:
            self._detail = f"NVML not available: initialised, but listing GPUs failed: {e}"
            self._shutdown()
            return
        if not self._handles:
            self._detail = f"NVML not available: driver {driver} loaded, but it sees no GPU"
            self._shutdown()
            return
        self._index_of = {_handle_key(h): i for i, h in enumerate(self._handles)}
        self._ok = True
        self._detail = f"NVML driver {driver}, {len(self._handles)} GPU(s)"
        self._open_events()

    def _open_events(self) -> None:
        lib, nv = self._lib, self._nv
        try:
            self._events = lib.nvmlEventSetCreate()
        except Exception as e:
            self._detail += f"; Xid events unavailable ({e})"
            return
        for i, h in enumerate(self._handles):
            try:
                mask = nv.nvmlEventTypeXidCriticalError & lib.nvmlDeviceGetSupportedEventTypes(h)
                if mask:
                    lib.nvmlDeviceRegisterEvents(h, mask, self._events)
                    self._xid_devices.add(i)
            except Exception as e:
                log.info("nvml: gpu%d: Xid events unavailable: %s", i, e)
        if len(self._xid_devices) < len(self._handles):
            missing = sorted(set(range(len(self._handles))) - self._xid_devices)
            self._detail += f"; no Xid events from gpu{', gpu'.join(map(str, missing))}"

    def status(self) -> tuple[bool, str]:
        return self._ok and not self._closed, ("closed" if self._closed else self._detail)

    def devices(self) -> list[str]:
        return [f"{self.node}/gpu{i}" for i in range(len(self._handles))] if self._ok else []

    def poll(self) -> list[Reading]:
        if not self._ok or self._closed:
            return []
        with self._lock:
            now = time.time()
            errors: list[str] = []
            xids = drain_xids(self._lib, self._nv, self._events, self._index_of, errors) if self._events else {}
            if errors:
                log.warning("nvml: %s", "; ".join(errors))
            readings = []
            for i, h in enumerate(self._handles):
                try:
                    metrics, errs = read_device(self._lib, self._nv, h)
                except Exception as e:   # read_device guards each call; this is a last resort
                    metrics, errs = {}, [f"{type(e).__name__}: {e}"]
                if i in self._xid_devices:
                    metrics[T.XIDS] = tuple(xids.get(i, ()))
                if errs:
                    metrics[DEVICE_ERROR] = "; ".join(errs)
                readings.append(Reading(device=f"{self.node}/gpu{i}", time=now, source=self.name,
                                        metrics=metrics))
            return readings

    def _shutdown(self) -> None:
        try:
            self._lib.nvmlShutdown()
        except Exception:
            pass

    def close(self) -> None:
        if self._closed or not self._ok:
            return
        self._closed = True
        with self._lock:
            if self._events is not None:
                try:
                    self._lib.nvmlEventSetFree(self._events)
                except Exception:
                    pass
            self._shutdown()
