"""The condition language's evaluation: a syntax tree read over one device's readings, in
three-valued logic (a missing value is unknown and never fires a rule), and reason templates
rendered. Pure."""
from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

from hotspare.health.conditions.tree import (BITMASK, CHOICE, COUNTER, FLAG, METRIC_KINDS, NOTE, NUMBER, And,
                                             Compare, Const, Delta, Mask, Member, Metric, Not, Or, Rate, Truthy)
from hotspare.health.types import Reading

# ---------------------------------------------------------------------------- evaluation
def _read(metrics: Mapping[str, Any], name: str) -> Any:
    """The value of ``name`` in one reading, or None when absent or not of the metric's kind."""
    raw = metrics.get(name)
    if raw is None:
        return None
    kind = METRIC_KINDS[name]
    if kind in (NUMBER, COUNTER, BITMASK):
        if not isinstance(raw, (int, float)) or (isinstance(raw, float) and not math.isfinite(raw)):
            return None
        if kind == BITMASK and not isinstance(raw, int):
            return None
        return raw
    if kind == FLAG:
        return bool(raw) if isinstance(raw, (bool, int)) else None
    if kind == NOTE:
        return raw if isinstance(raw, str) and raw else None
    if kind == CHOICE:
        return raw if isinstance(raw, str) else None
    if isinstance(raw, int) and not isinstance(raw, bool):             # CODES: one code or a list of them
        return (raw,)
    if isinstance(raw, (tuple, list, frozenset, set)) and all(isinstance(c, int) for c in raw):
        return tuple(sorted(raw)) if isinstance(raw, (set, frozenset)) else tuple(raw)
    return None


def _increase(prev: float, cur: float) -> float:
    return cur - prev if cur >= prev else cur          # below the previous value: the counter was reset


def _delta(history: Sequence[Reading], i: int, name: str) -> Any:
    cur = _read(history[i].metrics, name)
    if cur is None:
        return None
    for j in range(i - 1, -1, -1):
        prev = _read(history[j].metrics, name)
        if prev is not None:
            return _increase(prev, cur)
    return None


def _rate(history: Sequence[Reading], i: int, name: str, window_s: float, now: float) -> Any:
    total, pairs, prev = 0.0, 0, None
    for r in history[: i + 1]:
        v = _read(r.metrics, name)
        if v is None:
            continue
        if prev is not None and r.time > now - window_s:
            total += _increase(prev, v)
            pairs += 1
        prev = v
    return total / (window_s / 60.0) if pairs else None


def term_value(node: Any, history: Sequence[Reading], i: int, now: float) -> Any:
    if isinstance(node, Const):
        return node.value
    if isinstance(node, Metric):
        return _read(history[i].metrics, node.name)
    if isinstance(node, Delta):
        return _delta(history, i, node.name)
    if isinstance(node, Rate):
        return _rate(history, i, node.name, node.window_s, now)
    if isinstance(node, Mask):
        v = _read(history[i].metrics, node.name)
        return None if v is None else v & node.mask
    raise AssertionError(f"not a term: {node!r}")


_OPS = {"<": lambda a, b: a < b, "<=": lambda a, b: a <= b, ">": lambda a, b: a > b,
        ">=": lambda a, b: a >= b, "==": lambda a, b: a == b, "!=": lambda a, b: a != b}


def truth(node: Any, history: Sequence[Reading], i: int, now: float, witness: list) -> bool | None:
    """True, False or None (unknown: a value is missing). The first true comparison leaves its
    observed value in ``witness`` for the reason's {value}."""
    if isinstance(node, And):
        vals = [truth(c, history, i, now, witness) for c in node.items]
        return False if False in vals else None if None in vals else True
    if isinstance(node, Or):
        vals = [truth(c, history, i, now, witness) for c in node.items]
        return True if True in vals else None if None in vals else False
    if isinstance(node, Not):
        v = truth(node.item, history, i, now, [])
        return None if v is None else not v
    if isinstance(node, Truthy):
        v = term_value(node.term, history, i, now)
        if v is None:
            return None
        if v:
            witness.append(v)
        return bool(v)
    if isinstance(node, Compare):
        a, b = term_value(node.left, history, i, now), term_value(node.right, history, i, now)
        if a is None or b is None:
            return None
        ok = _OPS[node.op](a, b)
        if ok:
            witness.append(b if isinstance(node.left, Const) else a)
        return ok
    if isinstance(node, Member):
        v = term_value(node.left, history, i, now)
        if v is None:
            return None
        if isinstance(v, tuple):                       # codes: any code in (or outside) the set
            hits = tuple(c for c in v if (c in node.values) != node.negate)
            if hits:
                witness.append(hits)
            return bool(hits)
        ok = (v in node.values) != node.negate
        if ok:
            witness.append(v)
        return ok
    raise AssertionError(f"not a condition: {node!r}")


def fmt(value: Any, spec: str = "") -> str:
    if spec and value is not None:
        try:
            return format(value, spec)
        except (TypeError, ValueError):
            pass
    if value is None:
        return "n/a"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        return f"{value:.2f}".rstrip("0").rstrip(".") if abs(value) < 1e6 else f"{value:.3g}"
    if isinstance(value, tuple):
        return ", ".join(fmt(v) for v in value)
    return str(value)




def render(template: tuple, history: Sequence[Reading], i: int, now: float, witness: list,
           specials: Mapping[str, Any]) -> str:
    """A reason: the template's terms read at ``history[i]``; ``{value}`` is the first witness."""
    out = []
    for part in template:
        if isinstance(part, str):
            out.append(part)
        elif part.term == "value":
            out.append(fmt(witness[0] if witness else True, part.spec))
        elif isinstance(part.term, str):
            out.append(fmt(specials.get(part.term), part.spec))
        else:
            out.append(fmt(term_value(part.term, history, i, now), part.spec))
    return "".join(out)

