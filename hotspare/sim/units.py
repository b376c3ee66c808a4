"""Reading and writing durations, fractions and money the way people type them.

Durations always carry a unit ("90s", "2m", "1.5h", "3d"): a bare "30" is rejected rather than
guessed, because guessing minutes for seconds silently changes the answer by 60×.
"""
from __future__ import annotations

import re

from hotspare.errors import ConfigError

_UNITS_H = {"ms": 1 / 3.6e6, "s": 1 / 3600, "sec": 1 / 3600, "m": 1 / 60, "min": 1 / 60,
            "h": 1.0, "hr": 1.0, "d": 24.0, "day": 24.0, "days": 24.0}
_DURATION = re.compile(r"^\s*([-+]?(?:\d+\.?\d*|\.\d+)(?:e[-+]?\d+)?)\s*([a-z]+)\s*$", re.I)


def parse_duration(text: str, what: str) -> float:
    """'90s' / '2m' / '1.5h' / '3d' → hours. ``what`` names the input in the error message."""
    match = _DURATION.match(str(text))
    if not match or match.group(2).lower() not in _UNITS_H:
        raise ConfigError(f"{what}: cannot read {text!r} as a duration; give a number with a unit, "
                          f"e.g. 90s, 2m, 1.5h or 3d")
    return float(match.group(1)) * _UNITS_H[match.group(2).lower()]


def parse_fraction(text: str, what: str) -> float:
    """'1%' or '0.01' → 0.01."""
    raw = str(text).strip()
    scale = 0.01 if raw.endswith("%") else 1.0
    try:
        return float(raw.rstrip("%")) * scale
    except ValueError:
        raise ConfigError(f"{what}: cannot read {text!r} as a fraction; write e.g. 1% or 0.01") from None


def fmt_duration(hours: float) -> str:
    seconds = hours * 3600.0
    if seconds < 120:
        return f"{seconds:.0f} s"
    if hours < 2:
        return f"{hours * 60:.0f} min"
    if hours < 72:
        return f"{hours:.1f} h"
    return f"{hours / 24:.1f} d"


def fmt_usd(amount: float) -> str:
    sign = "-" if amount < 0 else ""
    amount = abs(amount)
    if amount >= 1e6:
        return f"{sign}${amount / 1e6:.2f}M"
    if amount >= 1e3:
        return f"{sign}${amount / 1e3:.0f}k"
    return f"{sign}${amount:.0f}"
