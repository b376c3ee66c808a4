"""The event stream on disk: one JSON object per line (schema: hotspare.coordinator.events),
appended by the run as it happens and flushed line by line, so ``hotspare events --follow``
(``follow``) sees each record within its poll period. A run with ``--report R.json`` writes it
beside the report, ``R.events.jsonl`` (``--events FILE`` chooses another place)."""
from __future__ import annotations

import json
import math
import os
import time
from typing import Any, Callable, Iterator

from hotspare.coordinator.events import check_record
from hotspare.errors import ConfigError


def events_path_for(report: str) -> str:
    """Where a run with ``--report report`` writes its event stream by default."""
    root, ext = os.path.splitext(report)
    return (root if ext == ".json" else report) + ".events.jsonl"


class EventFile:
    """A sink of the observer: appends each record as one line and flushes it."""

    def __init__(self, path: str):
        try:
            self._f = open(path, "w", encoding="utf-8")
        except OSError as e:
            raise ConfigError(f"cannot write the event stream to {path}: {e.strerror or e}; give --events a "
                              "writable file") from None
        self.path = path

    def __call__(self, rec: dict[str, Any]) -> None:
        try:
            line = json.dumps(rec, separators=(",", ":"), allow_nan=False, default=str)
        except ValueError:          # a NaN or an infinity somewhere (a telemetry reading): as text
            line = json.dumps(_finite(rec), separators=(",", ":"), allow_nan=False, default=str)
        self._f.write(line + "\n")
        self._f.flush()

    def close(self) -> None:
        self._f.close()


def _finite(obj: Any) -> Any:
    """``obj`` with every non-finite float as its text ("nan", "inf"): JSON has no NaN."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return str(obj)
    if isinstance(obj, dict):
        return {k: _finite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_finite(v) for v in obj]
    return obj


def _parse(line: str, where: str) -> dict[str, Any]:
    try:
        return check_record(json.loads(line))
    except (json.JSONDecodeError, ValueError) as e:
        raise ConfigError(f"{where}: {e}") from None


def read(path: str) -> list[dict[str, Any]]:
    """Every record of a finished (or running) stream; a torn last line is left out."""
    try:
        with open(path, encoding="utf-8") as f:
            lines = f.read().split("\n")
    except OSError as e:
        raise ConfigError(f"cannot read the event stream {path}: {e.strerror or e}") from None
    return [_parse(line, f"{path}:{i + 1}") for i, line in enumerate(lines[:-1]) if line.strip()]


def follow(path: str, poll: float = 0.2, wait: float = 60.0, stop: Callable[[], bool] = lambda: False
           ) -> Iterator[dict[str, Any]]:
    """The stream's records as they are written, until its ``run_end`` (or ``stop()``). Waits up
    to ``wait`` seconds for the file to appear (a run still starting)."""
    deadline = time.monotonic() + wait
    while not os.path.exists(path):
        if time.monotonic() > deadline or stop():
            raise ConfigError(f"no event stream at {path} after {wait:.0f} s: is the run started with --report "
                              "or --events there?")
        time.sleep(poll)
    n = 0
    with open(path, encoding="utf-8") as f:
        buf = ""
        while not stop():
            chunk = f.read()
            if not chunk:
                time.sleep(poll)
                continue
            buf += chunk
            *lines, buf = buf.split("\n")
            for line in lines:
                n += 1
                if not line.strip():
                    continue
                rec = _parse(line, f"{path}:{n}")
                yield rec
                if rec["kind"] == "run_end":
                    return
