"""The condition language's vocabulary (which metrics exist, of which kind) and its syntax tree:
the nodes ``parse`` builds and ``evaluate`` reads, and the queries over a tree. Pure."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from hotspare.health import types as T

# ---------------------------------------------------------------------------- metric vocabulary
NUMBER, COUNTER, BITMASK, FLAG, CHOICE, CODES = "number", "counter", "bitmask", "flag", "choice", "codes"
NOTE = "note"     # a message, present only when something is wrong: true on its own, shown in reasons
METRIC_KINDS: dict[str, str] = {
    T.TEMP_C: NUMBER, T.MEM_TEMP_C: NUMBER, T.THERMAL_MARGIN_C: NUMBER,
    T.CLOCK_EVENT_REASONS: BITMASK, T.POWER_W: NUMBER,
    T.ECC_SBE_VOLATILE: COUNTER, T.ECC_DBE_VOLATILE: COUNTER,
    T.REMAP_PENDING: FLAG, T.REMAP_FAILED: FLAG,
    T.PCIE_GEN: NUMBER, T.PCIE_GEN_MAX: NUMBER, T.PCIE_WIDTH: NUMBER, T.PCIE_WIDTH_MAX: NUMBER,
    T.PCIE_REPLAY: COUNTER,
    T.NVLINK_CRC_ERRORS: COUNTER, T.NVLINK_REPLAY_ERRORS: COUNTER, T.NVLINK_RECOVERY_ERRORS: COUNTER,
    T.XIDS: CODES, T.RECOVERY_ACTION: CHOICE,
    T.STEP_COMPUTE_S: NUMBER, T.STEP_COMM_S: NUMBER, T.STRAGGLER_SCORE: NUMBER,
    T.NONFINITE: FLAG, T.FINGERPRINT_MISMATCH: FLAG,
    T.MONITOR_UNRESPONSIVE: NOTE, T.DEVICE_ERROR: NOTE, T.MONITOR_STALLED_PERIODS: NUMBER,
}
CHOICES: dict[str, tuple[str, ...]] = {
    T.RECOVERY_ACTION: ("none", "gpu_reset", "node_reboot", "drain_p2p", "drain_and_reset"),
}
VALUE_TYPE = {NUMBER: "num", COUNTER: "num", BITMASK: "num", FLAG: "bool", CHOICE: "str", CODES: "codes",
               NOTE: "bool"}


# ---------------------------------------------------------------------------- condition AST
@dataclass(frozen=True)
class Const:
    value: Any
    type: str            # "num" | "str" | "bool"


@dataclass(frozen=True)
class Metric:
    name: str


@dataclass(frozen=True)
class Delta:
    name: str


@dataclass(frozen=True)
class Rate:
    name: str
    window_s: float


@dataclass(frozen=True)
class Mask:
    name: str
    mask: int


@dataclass(frozen=True)
class Compare:
    op: str
    left: Any
    right: Any


@dataclass(frozen=True)
class Member:
    left: Any
    values: frozenset
    negate: bool


@dataclass(frozen=True)
class Truthy:
    term: Any


@dataclass(frozen=True)
class Not:
    item: Any


@dataclass(frozen=True)
class And:
    items: tuple


@dataclass(frozen=True)
class Or:
    items: tuple


def type_of(term: Any) -> str:
    if isinstance(term, Const):
        return term.type
    if isinstance(term, Metric):
        return VALUE_TYPE[METRIC_KINDS[term.name]]
    return "num"                      # delta, rate, mask


def children(node: Any) -> tuple:
    if isinstance(node, (And, Or)):
        return node.items
    if isinstance(node, Not):
        return (node.item,)
    if isinstance(node, Truthy):
        return (node.term,)
    if isinstance(node, Compare):
        return (node.left, node.right)
    if isinstance(node, Member):
        return (node.left,)
    return ()


def walk(node: Any):
    yield node
    for c in children(node):
        yield from walk(c)


def metrics_of(node: Any) -> frozenset:
    """The metrics a condition or template term reads."""
    return frozenset(n.name for n in walk(node) if isinstance(n, (Metric, Delta, Rate, Mask)))


def uses_delta(node: Any) -> bool:
    return any(isinstance(n, Delta) for n in walk(node))


def rate_window_s(node: Any) -> float:
    """The longest rate() window in a condition (0 when it has none)."""
    return max((n.window_s for n in walk(node) if isinstance(n, Rate)), default=0.0)


