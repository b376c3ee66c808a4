"""Published failure data, turned into the two things the models need: a rate and a mix.

A *rate* is failures per GPU-year. Every preset is an *interruption* rate (events that stopped
the job), not a component AFR: that is the number that decides what checkpoint-restart costs.
A correlated event (a switch taking out a rack) counts once, as it did in the sources.

The *mix* says what those failures are, so the simulator can give each kind its own detection
latency, repair time, blast radius and chance of destroying every in-memory copy. Shares come
from the Llama 3 interruption table; the other columns are stated assumptions (the sources do
not publish them) and every one can be overridden from ``hotspare simulate``.
"""
from __future__ import annotations

import dataclasses

HOURS_PER_YEAR = 8760.0


@dataclasses.dataclass(frozen=True)
class RatePreset:
    name: str
    per_gpu_year: float
    summary: str
    source: str


def _per_gpu_year(failures: float, days: float, gpus: float) -> float:
    return failures / (days * gpus) * 365.0


PRESETS: dict[str, RatePreset] = {p.name: p for p in (
    RatePreset(
        "afr-1pct", 0.01,
        "1 failure per 100 GPU-years: a vendor-sheet AFR, far below what large jobs observe",
        "a round number for comparison; not an observation",
    ),
    RatePreset(
        "llama3-405b", _per_gpu_year(419, 54, 16_384),
        "419 unexpected interruptions in 54 days on 16,384 H100s (one every 3.1 h)",
        "Llama 3 team, 'The Llama 3 Herd of Models' (arXiv:2407.21783, 2024), Sec. 3.3.4, Table 5",
    ),
    RatePreset(
        "meta-rsc1", _per_gpu_year(6.5, 1000, 8),
        "6.5 failures per 1,000 node-days of 8 A100s (RSC-1)",
        "Kokolis et al., 'Revisiting Reliability in Large-Scale Machine Learning Research "
        "Clusters' (arXiv:2410.21680, HPCA 2025)",
    ),
)}

DEFAULT_PRESET = "llama3-405b"


@dataclasses.dataclass(frozen=True)
class FailureKind:
    """One kind of failure and how it behaves.

    ``weight`` is relative (shares are normalised over the mix). ``correlated`` is the chance
    that one event takes out a whole rack instead of one node; ``destroys_state`` the chance
    that no in-memory copy survives even though other replicas are up (corruption that spread
    through the all-reduce, a bug that kills every rank at once), which forces a checkpoint.
    """
    name: str
    weight: float
    detect_h: float
    repair_h: float
    correlated: float
    destroys_state: float
    source: str


_S, _M, _H = 1 / 3600, 1 / 60, 1.0

# Weights are interruption counts from Llama 3 Table 5 (419 in all). Detection, repair,
# correlation and state loss are assumptions, chosen to be plausible and easy to argue with:
# - detection: 30 s for a crash that kills a process or surfaces as an NCCL error, 60 s for
#   network faults (retries first), 10 min for a silent hang (PyTorch's default NCCL timeout);
# - repair: how long the node is out before it can serve as a spare again (days for a GPU swap,
#   a reboot-and-test cycle for ECC and host faults, minutes to restart a crashed process);
# - correlated: a switch or PDU fault that takes a whole rack (20% of network, 10% of host);
# - destroys_state: silent data corruption poisons every replica; a quarter of software
#   failures are assumed job-wide (every rank hits the same bug), the rest kill one process.
DEFAULT_MIX: tuple[FailureKind, ...] = (
    FailureKind("gpu", 190, 30 * _S, 72 * _H, 0.0, 0.0,
                "faulty GPU 148 (NVLink faults included), SRAM 19, GPU system processor 17, "
                "thermal/sensor 6"),
    FailureKind("hbm_ecc", 72, 30 * _S, 24 * _H, 0.0, 0.0, "GPU HBM3 memory 72"),
    FailureKind("network", 35, 60 * _S, 12 * _H, 0.2, 0.0, "network switch/cable 35 (scale-out fabric)"),
    FailureKind("nic", 7, 60 * _S, 24 * _H, 0.0, 0.0, "NIC 7"),
    FailureKind("host", 46, 30 * _S, 48 * _H, 0.1, 0.0,
                "host maintenance 32, SSD 3, power supply 3, chassis 2, IO board 2, CPU 2, DRAM 2"),
    FailureKind("software", 56, 30 * _S, 15 * _M, 0.0, 0.25, "software bug 54, dependency 2"),
    FailureKind("hang", 7, 10 * _M, 30 * _M, 0.0, 0.0, "NCCL watchdog timeouts 7"),
    FailureKind("sdc", 6, 30 * _S, 24 * _H, 0.0, 1.0, "silent data corruption 6"),
)


DEFAULT_RACK_NODES = 4  # nodes taken out by one correlated (rack-wide) event


def shares(mix: tuple[FailureKind, ...]) -> list[float]:
    total = sum(k.weight for k in mix)
    return [k.weight / total for k in mix]


def mix_mean(mix: tuple[FailureKind, ...], field: str) -> float:
    """Share-weighted mean of one column (e.g. the fallback share p_f for ``destroys_state``)."""
    return sum(s * getattr(k, field) for s, k in zip(shares(mix), mix))


def node_hours_per_failure(mix: tuple[FailureKind, ...], rack_nodes: int) -> float:
    """Mean node-hours a failure takes out of service: repair time × nodes hit (a rack-wide
    event hits ``rack_nodes``). Times the failure rate, it is the mean number of nodes in repair."""
    return sum(s * k.repair_h * (1.0 + k.correlated * (rack_nodes - 1)) for s, k in zip(shares(mix), mix))


def nodes_per_failure(mix: tuple[FailureKind, ...], rack_nodes: int) -> float:
    """Mean nodes one failure takes out (a rack-wide event takes ``rack_nodes``)."""
    return sum(s * (1.0 + k.correlated * (rack_nodes - 1)) for s, k in zip(shares(mix), mix))


def kept_state_exposure(mix: tuple[FailureKind, ...], rack_nodes: int) -> tuple[float, float]:
    """Per failure, over those that keep an in-memory copy: (mean nodes lost, mean node-hours out)."""
    nodes = hours = 0.0
    for s, k in zip(shares(mix), mix):
        hit = s * (1.0 - k.destroys_state) * (1.0 + k.correlated * (rack_nodes - 1))
        nodes, hours = nodes + hit, hours + hit * k.repair_h
    return nodes, hours
