"""The condition language of health rules: parsed here, never ``eval``-ed; pure.

A condition reads one device's readings (oldest first) at one of them, the *current* one::

    temp_c >= 90                       a metric of the current reading against a threshold
    pcie_width < pcie_width_max        two metrics of the same reading
    delta(ecc_dbe_volatile) > 0        a counter's increase since the previous reading that reports it
    rate(pcie_replay, 60) > 16         a counter's increase over the last 60 s before `now`, per minute
    clock_event_reasons & 0xC8         bits of a bitmask (true when any of them is set)
    xids in {48, 95}                   membership; for the list-valued `xids`: any code in the set
    xids not in {13, 31}               ... any code outside the set
    recovery_action in {'gpu_reset'}   a string metric against its documented values
    remap_pending                      a flag on its own
    straggler_score < policy.straggler_score_min      a named constant (the rules file's [policy] table)
    a and b · a or b · not a · ( ... )

A metric the reading leaves out (or reports with the wrong type) is *unknown*: comparisons with it are
unknown, ``and``/``or``/``not`` follow three-valued (Kleene) logic, and a rule fires only on true, so a
missing value never fires a rule, nor its negation. A counter below its previous value was reset (GPU
reset, driver reload); the increase across the reset is the new value, as Prometheus counts it.

Parsing checks names and types, so a rules file with ``temp >= 90``, ``delta(temp_c)``,
``xids == 79`` or ``recovery_action in {'gpu_rest'}`` fails on load with a message that says what to write.
Reason templates use the same terms: ``"{temp_c} C"``, ``"{rate(pcie_replay, 60)}/min"``, ``"{x & 0xC8:#x}"``.
"""
from __future__ import annotations

import difflib
import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from hotspare.health import types as T
from hotspare.health.types import Reading

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
_VALUE_TYPE = {NUMBER: "num", COUNTER: "num", BITMASK: "num", FLAG: "bool", CHOICE: "str", CODES: "codes",
               NOTE: "bool"}


# ---------------------------------------------------------------------------- condition AST
@dataclass(frozen=True)
class _Const:
    value: Any
    type: str            # "num" | "str" | "bool"


@dataclass(frozen=True)
class _Metric:
    name: str


@dataclass(frozen=True)
class _Delta:
    name: str


@dataclass(frozen=True)
class _Rate:
    name: str
    window_s: float


@dataclass(frozen=True)
class _Mask:
    name: str
    mask: int


@dataclass(frozen=True)
class _Compare:
    op: str
    left: Any
    right: Any


@dataclass(frozen=True)
class _Member:
    left: Any
    values: frozenset
    negate: bool


@dataclass(frozen=True)
class _Truthy:
    term: Any


@dataclass(frozen=True)
class _Not:
    item: Any


@dataclass(frozen=True)
class _And:
    items: tuple


@dataclass(frozen=True)
class _Or:
    items: tuple


def _type_of(term: Any) -> str:
    if isinstance(term, _Const):
        return term.type
    if isinstance(term, _Metric):
        return _VALUE_TYPE[METRIC_KINDS[term.name]]
    return "num"                      # delta, rate, mask


def _children(node: Any) -> tuple:
    if isinstance(node, (_And, _Or)):
        return node.items
    if isinstance(node, _Not):
        return (node.item,)
    if isinstance(node, _Truthy):
        return (node.term,)
    if isinstance(node, _Compare):
        return (node.left, node.right)
    if isinstance(node, _Member):
        return (node.left,)
    return ()


def _walk(node: Any):
    yield node
    for c in _children(node):
        yield from _walk(c)


# ---------------------------------------------------------------------------- parser
class ConditionError(ValueError):
    """A syntax or type error in a condition or template; the caller adds the rule and the file."""


_TOKEN = re.compile(r"""\s*(?:
    (?P<num>-?0[xX][0-9a-fA-F]+|-?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?)
  | (?P<str>'[^']*'|"[^"]*")
  | (?P<name>[A-Za-z_][A-Za-z0-9_]*(?:\.[A-Za-z_][A-Za-z0-9_]*)?)
  | (?P<op><=|>=|==|!=|<|>|&|\(|\)|\{|\}|,)
  )""", re.VERBOSE)
