"""Progress of a long command on stderr: runs done of the total, the time elapsed and an estimate
of the time left (from the mean time per run so far).

On a terminal one line is redrawn in place (about once a second while the command waits, and at
every run done); lines the command prints meanwhile go through ``print`` so they land above it.
Anywhere else (a log file, CI) a plain line is written at most every ``period_s`` seconds, so a
quick command writes none and a long one leaves a readable trail. No dependency: the few lines
below are all of it.

    with Progress("chaos", total=2, unit="runs") as bar:
        for run in runs:
            do(run)
            bar.advance()
"""
from __future__ import annotations

import os
import sys
import threading
import time
from typing import Callable, TextIO

PERIOD_S = 30.0          # a plain line at most this often when stderr is not a terminal
REDRAW_S = 1.0           # the terminal line's redraw, while nothing else happens
DELAY_S = 1.0            # no terminal line for a command that is over sooner
MIN_REDRAW_S = 0.1       # a fast loop redraws the terminal line at most this often (and at its end)
WIDTH = 24               # of the bar, in characters


def duration(s: float) -> str:
    """``42s``, ``3m05s``, ``2h07m``."""
    s = max(0, int(round(s)))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m"


def is_terminal(stream: TextIO) -> bool:
    try:
        return stream.isatty() and os.environ.get("TERM") != "dumb"
    except (AttributeError, ValueError):          # closed, or not a real stream
        return False


class Progress:
    def __init__(self, what: str, total: int, unit: str = "runs", stream: TextIO | None = None,
                 tty: bool | None = None, period_s: float = PERIOD_S, delay_s: float = DELAY_S,
                 clock: Callable[[], float] = time.monotonic, redraw: bool = True):
        """``tty``: draw in place (default: whether ``stream`` is a terminal); ``delay_s``: draw
        nothing on a terminal before then (a quick command leaves no bar behind); ``redraw``: a
        thread updates the elapsed time while nothing else happens (tests turn it off and drive
        ``clock``)."""
        self.what, self.total, self.unit = what, max(0, int(total)), unit
        self.stream = stream if stream is not None else sys.stderr
        self.tty = is_terminal(self.stream) if tty is None else tty
        self.period_s, self.delay_s, self.clock = period_s, delay_s, clock
        self.done = 0
        self.t0 = self._done_at = clock()
        self._said_at = self.t0            # the last plain line (or the start)
        self._drawn = False                # a terminal line is on screen
        self._drawn_at = float("-inf")
        self._was_drawn = False
        self._lock = threading.Lock()
        self._closed = threading.Event()
        self._thread = None
        if redraw:
            self._thread = threading.Thread(target=self._tick, name="progress", daemon=True)
            self._thread.start()

    # ------------------------------------------------------------------ what callers use
    def advance(self, n: int = 1) -> None:
        """``n`` more runs are done."""
        with self._lock:
            self.done += n
            self.total = max(self.total, self.done)
            self._done_at = self.clock()
            self._show()

    def grow(self, n: int = 1) -> None:
        """The total turned out ``n`` larger (a run the plan did not foresee)."""
        with self._lock:
            self.total += n

    def print(self, line: str, file: TextIO | None = None) -> None:
        """Print ``line`` (to stdout by default) above the progress line."""
        with self._lock:
            self._clear()
            print(line, file=file if file is not None else sys.stdout, flush=True)
            if self.tty and self.done < self.total and self._was_drawn:
                self._show(redraw=True)

    def close(self) -> None:
        """The command is over: the terminal line is left as the last word; a plain line is
        written if any was written before (the trail ends at its end)."""
        self._closed.set()
        if self._thread is not None:
            self._thread.join(timeout=2 * REDRAW_S)
        with self._lock:
            if self.tty:
                if self._drawn:
                    self.stream.write("\n")
                    self.stream.flush()
                    self._drawn = False
            elif self._said_at > self.t0:
                self._write_line()

    def __enter__(self) -> "Progress":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ------------------------------------------------------------------ the text
    def text(self) -> str:
        """``chaos  1/2 runs  [############............]  50%  elapsed 1m02s  left ~1m02s``."""
        now = self.clock()
        elapsed = now - self.t0
        share = self.done / self.total if self.total else 0.0
        filled = int(WIDTH * share)
        if not self.done:
            left = "left ?"
        else:       # the mean run so far, for the runs to come, less what the current one has had
            due = (self._done_at - self.t0) / self.done * (self.total - self.done) - (now - self._done_at)
            left = f"left ~{duration(due)}" if due > 0 or self.done == self.total else "left: over the mean run"
        bar = "[" + "#" * filled + "." * (WIDTH - filled) + "]"
        return (f"{self.what}  {self.done}/{self.total} {self.unit}  " + (f"{bar}  " if self.tty else "")
                + f"{100 * share:3.0f}%  elapsed {duration(elapsed)}  {left}")

    # ------------------------------------------------------------------ drawing (under the lock)
    def _show(self, redraw: bool = False) -> None:
        """Draw (a terminal) or write (elsewhere) the line if it is due; ``redraw``: the line
        was just cleared, put it back now."""
        if self._closed.is_set():
            return
        if self.tty:
            now = self.clock()
            if now - self.t0 < self.delay_s or (
                    not redraw and self.done < self.total and now - self._drawn_at < MIN_REDRAW_S):
                return
            self.stream.write("\r\x1b[K" + self.text())
            self.stream.flush()
            self._drawn, self._drawn_at = True, now
        elif self.clock() - self._said_at >= self.period_s:
            self._write_line()

    def _write_line(self) -> None:
        self.stream.write(self.text() + "\n")
        self.stream.flush()
        self._said_at = self.clock()

    def _clear(self) -> None:
        self._was_drawn = self._drawn
        if self.tty and self._drawn:
            self.stream.write("\r\x1b[K")
            self.stream.flush()
            self._drawn = False

    def _tick(self) -> None:
        wait = REDRAW_S if self.tty else min(REDRAW_S * 5, self.period_s)
        while not self._closed.wait(wait):
            with self._lock:
                try:
                    self._show()
                except (OSError, ValueError):        # the stream went away: stop drawing, never fail the command
                    return
