"""The live web dashboard of a run (``hotspare run --dashboard ADDR:PORT``): one more sink of the
observer, so the page shows exactly the event stream's records.

- ``GET /`` the page (plain HTML and JavaScript, no build step, nothing fetched from elsewhere:
  hotspare/observe/page.py), ``GET /app.js`` its script, ``GET /events`` the records as
  server-sent events (first the run so far, then each new one), ``GET /api/records`` the run so
  far as JSON.
- Everything but the login needs a session: ``POST /login`` with the token (derived from the
  job's secret; ``hotspare run`` writes it to a private file and logs where) sets an HttpOnly,
  SameSite=Strict cookie. Without one a page request is sent to the login, ``/events`` gets
  401, and any state-changing request (POST, PUT, PATCH, DELETE) is refused with 403 and
  logged with its origin. The run's dashboard is read-only: with a session such a request gets
  405 (cordon, drain and uncordon belong to the coordinator service's dashboard, not built yet).
- Bound where told only (a wildcard is refused), with security headers (no framing, a
  same-origin content policy, no caching).

Memory stays bounded: the last ``COMMITS_KEPT`` committed steps and the latest telemetry of each
node are kept with every other record; a client that cannot keep up is dropped (it reconnects
and replays).
"""
from __future__ import annotations

import collections
import hmac
import json
import queue
import secrets
import socket
import threading
import time
import urllib.parse
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Callable

from hotspare.errors import ConfigError
from hotspare.observe.text import chatty

COMMITS_KEPT = 5000
CLIENT_QUEUE = 10000
KEEPALIVE_S = 15.0
COOKIE = "hotspare_session"
MAX_BODY = 4096
HEADERS = {"X-Frame-Options": "DENY", "X-Content-Type-Options": "nosniff", "Referrer-Policy": "no-referrer",
           "Cache-Control": "no-store",
           "Content-Security-Policy": "default-src 'self'; style-src 'self' 'unsafe-inline'; frame-ancestors 'none'"}


def dashboard_token(secret: bytes) -> str:
    """The login token of a job's dashboard: derived from the job's secret, never the secret."""
    return hmac.new(secret, b"hotspare dashboard", "sha256").hexdigest()


class _Server(ThreadingHTTPServer):
    daemon_threads = True


class Dashboard:
    def __init__(self, host: str, port: int, token: str, log: Callable[[str], None]):
        from hotspare.observe import page
        self.token, self.log, self._page = token, log, page
        self._lock = threading.Lock()
        self._records: list[dict[str, Any]] = []
        self._commits: collections.deque = collections.deque(maxlen=COMMITS_KEPT)
        self._readings: dict[Any, dict[str, Any]] = {}
        self._clients: set[queue.Queue] = set()
        self._sessions: set[str] = set()
        self._closing = threading.Event()
        handler = type("Handler", (_Handler,), {"dash": self})
        _Server.address_family = socket.AF_INET6 if ":" in host else socket.AF_INET
        try:
            self._httpd = _Server((host, port), handler)
        except OSError as e:
            raise ConfigError(f"--dashboard {host}:{port}: cannot listen there ({e.strerror or e}); give a free "
                              "port of an address of this host") from None
        self.host, self.port = host, self._httpd.server_address[1]
        self._thread = threading.Thread(target=self._httpd.serve_forever, name="dashboard", daemon=True)
        self._thread.start()

    @property
    def address(self) -> str:
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"

    # ------------------------------------------------------------------ the observer's sink
    def __call__(self, rec: dict[str, Any]) -> None:
        with self._lock:
            if rec["kind"] == "readings":
                self._readings[rec["data"].get("node")] = rec
            elif chatty(rec):
                self._commits.append(rec)
            else:
                self._records.append(rec)
            for q in list(self._clients):
                try:
                    q.put_nowait(rec)
                except queue.Full:              # too slow: dropped; its page reconnects and replays
                    self._clients.discard(q)
                    q.dropped = True            # type: ignore[attr-defined]

    def snapshot(self) -> list[dict[str, Any]]:
        with self._lock:
            out = [*self._records, *self._commits, *self._readings.values()]
        return sorted(out, key=lambda r: r["t"])

    def subscribe(self) -> tuple[list[dict[str, Any]], queue.Queue]:
        q: queue.Queue = queue.Queue(maxsize=CLIENT_QUEUE)
        with self._lock:
            self._clients.add(q)
            past = sorted([*self._records, *self._commits, *self._readings.values()], key=lambda r: r["t"])
        return past, q

    def unsubscribe(self, q: queue.Queue) -> None:
        with self._lock:
            self._clients.discard(q)

    # ------------------------------------------------------------------ sessions
    def login(self, token: str) -> str | None:
        if not hmac.compare_digest(token.strip().encode(), self.token.encode()):
            return None
        session = secrets.token_urlsafe(32)
        with self._lock:
            self._sessions.add(session)
        return session

    def valid(self, session: str | None) -> bool:
        if not session:
            return False
        with self._lock:
            return any(hmac.compare_digest(session.encode(), s.encode()) for s in self._sessions)

    def close(self) -> None:
        self._closing.set()
        with self._lock:
            for q in self._clients:
                try:
                    q.put_nowait(None)
                except queue.Full:
                    pass
        self._httpd.shutdown()
        self._httpd.server_close()
        self._thread.join(timeout=5.0)