_CMP = ("<", "<=", ">", ">=", "==", "!=")
_MAX_DEPTH = 50
_KEYWORDS = ("and", "or", "not", "in", "true", "false")


def _tokenize(text: str) -> list[tuple[str, Any, int]]:
    tokens, pos = [], 0
    text = text.rstrip()
    while pos < len(text):
        m = _TOKEN.match(text, pos)
        if not m or m.end() == pos:
            col = pos + len(text[pos:]) - len(text[pos:].lstrip())
            raise ConditionError(f"unexpected {text[col]!r} at column {col + 1}")
        kind = m.lastgroup
        raw = m.group(kind)
        col = m.start(kind) + 1
        if kind == "num":
            if "x" in raw.lower():
                value: Any = int(raw, 16)
            else:
                value = float(raw) if any(c in raw for c in ".eE") else int(raw)
            tokens.append(("num", value, col))
        elif kind == "str":
            tokens.append(("str", raw[1:-1], col))
        elif kind == "name" and raw in _KEYWORDS:
            tokens.append((raw, raw, col))
        else:
            tokens.append((kind, raw, col))
        pos = m.end()
    tokens.append(("end", None, len(text) + 1))
    return tokens


class _Parser:
    def __init__(self, text: str, constants: Mapping[str, float]):
        self.tokens = _tokenize(text)
        self.i = 0
        self.constants = constants
        self.depth = 0

    # -- token helpers
    def peek(self, k: int = 0) -> tuple[str, Any, int]:
        return self.tokens[min(self.i + k, len(self.tokens) - 1)]

    def take(self) -> tuple[str, Any, int]:
        tok = self.peek()
        self.i += 1
        return tok

    def at(self, op: str) -> bool:
        """Is the next token the punctuation ``op`` (not a quoted string that happens to spell it)?"""
        tok = self.peek()
        return tok[0] == "op" and tok[1] == op

    def expect(self, kind: str, what: str) -> tuple[str, Any, int]:
        """The next token, which must be of ``kind`` ("num", "name") or the punctuation ``kind``."""
        tok = self.take()
        if tok[0] != kind and not (tok[0] == "op" and tok[1] == kind):
            raise ConditionError(f"expected {what} at column {tok[2]}, found {_show(tok)}")
        return tok

    # -- grammar
    def condition(self) -> Any:
        node = self.or_()
        tok = self.peek()
        if tok[0] != "end":
            raise ConditionError(f"unexpected {_show(tok)} at column {tok[2]}; join conditions with 'and' / 'or'")
        return node

    def or_(self) -> Any:
        items = [self.and_()]
        while self.peek()[0] == "or":
            self.take()
            items.append(self.and_())
        return items[0] if len(items) == 1 else _Or(tuple(items))

    def and_(self) -> Any:
        items = [self.not_()]
        while self.peek()[0] == "and":
            self.take()
            items.append(self.not_())
        return items[0] if len(items) == 1 else _And(tuple(items))

    def not_(self) -> Any:
        if self.peek()[0] == "not" or self.at("("):
            self.depth += 1
            if self.depth > _MAX_DEPTH:
                raise ConditionError(f"the condition nests 'not' and parentheses more than {_MAX_DEPTH} deep")
            if self.take()[0] == "not":
                node = _Not(self.not_())
            else:
                node = self.or_()
                self.expect(")", "')'")
            self.depth -= 1
            return node
        return self.comparison()

    def comparison(self) -> Any:
        left = self.term()
        tok = self.peek()
        if tok[1] in _CMP and tok[0] == "op":
            self.take()
            right = self.term()
            return _check_compare(tok[1], left, right)
        if tok[0] == "in" or (tok[0] == "not" and self.peek(1)[0] == "in"):
            negate = tok[0] == "not"
            self.take()
            if negate:
                self.take()
            return _check_member(left, self.set_(), negate)
        if isinstance(left, _Mask) or (isinstance(left, _Metric) and _type_of(left) == "bool"):
            return _Truthy(left)
        raise ConditionError(f"{_describe(left)} is not a condition on its own; compare it, e.g. "
                   f"'{_example(left)}'")

    def term(self) -> Any:
        kind, value, col = self.take()
        if kind == "num":
            return _Const(value, "num")
        if kind == "str":
            return _Const(value, "str")
        if kind in ("true", "false"):
            return _Const(kind == "true", "bool")
        if kind != "name":
            raise ConditionError(f"expected a metric, function or value at column {col}, "
                                 f"found {_show((kind, value, col))}")
        if "." in value:
            if value not in self.constants:
                raise ConditionError(f"unknown constant {value!r}; known: {', '.join(sorted(self.constants))}")
            return _Const(self.constants[value], "num")
        if self.at("("):
            return self.call(value, col)
        metric = _metric_name(value)
        if self.at("&"):
            self.take()
            if METRIC_KINDS[metric] != BITMASK:
                raise ConditionError(f"'&' needs a bitmask metric ({', '.join(_of_kind(BITMASK))}), not {metric!r}")
            mtok = self.expect("num", "an integer mask after '&', e.g. 0x40")
            if not isinstance(mtok[1], int) or mtok[1] <= 0:
                raise ConditionError(f"the mask after '&' must be a positive integer such as 0x40, not {mtok[1]!r}")
            return _Mask(metric, mtok[1])
        return _Metric(metric)

    def call(self, fname: str, col: int) -> Any:
        if fname not in ("delta", "rate"):
            raise ConditionError(f"unknown function {fname!r} at column {col}; "
                                 "known: delta(counter), rate(counter, seconds)")
        self.take()                                            # "("
        tok = self.expect("name", f"a counter metric inside {fname}()")
        metric = _metric_name(tok[1])
        if METRIC_KINDS[metric] != COUNTER:
            raise ConditionError(f"{fname}() needs a counter ({', '.join(_of_kind(COUNTER))}); "
                                 f"{metric!r} is a {METRIC_KINDS[metric]}")
        if fname == "delta":
            self.expect(")", "')' after delta(counter")
            return _Delta(metric)
        self.expect(",", "',' and a window in seconds: rate(counter, 60)")
        wtok = self.expect("num", "a window in seconds: rate(counter, 60)")
        if wtok[1] <= 0:
            raise ConditionError(f"the rate window must be a positive number of seconds, not {wtok[1]!r}")
        self.expect(")", "')' after rate(counter, seconds")
        return _Rate(metric, float(wtok[1]))

    def set_(self) -> frozenset:
        self.expect("{", "a set such as {48, 79}")
        values: list[Any] = []
        while True:
            kind, value, col = self.take()
            if kind == "num" or kind == "str":
                values.append(value)
            elif kind in ("true", "false"):
                values.append(kind == "true")
            else:
                raise ConditionError(f"expected a number or 'string' in the set at column {col}, "
                                     f"found {_show((kind, value, col))}")
            sep = self.take()
            if sep[0] == "op" and sep[1] == "}":
                return frozenset(values)
            if not (sep[0] == "op" and sep[1] == ","):
                raise ConditionError(f"expected ',' or '}}' at column {sep[2]}, found {_show(sep)}")
            if self.at("}"):                                   # trailing comma
                self.take()
                return frozenset(values)


