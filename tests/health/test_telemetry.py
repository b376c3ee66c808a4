"""Telemetry sources and the poller: simulated faults change readings as specified; NVML degrades
for real on this GPU-less machine; its reading conversion is driven by a stand-in driver table;
the poller keeps its period and reports a wedged or raising source as unresponsive."""
import ctypes
import ctypes.util
import sys
import threading
import time

import pynvml
import pytest

from hotspare.errors import ConfigError
from hotspare.health import types as T
from hotspare.health.telemetry import (
    DEVICE_ERROR,
    MONITOR_UNRESPONSIVE,
    NvmlSource,
    Poller,
    SimulatedSource,
    TelemetrySource,
    auto_source,
)


def by_device(readings):
    return {r.device: r.metrics for r in readings}


# --- simulated source ----------------------------------------------------------------------------
def test_simulated_devices_start_nominal():
    src = SimulatedSource(2, node="n1")
    assert src.devices() == ["n1/cpu0", "n1/cpu1"]
    assert src.status()[0] and "simulated" in src.status()[1]
    rs = src.poll()
    assert [r.source for r in rs] == ["simulated", "simulated"]
    m = rs[0].metrics
    assert (m[T.TEMP_C], m[T.THERMAL_MARGIN_C], m[T.CLOCK_EVENT_REASONS]) == (55.0, 30.0, 0)
    assert (m[T.ECC_SBE_VOLATILE], m[T.ECC_DBE_VOLATILE], m[T.XIDS]) == (0, 0, ())
    assert (m[T.PCIE_GEN], m[T.PCIE_WIDTH]) == (m[T.PCIE_GEN_MAX], m[T.PCIE_WIDTH_MAX]) == (5, 16)


def test_thermal_sets_temperature_margin_and_slowdown_bits():
    src = SimulatedSource(2, node="n1")
    src.apply("n1/cpu1", "thermal", temp="92")          # strings, as parsed from an inject spec
    m = by_device(src.poll())
    assert m["n1/cpu1"][T.TEMP_C] == 92.0 and m["n1/cpu1"][T.MEM_TEMP_C] == 97.0
    assert m["n1/cpu1"][T.THERMAL_MARGIN_C] == -7.0
    assert m["n1/cpu1"][T.CLOCK_EVENT_REASONS] & 0x40          # HW thermal slowdown
    assert m["n1/cpu0"][T.TEMP_C] == 55.0                      # the other device is untouched
    src.apply(1, "thermal", temp=70)                           # cooled down: bits cleared
    m = by_device(src.poll())["n1/cpu1"]
    assert (m[T.THERMAL_MARGIN_C], m[T.CLOCK_EVENT_REASONS]) == (15.0, 0)


def test_ecc_increments_the_named_counter():
    src = SimulatedSource(2, node="n1")
    src.apply("cpu0", "ecc", kind="correctable")
    src.apply("cpu0", "ecc", kind="uncorrectable")
    src.apply("cpu0", "ecc", kind="uncorrectable", count="2")
    m = by_device(src.poll())["n1/cpu0"]
    assert (m[T.ECC_SBE_VOLATILE], m[T.ECC_DBE_VOLATILE]) == (1, 3)


def test_xid_is_reported_once_in_the_next_reading():
    src = SimulatedSource(2, node="n1")
    src.apply("n1/cpu1", "xid", code=79)
    src.apply("n1/cpu1", "xid", code="48")
    first, second = by_device(src.poll()), by_device(src.poll())
    assert first["n1/cpu1"][T.XIDS] == (79, 48) and first["n1/cpu0"][T.XIDS] == ()
    assert second["n1/cpu1"][T.XIDS] == ()