class _Handler(BaseHTTPRequestHandler):
    dash: Dashboard
    server_version = "hotspare"
    sys_version = ""

    def log_message(self, format: str, *args: Any) -> None:     # noqa: A002 - no line per request
        pass

    def _session(self) -> str | None:
        for part in self.headers.get("Cookie", "").split(";"):
            name, _, value = part.strip().partition("=")
            if name == COOKIE:
                return value
        return None

    def _send(self, code: int, body: bytes | str, ctype: str = "text/html; charset=utf-8",
              extra: dict[str, str] | None = None) -> None:
        data = body.encode() if isinstance(body, str) else body
        self.send_response(code)
        for k, v in {**HEADERS, "Content-Type": ctype, "Content-Length": str(len(data)), **(extra or {})}.items():
            self.send_header(k, v)
        self.end_headers()
        self.wfile.write(data)

    def _origin(self) -> str:
        return f"{self.client_address[0]}:{self.client_address[1]}"

    def do_GET(self) -> None:       # noqa: N802 - http.server's name
        path = urllib.parse.urlsplit(self.path).path
        if path == "/login":
            return self._send(200, self.dash._page.LOGIN.replace("{error}", ""))
        if not self.dash.valid(self._session()):
            if path in ("/events", "/api/records", "/app.js"):
                return self._send(401, "log in first: /login\n", "text/plain; charset=utf-8")
            return self._send(303, "", extra={"Location": "/login"})
        if path == "/":
            return self._send(200, self.dash._page.PAGE)
        if path == "/app.js":
            return self._send(200, self.dash._page.SCRIPT, "text/javascript; charset=utf-8")
        if path == "/api/records":
            return self._send(200, json.dumps(self.dash.snapshot()), "application/json")
        if path == "/events":
            return self._stream()
        return self._send(404, "not found\n", "text/plain; charset=utf-8")

    def _stream(self) -> None:
        past, q = self.dash.subscribe()
        try:
            self.send_response(200)
            for k, v in {**HEADERS, "Content-Type": "text/event-stream", "Connection": "keep-alive"}.items():
                self.send_header(k, v)
            self.end_headers()
            for rec in past:
                self.wfile.write(f"data: {json.dumps(rec)}\n\n".encode())
            self.wfile.flush()
            while not self.dash._closing.is_set():
                try:
                    rec = q.get(timeout=KEEPALIVE_S)
                except queue.Empty:
                    if getattr(q, "dropped", False):
                        break
                    self.wfile.write(b": keepalive\n\n")
                    self.wfile.flush()
                    continue
                if rec is None:
                    break
                self.wfile.write(f"data: {json.dumps(rec)}\n\n".encode())
                self.wfile.flush()
        except OSError:
            pass                                # the browser went away
        finally:
            self.dash.unsubscribe(q)

    def do_POST(self) -> None:      # noqa: N802
        path = urllib.parse.urlsplit(self.path).path
        if path != "/login":
            return self._refuse("POST")
        length = int(self.headers.get("Content-Length") or 0)
        if length > MAX_BODY:
            return self._send(413, "too long\n", "text/plain; charset=utf-8")
        form = urllib.parse.parse_qs(self.rfile.read(length).decode("utf-8", "replace"))
        session = self.dash.login((form.get("token") or [""])[0])
        if session is None:
            self.dash.log(f"DASHBOARD refused a login from {self._origin()}: wrong token")
            time.sleep(0.2)                     # a guess costs time
            return self._send(401, self.dash._page.LOGIN.replace("{error}", "wrong token"))
        self._send(303, "", extra={"Location": "/",
                                   "Set-Cookie": f"{COOKIE}={session}; HttpOnly; SameSite=Strict; Path=/"})

    def _refuse(self, method: str) -> None:
        path = urllib.parse.urlsplit(self.path).path[:200]
        if not self.dash.valid(self._session()):
            self.dash.log(f"DASHBOARD refused {method} {path} from {self._origin()}: not logged in")
            return self._send(403, "refused: log in first\n", "text/plain; charset=utf-8")
        self.dash.log(f"DASHBOARD refused {method} {path} from {self._origin()}: this dashboard is read-only")
        self._send(405, "this dashboard is read-only\n", "text/plain; charset=utf-8")

    def do_PUT(self) -> None:       # noqa: N802
        self._refuse("PUT")

    def do_DELETE(self) -> None:    # noqa: N802
        self._refuse("DELETE")

    def do_PATCH(self) -> None:     # noqa: N802
        self._refuse("PATCH")