def _show(tok: tuple[str, Any, int]) -> str:
    if tok[0] == "end":
        return "the end"
    return f"'{tok[1]}'" if tok[0] == "str" else repr(tok[1])


def _of_kind(kind: str) -> list[str]:
    return sorted(n for n, k in METRIC_KINDS.items() if k == kind)


def _metric_name(name: str) -> str:
    if name in METRIC_KINDS:
        return name
    close = difflib.get_close_matches(name, list(METRIC_KINDS), n=1)
    hint = f"; did you mean {close[0]!r}?" if close else ""
    raise ConditionError(f"unknown metric {name!r}{hint} Known metrics: {', '.join(sorted(METRIC_KINDS))}")


def _describe(term: Any) -> str:
    if isinstance(term, _Const):
        return f"the constant {term.value!r}"
    if isinstance(term, _Metric):
        return f"{term.name!r} (a {METRIC_KINDS[term.name]})"
    if isinstance(term, _Delta):
        return f"delta({term.name})"
    if isinstance(term, _Rate):
        return f"rate({term.name}, {term.window_s:g})"
    return "this term"


def _example(term: Any) -> str:
    if isinstance(term, _Metric):
        kind = METRIC_KINDS[term.name]
        if kind == CODES:
            return f"{term.name} in {{48, 79}}"
        if kind == CHOICE:
            return f"{term.name} in {{'{CHOICES[term.name][1]}'}}"
        return f"{term.name} > 0"
    if isinstance(term, _Delta):
        return f"delta({term.name}) > 0"
    if isinstance(term, _Rate):
        return f"rate({term.name}, {term.window_s:g}) > 1"
    return "temp_c >= 90"