def test_pcie_degrades_the_link_and_clear_restores_everything():
    src = SimulatedSource(1, node="n1")
    src.apply(0, "pcie")
    m = src.poll()[0].metrics
    assert (m[T.PCIE_GEN], m[T.PCIE_WIDTH], m[T.PCIE_GEN_MAX], m[T.PCIE_WIDTH_MAX]) == (4, 8, 5, 16)
    src.apply(0, "pcie", width=4, replay=7)
    src.apply(0, "thermal", temp=95)
    src.apply(0, "xid", code=13)
    src.assign(0, rank=3)
    src.clear(0)
    r = src.poll()[0]
    assert r.rank == 3
    assert (r.metrics[T.PCIE_WIDTH], r.metrics[T.PCIE_REPLAY], r.metrics[T.TEMP_C], r.metrics[T.XIDS]) == (16, 0, 55.0, ())


@pytest.mark.parametrize("args,needle", [
    (("n1/cpu9", "thermal"), "unknown simulated device"),
    (("cpu0", "melt"), "unknown simulated fault"),
    (("cpu0", "thermal"), "temp="),
    (("cpu0", "ecc"), "kind=correctable"),
    (("cpu0", "pcie"), None),
])
def test_bad_injections_say_what_to_fix(args, needle):
    src = SimulatedSource(1, node="n1")
    if needle is None:                 # pcie without parameters is valid: the default degradation
        src.apply(*args)
        return
    with pytest.raises(ConfigError, match=needle):
        src.apply(*args)


def test_bad_parameter_values_are_refused():
    src = SimulatedSource(1, node="n1")
    with pytest.raises(ConfigError, match="not a number"):
        src.apply(0, "thermal", temp="hot")
    with pytest.raises(ConfigError, match="unknown parameter"):
        src.apply(0, "thermal", temp=90, rank=1)
    with pytest.raises(ConfigError, match="PCIe link width"):
        src.apply(0, "pcie", width=3)


