"""The condition language's parser: text -> the syntax tree of ``tree``, with names and types
checked, so a rules file with a typo fails on load with a message that says what to write. Pure;
never ``eval``."""
from __future__ import annotations

import difflib
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from hotspare.health.conditions.tree import (BITMASK, CHOICE, CHOICES, CODES, COUNTER, METRIC_KINDS, And, Compare,
                                             Const, Delta, Mask, Member, Metric, Not, Or, Rate, Truthy, type_of)

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
        return items[0] if len(items) == 1 else Or(tuple(items))

    def and_(self) -> Any:
        items = [self.not_()]
        while self.peek()[0] == "and":
            self.take()
            items.append(self.not_())
        return items[0] if len(items) == 1 else And(tuple(items))

    def not_(self) -> Any:
        if self.peek()[0] == "not" or self.at("("):
            self.depth += 1
            if self.depth > _MAX_DEPTH:
                raise ConditionError(f"the condition nests 'not' and parentheses more than {_MAX_DEPTH} deep")
            if self.take()[0] == "not":
                node = Not(self.not_())
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
        if isinstance(left, Mask) or (isinstance(left, Metric) and type_of(left) == "bool"):
            return Truthy(left)
        raise ConditionError(f"{_describe(left)} is not a condition on its own; compare it, e.g. "
                   f"'{_example(left)}'")

    def term(self) -> Any:
        kind, value, col = self.take()
        if kind == "num":
            return Const(value, "num")
        if kind == "str":
            return Const(value, "str")
        if kind in ("true", "false"):
            return Const(kind == "true", "bool")
        if kind != "name":
            raise ConditionError(f"expected a metric, function or value at column {col}, "
                                 f"found {_show((kind, value, col))}")
        if "." in value:
            if value not in self.constants:
                raise ConditionError(f"unknown constant {value!r}; known: {', '.join(sorted(self.constants))}")
            return Const(self.constants[value], "num")
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
            return Mask(metric, mtok[1])
        return Metric(metric)

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
            return Delta(metric)
        self.expect(",", "',' and a window in seconds: rate(counter, 60)")
        wtok = self.expect("num", "a window in seconds: rate(counter, 60)")
        if wtok[1] <= 0:
            raise ConditionError(f"the rate window must be a positive number of seconds, not {wtok[1]!r}")
        self.expect(")", "')' after rate(counter, seconds")
        return Rate(metric, float(wtok[1]))

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
    if isinstance(term, Const):
        return f"the constant {term.value!r}"
    if isinstance(term, Metric):
        return f"{term.name!r} (a {METRIC_KINDS[term.name]})"
    if isinstance(term, Delta):
        return f"delta({term.name})"
    if isinstance(term, Rate):
        return f"rate({term.name}, {term.window_s:g})"
    return "this term"


def _example(term: Any) -> str:
    if isinstance(term, Metric):
        kind = METRIC_KINDS[term.name]
        if kind == CODES:
            return f"{term.name} in {{48, 79}}"
        if kind == CHOICE:
            return f"{term.name} in {{'{CHOICES[term.name][1]}'}}"
        return f"{term.name} > 0"
    if isinstance(term, Delta):
        return f"delta({term.name}) > 0"
    if isinstance(term, Rate):
        return f"rate({term.name}, {term.window_s:g}) > 1"
    return "temp_c >= 90"


def _check_compare(op: str, left: Any, right: Any) -> Compare:
    lt, rt = type_of(left), type_of(right)
    if isinstance(left, Const) and isinstance(right, Const):
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
        _check_choice(a, [b.value] if isinstance(b, Const) else [])
    return Compare(op, left, right)


def _check_member(left: Any, values: frozenset, negate: bool) -> Member:
    lt = type_of(left)
    if isinstance(left, Const):
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
    return Member(left, values, negate)


def _check_choice(term: Any, values: list) -> None:
    if isinstance(term, Metric) and term.name in CHOICES:
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