def _check_compare(op: str, left: Any, right: Any) -> _Compare:
    lt, rt = _type_of(left), _type_of(right)
    if isinstance(left, _Const) and isinstance(right, _Const):
        raise ConditionError(f"'{op}' compares two constants; one side must be a metric, delta() or rate()")
    if "codes" in (lt, rt):
        raise ConditionError("compare xids with 'in' or 'not in' and a set, e.g. 'xids in {48, 79}'")
    if op in ("<", "<=", ">", ">="):
        if lt != "num" or rt != "num":
            bad = left if lt != "num" else right
            raise ConditionError(f"'{op}' needs numbers; {_describe(bad)} is not a number")
    elif lt != rt:
        raise ConditionError(f"'{op}' compares {_describe(left)} with {_describe(right)}, values of different kinds")
    for a, b in ((left, right), (right, left)):
        _check_choice(a, [b.value] if isinstance(b, _Const) else [])
    return _Compare(op, left, right)


def _check_member(left: Any, values: frozenset, negate: bool) -> _Member:
    lt = _type_of(left)
    if isinstance(left, _Const):
        raise ConditionError("the left side of 'in' must be a metric, e.g. 'xids in {48, 79}'")
    if lt == "bool":
        raise ConditionError(f"{_describe(left)} is a flag; test it on its own or with 'not'")
    want = "str" if lt == "str" else "num"
    for v in values:
        if want == "num" and (isinstance(v, bool) or not isinstance(v, (int, float))):
            raise ConditionError(f"the set for {_describe(left)} must hold numbers, not {v!r}")
        if want == "str" and not isinstance(v, str):
            raise ConditionError(f"the set for {_describe(left)} must hold 'strings', not {v!r}")
    _check_choice(left, list(values))
    return _Member(left, values, negate)


def _check_choice(term: Any, values: list) -> None:
    if isinstance(term, _Metric) and term.name in CHOICES:
        allowed = CHOICES[term.name]
        for v in values:
            if v not in allowed:
                raise ConditionError(f"{term.name} is never {v!r}; its values are {', '.join(map(repr, allowed))}")


# ---------------------------------------------------------------------------- reason templates
SPECIAL = ("value", "held", "device", "rank", "rule", "when")   # {value}: what matched the condition
_PLACEHOLDER = re.compile(r"\{\{|\}\}|\{([^{}]*)\}|[{}]")


@dataclass(frozen=True)
class _Slot:
    term: Any            # a term node, or one of SPECIAL
    spec: str


def parse_condition(text: str, constants: Mapping[str, float] | None = None) -> Any:
    """The syntax tree of a ``when`` condition; ``constants`` names values such as ``policy.x``."""
    if len(text) > 4000:
        raise ConditionError(f"the condition is {len(text)} characters long; split it into several rules")
    return _Parser(text, constants or {}).condition()