def test_apply_and_poll_from_many_threads():
    src = SimulatedSource(2, node="n1")
    polled = []

    def inject():
        for _ in range(200):
            src.apply("n1/cpu0", "ecc", kind="correctable")
            src.apply("n1/cpu1", "xid", code=31)

    def poll():
        for _ in range(100):
            polled.append(src.poll())

    threads = [threading.Thread(target=inject) for _ in range(4)] + [threading.Thread(target=poll)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    polled.append(src.poll())
    assert polled[-1][0].metrics[T.ECC_SBE_VOLATILE] == 800
    assert sum(len(rs[1].metrics[T.XIDS]) for rs in polled) == 800     # every Xid exactly once


# --- NVML -----------------------------------------------------------------------------------------
def test_nvml_unavailable_for_real_reports_why_and_polls_nothing():
    has_driver = ctypes.util.find_library("nvidia-ml") is not None
    src = NvmlSource(node="n1")
    ok, detail = src.status()
    if has_driver:
        pytest.skip(f"this machine has an NVIDIA driver ({detail})")
    assert not ok
    assert detail.startswith("NVML not available:") and "libnvidia-ml" in detail
    assert src.poll() == [] and src.devices() == []
    src.close()
    src.close()
    fallback = auto_source(node="n1", simulated_devices=3)
    assert fallback.name == "simulated" and len(fallback.devices()) == 3
    assert "NVML not available" in fallback.status()[1]


def test_nvml_without_the_package_reports_how_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", None)       # `import pynvml` now raises ImportError
    ok, detail = NvmlSource(node="n1").status()
    assert not ok and "pip install nvidia-ml-py" in detail


class FakeNvmlDriver:
    """Stands in for libnvidia-ml behind pynvml's function names: answers with pynvml's own ctypes
    structures and raises pynvml's own NVMLError codes. GPU 0 offers everything; GPU 1 answers
    NOT_SUPPORTED for margin, remapped rows and HBM temperature; GPU 2 is lost."""

    def __init__(self):
        self.events = [(0, 79), (1, 13)]
        self.registered = {}

    def _err(self, code):
        raise pynvml.NVMLError(code)

    def nvmlInit(self): pass
    def nvmlShutdown(self): pass
    def nvmlSystemGetDriverVersion(self): return "580.1"
    def nvmlDeviceGetCount(self): return 3
    def nvmlDeviceGetHandleByIndex(self, i): return ctypes.cast(0x1000 + i, pynvml.c_nvmlDevice_t)

    def _idx(self, h):
        i = ctypes.cast(h, ctypes.c_void_p).value - 0x1000
        if i == 2:
            self._err(pynvml.NVML_ERROR_GPU_IS_LOST)
        return i

    def nvmlDeviceGetTemperature(self, h, sensor):
        assert sensor == pynvml.NVML_TEMPERATURE_GPU
        return 60 + self._idx(h)

    def nvmlDeviceGetMarginTemperature(self, h):
        return 25 if self._idx(h) == 0 else self._err(pynvml.NVML_ERROR_NOT_SUPPORTED)

    def nvmlDeviceGetCurrentClocksEventReasons(self, h): self._idx(h); return 0x40
    def nvmlDeviceGetPowerUsage(self, h): self._idx(h); return 412_500
    def nvmlDeviceGetTotalEccErrors(self, h, kind, counter):
        assert counter == pynvml.NVML_VOLATILE_ECC
        self._idx(h)
        return 5 if kind == pynvml.NVML_MEMORY_ERROR_TYPE_CORRECTED else 1

    def nvmlDeviceGetRemappedRows(self, h):
        return (0, 0, 1, 0) if self._idx(h) == 0 else self._err(pynvml.NVML_ERROR_NOT_SUPPORTED)

    def nvmlDeviceGetCurrPcieLinkGeneration(self, h): self._idx(h); return 4
    def nvmlDeviceGetMaxPcieLinkGeneration(self, h): self._idx(h); return 5
    def nvmlDeviceGetCurrPcieLinkWidth(self, h): self._idx(h); return 16
    def nvmlDeviceGetMaxPcieLinkWidth(self, h): self._idx(h); return 16
    def nvmlDeviceGetPcieReplayCounter(self, h): self._idx(h); return 3

    def nvmlDeviceGetFieldValues(self, h, ids):
        i = self._idx(h)
        values = (pynvml.c_nvmlFieldValue_t * len(ids))()
        answers = {
            pynvml.NVML_FI_DEV_MEMORY_TEMP: (pynvml.NVML_VALUE_TYPE_UNSIGNED_INT, "uiVal", 71),
            pynvml.NVML_FI_DEV_NVLINK_CRC_FLIT_ERROR_COUNT_TOTAL: (pynvml.NVML_VALUE_TYPE_UNSIGNED_LONG_LONG, "ullVal", 10),
            pynvml.NVML_FI_DEV_NVLINK_CRC_DATA_ERROR_COUNT_TOTAL: (pynvml.NVML_VALUE_TYPE_UNSIGNED_LONG_LONG, "ullVal", 2),
            pynvml.NVML_FI_DEV_NVLINK_REPLAY_ERROR_COUNT_TOTAL: (pynvml.NVML_VALUE_TYPE_UNSIGNED_LONG_LONG, "ullVal", 4),
            pynvml.NVML_FI_DEV_NVLINK_RECOVERY_ERROR_COUNT_TOTAL: (pynvml.NVML_VALUE_TYPE_DOUBLE, "dVal", 1.0),
            pynvml.NVML_FI_DEV_GET_GPU_RECOVERY_ACTION: (pynvml.NVML_VALUE_TYPE_UNSIGNED_INT, "uiVal", 4),
        }
        for v, fid in zip(values, ids):
            v.fieldId = fid
            if i == 1 and fid == pynvml.NVML_FI_DEV_MEMORY_TEMP:
                v.nvmlReturn = pynvml.NVML_ERROR_NOT_SUPPORTED
                continue
            vt, member, val = answers[fid]
            v.valueType, v.nvmlReturn = vt, pynvml.NVML_SUCCESS
            setattr(v.value, member, val)
        return values

    def nvmlEventSetCreate(self): return "event-set"
    def nvmlEventSetFree(self, es): pass
    def nvmlDeviceGetSupportedEventTypes(self, h): self._idx(h); return pynvml.nvmlEventTypeAll
    def nvmlDeviceRegisterEvents(self, h, mask, es): self.registered[self._idx(h)] = mask

    def nvmlEventSetWait_v2(self, es, timeout_ms):
        assert timeout_ms == 0                      # never blocks the poll
        if not self.events:
            self._err(pynvml.NVML_ERROR_TIMEOUT)
        i, xid = self.events.pop(0)
        data = pynvml.c_nvmlEventData_t()
        data.device = self.nvmlDeviceGetHandleByIndex(i)
        data.eventType, data.eventData = pynvml.nvmlEventTypeXidCriticalError, xid
        return data


def test_nvml_reading_conversion_with_fake_driver_table():
    driver = FakeNvmlDriver()
    src = NvmlSource(node="g1", lib=driver)
    ok, detail = src.status()
    assert ok and "580.1" in detail and "3 GPU" in detail
    assert driver.registered == {0: pynvml.nvmlEventTypeXidCriticalError, 1: pynvml.nvmlEventTypeXidCriticalError}
    assert "no Xid events from gpu2" in detail
    m = by_device(src.poll())
    assert sorted(m) == ["g1/gpu0", "g1/gpu1", "g1/gpu2"]
    g0 = m["g1/gpu0"]
    assert g0 == {
        T.TEMP_C: 60.0, T.THERMAL_MARGIN_C: 25.0, T.CLOCK_EVENT_REASONS: 0x40, T.POWER_W: 412.5,
        T.ECC_SBE_VOLATILE: 5, T.ECC_DBE_VOLATILE: 1, T.REMAP_PENDING: True, T.REMAP_FAILED: False,
        T.PCIE_GEN: 4, T.PCIE_GEN_MAX: 5, T.PCIE_WIDTH: 16, T.PCIE_WIDTH_MAX: 16, T.PCIE_REPLAY: 3,
        T.MEM_TEMP_C: 71, T.NVLINK_CRC_ERRORS: 12, T.NVLINK_REPLAY_ERRORS: 4,
        T.NVLINK_RECOVERY_ERRORS: 1.0, T.RECOVERY_ACTION: "drain_and_reset", T.XIDS: (79,),
    }
    g1 = m["g1/gpu1"]                # NOT_SUPPORTED answers are simply left out, no error
    assert T.THERMAL_MARGIN_C not in g1 and T.REMAP_PENDING not in g1 and T.MEM_TEMP_C not in g1
    assert g1[T.XIDS] == (13,) and DEVICE_ERROR not in g1
    assert m["g1/gpu2"] == {DEVICE_ERROR: "temperature: GPU is lost"}   # one failed call, then stop
    assert by_device(src.poll())["g1/gpu0"][T.XIDS] == ()              # each Xid once
    src.close()
    assert not src.status()[0] and src.poll() == []


# --- poller ---------------------------------------------------------------------------------------
class Collector:
    def __init__(self):
        self.batches, self.times = [], []

    def __call__(self, readings):
        self.times.append(time.monotonic())
        self.batches.append(readings)


def test_poller_polls_at_its_period():
    got = Collector()
    with Poller(SimulatedSource(2, node="n1"), got, period_s=0.1):
        time.sleep(0.75)
    assert 4 <= len(got.batches) <= 9, len(got.batches)     # 7 or 8 on an idle machine
    gaps = [b - a for a, b in zip(got.times, got.times[1:])]
    assert 0.07 < sum(gaps) / len(gaps) < 0.2, gaps
    assert all(len(b) == 2 and b[0].metrics[MONITOR_UNRESPONSIVE] == "" for b in got.batches)


def test_poller_reports_a_wedged_source_after_three_periods_then_recovers():
    src = SimulatedSource(2, node="n1")
    src.stall(0.7)
    got = Collector()
    poller = Poller(src, got, period_s=0.1)
    t0 = time.monotonic()
    with poller:
        while not got.batches and time.monotonic() - t0 < 5:
            time.sleep(0.01)
        first_report = time.monotonic() - t0
        assert poller.unresponsive is not None
        time.sleep(1.0)
    flagged = [b for b in got.batches if b[0].metrics.get(MONITOR_UNRESPONSIVE)]
    assert 0.28 <= first_report < 1.0, first_report          # 3 x 0.1 s, plus scheduling
    assert [r.device for r in flagged[0]] == ["n1/cpu0", "n1/cpu1"]
    assert "has not returned" in flagged[0][0].metrics[MONITOR_UNRESPONSIVE]
    assert 2 <= len(flagged) <= 6                     # repeated each period while stuck
    assert T.TEMP_C in got.batches[-1][0].metrics    # answering again
    assert poller.unresponsive is None and poller.polls >= 3


def test_a_hung_monitor_is_watched_then_its_device_is_cordoned_by_the_default_rules():
    # Row 30 end to end: a poll() that really blocks, the poller's reports, the default rules.
    from hotspare.health.rulefile import load_rules
    from hotspare.health.rules import evaluate, worst
    rules = load_rules()
    src = SimulatedSource(1, node="n1")
    src.stall(1.2)
    got = Collector()
    with Poller(src, got, period_s=0.1):
        time.sleep(1.6)
    history, actions = [], []
    for batch in got.batches:
        history += [r for r in batch if r.device == "n1/cpu0"]
        v = worst(evaluate(rules, history, history[-1].time))
        actions.append(v.action if v else None)
    stalled = [b[0].metrics[T.MONITOR_STALLED_PERIODS] for b in got.batches if b[0].metrics.get(MONITOR_UNRESPONSIVE)]
    assert stalled == sorted(stalled) and 2.8 <= stalled[0] < 4 and stalled[-1] >= 6, stalled
    first_cordon = actions.index(T.QUARANTINE)
    assert actions[0] == T.WATCH and set(actions[:first_cordon]) == {T.WATCH}, actions
    assert actions[-1] is None          # answering again: nothing fires on fresh nominal readings


class RaisingSource(TelemetrySource):
    name = "broken"

    def __init__(self):
        self.calls = 0

    def status(self):
        return True, "raises on every second poll"

    def devices(self):
        return ["n1/gpu0"]

    def poll(self):
        self.calls += 1
        if self.calls % 2:
            raise RuntimeError("driver said no")
        return SimulatedSource(1, node="n1").poll()


def test_poller_survives_a_raising_source_and_a_raising_callback():
    got = Collector()
    calls = {"n": 0}

    def consumer(readings):
        got(readings)
        calls["n"] += 1
        if calls["n"] == 2:
            raise ValueError("consumer bug")

    poller = Poller(RaisingSource(), consumer, period_s=0.05)
    with poller:
        time.sleep(0.5)
        assert poller._thread.is_alive()
    flagged = [b[0].metrics[MONITOR_UNRESPONSIVE] for b in got.batches if b[0].metrics.get(MONITOR_UNRESPONSIVE)]
    assert flagged and all("raised RuntimeError: driver said no" in f for f in flagged)
    assert any(T.TEMP_C in b[0].metrics for b in got.batches)


def test_poller_rejects_a_bad_period():
    with pytest.raises(ConfigError, match="period"):
        Poller(SimulatedSource(1), lambda rs: None, period_s=0)


class FakeOldNvmlDriver(FakeNvmlDriver):
    """A driver before r535: no nvmlDeviceGetCurrentClocksEventReasons, only the old name."""

    def nvmlDeviceGetCurrentClocksEventReasons(self, h):
        self._err(pynvml.NVML_ERROR_FUNCTION_NOT_FOUND)

    def nvmlDeviceGetCurrentClocksThrottleReasons(self, h):
        self._idx(h)
        return 0x20 | 0x40              # SW thermal + HW thermal slowdown


def test_nvml_clock_event_reasons_fall_back_to_the_throttle_name_on_old_drivers():
    src = NvmlSource(node="g1", lib=FakeOldNvmlDriver())
    m = by_device(src.poll())
    assert m["g1/gpu0"][T.CLOCK_EVENT_REASONS] == 0x60 and DEVICE_ERROR not in m["g1/gpu0"]
    assert m["g1/gpu2"] == {DEVICE_ERROR: "temperature: GPU is lost"}
    src.close()
