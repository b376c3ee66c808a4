"""Following a dashboard's event stream over the network (``hotspare events --dashboard
ADDR:PORT``): the records the dashboard of ``hotspare coordinator`` (every job's, each with its
``job``, and the cluster's) or of ``hotspare run`` serves at ``GET /events`` as server-sent
events (hotspare/observe/dashboard.py). It proves the dashboard's token as a bearer token, so
no login session is made; each record is checked against the schema as a file's are
(hotspare.coordinator.events.check_record).

Bounded: a line of the stream longer than ``MAX_LINE`` bytes is skipped, never held whole (said
once, then counted); nothing heard for ``SILENCE_S`` (the dashboard sends a keepalive every
``KEEPALIVE_S``) ends the stream as lost.

``DashboardStream.records()`` ends, with ``ended`` saying why:

- ``"job"``: the followed job's ``run_end`` (``job`` given), or the run's (a ``hotspare run``
  dashboard, whose records carry no job);
- ``"closed"``: the dashboard said it closes (its service or run stops);
- ``"replayed"``: ``live=False`` and the records so far are all in;
- ``"lost"``: the connection ended or went silent without either (``reason`` says how).
"""
from __future__ import annotations

import http.client
import json
import socket
import time
from typing import Any, Callable, Iterator

from hotspare.coordinator.events import check_record
from hotspare.errors import ConfigError
from hotspare.observe.dashboard import JOBS_KEPT, KEEPALIVE_S

MAX_LINE = 1 << 20              # bytes; a cluster record of a thousand 8-device hosts is about 1 MB
SILENCE_S = 3 * KEEPALIVE_S
RETRY_S = 0.5


def read_token(path: str) -> str:
    """The dashboard's token from the file its service or run logged (``... token in FILE``)."""
    try:
        with open(path, encoding="utf-8") as f:
            token = f.read(256).strip()
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"--token-file {path}: cannot read it ({e})") from None
    if not token or not token.isalnum():
        raise ConfigError(f"--token-file {path}: not a dashboard token (the file the dashboard's log line "
                          "names: `dashboard: ... log in with the token in FILE`)")
    return token


class DashboardStream:
    def __init__(self, address: str, token: str, job: str | None = None, live: bool = True, wait: float = 60.0,
                 note: Callable[[str], None] = lambda line: None, silence: float = SILENCE_S):
        """``address``: the dashboard's ADDR:PORT; ``job``: only that job's records (the
        service's job id), ending with its ``run_end``; ``live``: follow (else stop once the
        records so far are in); ``wait``: how long to keep trying to connect; ``note``: where
        remarks go (stderr)."""
        from hotspare.observe.metrics import parse_address
        self.host, self.port = parse_address(address, "--dashboard")
        self.address, self.token, self.job, self.live, self.wait = address, token, job, live, wait
        self.note, self.silence = note, silence
        self.ended: str | None = None
        self.reason = ""
        self.skipped = 0                # records skipped for being longer than MAX_LINE
        self._conn: http.client.HTTPConnection | None = None

    def close(self) -> None:
        if self._conn is not None:
            self._conn.close()

    def _open(self) -> http.client.HTTPResponse:
        deadline = time.monotonic() + self.wait
        while True:
            conn = http.client.HTTPConnection(self.host, self.port, timeout=self.silence)
            try:
                conn.request("GET", "/events", headers={"Authorization": f"Bearer {self.token}",
                                                        "Accept": "text/event-stream"})
                r = conn.getresponse()
                break
            except OSError as e:        # refused: the service may be starting
                conn.close()
                if time.monotonic() >= deadline:
                    raise ConfigError(f"no dashboard at {self.address} ({e.strerror or e}) after {self.wait:.0f} s: "
                                      "give the --dashboard address its service or run logged") from None
                time.sleep(RETRY_S)
        self._conn = conn
        if r.status == 401:
            raise ConfigError(f"the dashboard at {self.address} refused the token: give the --secret-file of its "
                              "service (or run), or --token-file with the file its log names")
        ctype = (r.getheader("Content-Type") or "").split(";")[0].strip()
        if r.status != 200 or ctype != "text/event-stream":
            raise ConfigError(f"{self.address} answered {r.status} {r.reason} ({ctype or 'no content type'}): "
                              "not a hotspare dashboard")
        return r

    def _lines(self, r: http.client.HTTPResponse) -> Iterator[bytes | None]:
        """The stream's lines without their end; None for a line too long to keep (skipped)."""
        while True:
            line = r.readline(MAX_LINE + 1)
            if not line:
                return
            if line.endswith(b"\n"):
                yield line.rstrip(b"\r\n")
                continue
            if len(line) <= MAX_LINE:   # the stream ended inside a line
                return
            while line and not line.endswith(b"\n"):    # the rest of it, read and let go
                line = r.readline(MAX_LINE + 1)
            yield None

    def _events(self, r: http.client.HTTPResponse) -> Iterator[tuple[str, str | None]]:
        """(event type, data) per server-sent event; data None when a line of it was too long."""
        kind, data, torn = "message", [], False
        for line in self._lines(r):
            if line is None:
                torn = True
            elif line == b"":
                if data or torn:
                    yield kind, None if torn else "\n".join(data)
                kind, data, torn = "message", [], False
            elif not line.startswith(b":"):             # a comment (the keepalive) otherwise
                field, _, value = line.decode("utf-8", "replace").partition(":")
                value = value[1:] if value.startswith(" ") else value
                if field == "data":
                    data.append(value)
                elif field == "event":
                    kind = value

    def records(self) -> Iterator[dict[str, Any]]:
        r = self._open()
        seen_job = False
        try:
            for kind, data in self._events(r):
                if kind == "end":
                    self.ended = "closed"
                    return
                if kind == "replayed":
                    if not self.live:
                        self.ended = "replayed"
                        return
                    if self.job is not None and not seen_job:
                        self.note(f"no records of job {self.job} yet (the dashboard keeps those of its last "
                                  f"{JOBS_KEPT} jobs): waiting for them")
                    continue
                if kind != "message":
                    continue
                if data is None:
                    self.skipped += 1
                    if self.skipped == 1:
                        self.note(f"a record longer than {MAX_LINE} bytes was skipped (said once; counted)")
                    continue
                try:
                    rec = check_record(json.loads(data))
                except ValueError as e:     # JSONDecodeError is one
                    raise ConfigError(f"the dashboard at {self.address} sent a record this hotspare cannot read: "
                                      f"{e}") from None
                if self.job is not None and rec.get("job") != self.job:
                    continue
                seen_job = seen_job or self.job is not None
                yield rec
                if rec["kind"] == "run_end" and (self.job is not None or "job" not in rec):
                    self.ended = "job"
                    return
            self.ended, self.reason = "lost", "the connection closed without the dashboard's end"
        except (socket.timeout, TimeoutError):
            self.ended, self.reason = "lost", f"nothing heard for {self.silence:.0f} s"
        except OSError as e:
            self.ended, self.reason = "lost", f"{e.strerror or e}"
        finally:
            self.close()