def parse_template(text: str, constants: Mapping[str, float] | None = None) -> tuple:
    """A reason template: text with ``{term}`` and ``{term:format-spec}`` placeholders, where a term is
    anything a condition compares (a metric, ``delta()``, ``rate()``, a mask, a constant) or one of
    SPECIAL, whose values the caller supplies to ``render``; ``{{`` and ``}}`` are literal braces."""
    constants = constants or {}
    parts: list[Any] = []
    pos = 0
    for m in _PLACEHOLDER.finditer(text):
        parts.append(text[pos:m.start()])
        pos = m.end()
        tok = m.group(0)
        if tok in ("{{", "}}"):
            parts.append(tok[0])
            continue
        if m.group(1) is None:
            raise ConditionError(f"unmatched {tok!r} at column {m.start() + 1}; "
                                 "write '{{' or '}}' for a literal brace")
        inner, _, spec = m.group(1).partition(":")
        inner = inner.strip()
        if inner in SPECIAL:
            parts.append(_Slot(inner, spec))
            continue
        if not inner:
            raise ConditionError("empty placeholder '{}'; name a metric, delta(), rate() or one of "
                       + ", ".join("{" + s + "}" for s in SPECIAL))
        p = _Parser(inner, constants)
        node = p.term()
        if p.peek()[0] != "end":
            raise ConditionError(f"placeholder {{{inner}}} must be a single value "
                                 "(metric, delta(), rate(), mask), not a condition")
        parts.append(_Slot(node, spec))
    parts.append(text[pos:])
    return tuple(p for p in parts if p != "")


def metrics_of(node: Any) -> frozenset:
    """The metrics a condition or template term reads."""
    return frozenset(n.name for n in _walk(node) if isinstance(n, (_Metric, _Delta, _Rate, _Mask)))


def uses_delta(node: Any) -> bool:
    return any(isinstance(n, _Delta) for n in _walk(node))


def rate_window_s(node: Any) -> float:
    """The longest rate() window in a condition (0 when it has none)."""
    return max((n.window_s for n in _walk(node) if isinstance(n, _Rate)), default=0.0)


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
    if isinstance(node, _Const):
        return node.value
    if isinstance(node, _Metric):
        return _read(history[i].metrics, node.name)
    if isinstance(node, _Delta):
        return _delta(history, i, node.name)
    if isinstance(node, _Rate):
        return _rate(history, i, node.name, node.window_s, now)
    if isinstance(node, _Mask):
        v = _read(history[i].metrics, node.name)
        return None if v is None else v & node.mask
    raise AssertionError(f"not a term: {node!r}")


_OPS = {"<": lambda a, b: a < b, "<=": lambda a, b: a <= b, ">": lambda a, b: a > b,
        ">=": lambda a, b: a >= b, "==": lambda a, b: a == b, "!=": lambda a, b: a != b}


def truth(node: Any, history: Sequence[Reading], i: int, now: float, witness: list) -> bool | None:
    """True, False or None (unknown: a value is missing). The first true comparison leaves its
    observed value in ``witness`` for the reason's {value}."""
    if isinstance(node, _And):
        vals = [truth(c, history, i, now, witness) for c in node.items]
        return False if False in vals else None if None in vals else True
    if isinstance(node, _Or):
        vals = [truth(c, history, i, now, witness) for c in node.items]
        return True if True in vals else None if None in vals else False
    if isinstance(node, _Not):
        v = truth(node.item, history, i, now, [])
        return None if v is None else not v
    if isinstance(node, _Truthy):
        v = term_value(node.term, history, i, now)
        if v is None:
            return None
        if v:
            witness.append(v)
        return bool(v)
    if isinstance(node, _Compare):
        a, b = term_value(node.left, history, i, now), term_value(node.right, history, i, now)
        if a is None or b is None:
            return None
        ok = _OPS[node.op](a, b)
        if ok:
            witness.append(b if isinstance(node.left, _Const) else a)
        return ok
    if isinstance(node, _Member):
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
