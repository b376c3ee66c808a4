"""The live web dashboard of a run (``hotspare run --dashboard ADDR:PORT``) and of the coordinator
service (``hotspare coordinator --dashboard ADDR:PORT``): one more sink of the observer, so the
page shows exactly the event stream's records.

- ``GET /`` the page (plain HTML and JavaScript, no build step, nothing fetched from elsewhere:
  hotspare/observe/page.py), ``GET /app.js`` its script, ``GET /events`` the records as
  server-sent events (first the run so far, then each new one), ``GET /api/records`` the run so
  far as JSON.
- Everything but the login needs a session: ``POST /login`` with the token (derived from the
  secret; ``hotspare run`` and ``hotspare coordinator`` write it to a private file and log where)
  sets an HttpOnly, SameSite=Strict cookie. Without one a page request is sent to the login,
  ``/events`` and ``/api/records`` get 401 (logged with the origin), and any state-changing
  request (POST, PUT, PATCH, DELETE) is refused with 403 and logged with its origin. The run's
  dashboard is read-only: with a session such a request gets 405.
- A program reads ``/events`` and ``/api/records`` with the token itself instead of a session
  (``Authorization: Bearer TOKEN``, compared in constant time; ``hotspare events --follow
  --dashboard``): no login, so no session of a browser is pushed out. A wrong token is refused
  with 401 and logged, after a pause; the bearer token opens nothing else (not the page, not an
  action).
- The stream (``/events``): each record as a ``data:`` line; after the records so far, an
  ``event: replayed``; when the dashboard closes (its service or run stops), an ``event: end``
  before the connection closes (a client dropped for being too slow gets none). A browser's
  EventSource ignores both.
- The service's dashboard (``operator`` given: hotspare/observe/cluster.py) takes one
  state-changing request, ``POST /api/action``: cordon, drain or uncordon a device or every device
  of a host. Each is refused (and logged) unless it carries, besides the session cookie, the
  session's own nonce in ``X-Hotspare-Nonce`` (written into the page it was served with: a page
  of another site cannot read it, and a custom header cannot be sent across origins without a
  preflight this server never grants), an ``Origin`` of this server when the browser sends one,
  a JSON body of at most ``MAX_BODY`` bytes with exactly the fields ``action``, ``target``,
  ``confirm`` and optionally ``reason``, and ``confirm`` equal to ``target``: the page sends it
  only after its confirmation dialog. Every accepted action is logged with its origin.
- Bound where told only (a wildcard is refused), with security headers (no framing, a
  same-origin content policy, no caching).

Memory stays bounded: the last ``COMMITS_KEPT`` committed steps and the latest telemetry of each
node (and the latest ``cluster`` record) are kept with every other record; on the service's
dashboard, the records of its last ``JOBS_KEPT`` jobs only; the last ``SESSIONS_KEPT`` logins. A
client that cannot keep up is dropped (it reconnects and replays).
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

from hotspare.errors import ConfigError, HotspareError
from hotspare.observe.cluster import ACTIONS, REASON_MAX
from hotspare.observe.text import chatty

COMMITS_KEPT = 5000
JOBS_KEPT = 3             # the service's dashboard: the page shows the newest, or one of these chosen
SESSIONS_KEPT = 64        # logins; an older session must log in again
CLIENT_QUEUE = 10000
KEEPALIVE_S = 15.0
CLOSE_WAIT_S = 2.0        # how long closing waits for the streams to send their end
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
    def __init__(self, host: str, port: int, token: str, log: Callable[[str], None], operator=None):
        """``operator``: carries out cordon, drain and uncordon (hotspare.observe.cluster.Operator);
        None: the dashboard is read-only."""
        from hotspare.observe import page
        self.token, self.log, self._page, self.operator = token, log, page, operator
        self._lock = threading.Lock()
        self._records: list[dict[str, Any]] = []
        self._commits: collections.deque = collections.deque(maxlen=COMMITS_KEPT)
        self._readings: dict[Any, dict[str, Any]] = {}
        self._cluster: dict[str, Any] | None = None
        self._jobs: list[str] = []                  # the service's jobs seen, oldest first
        self._clients: set[queue.Queue] = set()
        self._sessions: dict[str, str] = {}        # session -> its nonce for state-changing requests
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
            if rec["kind"] == "run_start" and rec.get("job") is not None:
                self._new_job(rec["job"])
            if rec["kind"] == "readings":
                self._readings[(rec.get("job"), rec["data"].get("node"))] = rec
            elif rec["kind"] == "cluster":
                self._cluster = rec
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

    def _new_job(self, job: str) -> None:
        """(Under the lock.) A job of the service started: the records of all but the last
        ``JOBS_KEPT`` go."""
        self._jobs.append(job)
        gone, self._jobs = set(self._jobs[:-JOBS_KEPT]), self._jobs[-JOBS_KEPT:]
        if gone:
            self._records = [r for r in self._records if r.get("job") not in gone]
            self._commits = collections.deque((r for r in self._commits if r.get("job") not in gone),
                                              maxlen=COMMITS_KEPT)
            self._readings = {k: r for k, r in self._readings.items() if r.get("job") not in gone}

    def _kept(self) -> list[dict[str, Any]]:
        """(Under the lock.) Every record kept, oldest first."""
        cluster = [self._cluster] if self._cluster is not None else []
        return sorted([*self._records, *self._commits, *self._readings.values(), *cluster], key=lambda r: r["t"])

    def snapshot(self) -> list[dict[str, Any]]:
        with self._lock:
            return self._kept()

    def subscribe(self) -> tuple[list[dict[str, Any]], queue.Queue]:
        q: queue.Queue = queue.Queue(maxsize=CLIENT_QUEUE)
        with self._lock:
            self._clients.add(q)
            past = self._kept()
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
            self._sessions[session] = secrets.token_urlsafe(32)
            while len(self._sessions) > SESSIONS_KEPT:
                del self._sessions[next(iter(self._sessions))]      # the oldest login
        return session

    def _known(self, session: str | None) -> str | None:
        """The session as kept (compared in constant time), None if it is not one."""
        if not session:
            return None
        with self._lock:
            return next((s for s in self._sessions if hmac.compare_digest(session.encode(), s.encode())), None)

    def valid(self, session: str | None) -> bool:
        return self._known(session) is not None

    def nonce(self, session: str | None) -> str | None:
        """The nonce a state-changing request of ``session`` must carry (None: no such session)."""
        known = self._known(session)
        with self._lock:
            return self._sessions.get(known) if known is not None else None

    def close(self) -> None:
        self._closing.set()
        with self._lock:
            for q in self._clients:
                try:
                    q.put_nowait(None)
                except queue.Full:
                    pass
        deadline = time.monotonic() + CLOSE_WAIT_S      # each stream says its end before the process may go
        while time.monotonic() < deadline:
            with self._lock:
                if not self._clients:
                    break
            time.sleep(0.02)
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

    def _reader(self, path: str) -> bool:
        """May this request read ``path`` (a session, or the token as a bearer token)? If not,
        it is answered (401) and logged here."""
        scheme, _, given = self.headers.get("Authorization", "").partition(" ")
        if scheme.lower() == "bearer":
            if hmac.compare_digest(given.strip().encode(), self.dash.token.encode()):
                return True
            self.dash.log(f"DASHBOARD refused GET {path[:200]} from {self._origin()}: wrong token")
            time.sleep(0.2)                     # a guess costs time
            self._send(401, "wrong token\n", "text/plain; charset=utf-8")
            return False
        if self.dash.valid(self._session()):
            return True
        self.dash.log(f"DASHBOARD refused GET {path[:200]} from {self._origin()}: not logged in")
        self._send(401, "log in first: /login (or send the token: Authorization: Bearer TOKEN)\n",
                   "text/plain; charset=utf-8")
        return False

    def do_GET(self) -> None:       # noqa: N802 - http.server's name
        path = urllib.parse.urlsplit(self.path).path
        if path == "/login":
            return self._send(200, self.dash._page.LOGIN.replace("{error}", ""))
        if path in ("/events", "/api/records"):
            if not self._reader(path):
                return None
            return self._stream() if path == "/events" else \
                self._send(200, json.dumps(self.dash.snapshot()), "application/json")
        if not self.dash.valid(self._session()):
            if path == "/app.js":
                return self._send(401, "log in first: /login\n", "text/plain; charset=utf-8")
            return self._send(303, "", extra={"Location": "/login"})
        if path == "/":
            page = self.dash._page.PAGE
            if self.dash.operator is not None:       # the nonce, for this session's actions only
                page = page.replace("<head>", f'<head><meta name="hotspare-nonce" '
                                              f'content="{self.dash.nonce(self._session())}">', 1)
            return self._send(200, page)
        if path == "/app.js":
            return self._send(200, self.dash._page.SCRIPT, "text/javascript; charset=utf-8")
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
            self.wfile.write(b"event: replayed\ndata: the records so far were sent\n\n")
            self.wfile.flush()
            while True:
                try:
                    rec = q.get(timeout=KEEPALIVE_S)
                except queue.Empty:
                    if getattr(q, "dropped", False):
                        break                   # no end: the client reconnects and replays
                    if not self.dash._closing.is_set():
                        self.wfile.write(b": keepalive\n\n")
                        self.wfile.flush()
                        continue
                    rec = None                  # closing, and its None did not fit in the queue
                if rec is None:                 # closing: the service or the run stops
                    self.wfile.write(b"event: end\ndata: the dashboard closes\n\n")
                    self.wfile.flush()
                    break
                self.wfile.write(f"data: {json.dumps(rec)}\n\n".encode())
                self.wfile.flush()
        except OSError:
            pass                                # the browser went away
        finally:
            self.dash.unsubscribe(q)

    def do_POST(self) -> None:      # noqa: N802
        path = urllib.parse.urlsplit(self.path).path
        if path == "/api/action" and self.dash.operator is not None and self.dash.valid(self._session()):
            return self._action()
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
        if self.dash.operator is not None:
            self.dash.log(f"DASHBOARD refused {method} {path} from {self._origin()}: not an action")
            return self._send(404, "the one action is POST /api/action\n", "text/plain; charset=utf-8")
        self.dash.log(f"DASHBOARD refused {method} {path} from {self._origin()}: this dashboard is read-only")
        self._send(405, "this dashboard is read-only\n", "text/plain; charset=utf-8")

    def _action(self) -> None:
        """A logged-in ``POST /api/action``: checked in full before anything moves; each refusal
        and each action logged with its origin."""
        def refuse(code: int, why: str) -> None:
            self.dash.log(f"DASHBOARD refused POST /api/action from {self._origin()}: {why}")
            self._send(code, json.dumps({"ok": False, "message": why}), "application/json")
        origin = self.headers.get("Origin")
        if origin is not None and origin != f"http://{self.headers.get('Host', '')}":
            return refuse(403, f"from another origin ({origin[:100]!r})")
        nonce = self.dash.nonce(self._session()) or ""
        if not hmac.compare_digest(self.headers.get("X-Hotspare-Nonce", "").encode(), nonce.encode()):
            return refuse(403, "without this session's nonce (reload the page)")
        if self.headers.get("Content-Type", "").split(";")[0].strip() != "application/json":
            return refuse(415, "the body must be application/json")
        try:
            length = int(self.headers.get("Content-Length", ""))
        except ValueError:
            return refuse(411, "no Content-Length")
        if not 0 < length <= MAX_BODY:
            return refuse(413, f"a body of {length} bytes (at most {MAX_BODY})")
        try:
            req = json.loads(self.rfile.read(length))
            action, target, reason = _checked(req)
        except (ValueError, UnicodeDecodeError) as e:
            return refuse(400, str(e))
        if req["confirm"] != target:
            return refuse(400, f"{action} {target} not confirmed: send confirm equal to the target "
                               f"({target!r}) once the operator has confirmed it")
        why = f"{reason} (dashboard, {self.client_address[0]})"
        try:
            done = self.dash.operator.apply(action, target, why)
        except (HotspareError, ValueError) as e:
            return refuse(409, f"{action} {target}: {e}")
        moves = ", ".join(f"{m['device']} {m['from']} -> {m['to']}" for m in done["moved"]) or "nothing to do"
        self.dash.log(f"DASHBOARD {action} {target} by {self._origin()}: {moves} ({reason})")
        for note in done["notes"]:
            self.dash.log(f"DASHBOARD {note}")
        self._send(200, json.dumps({"ok": True, "message": f"{action} {target}: {moves}", **done}),
                   "application/json")

    def do_PUT(self) -> None:       # noqa: N802
        self._refuse("PUT")

    def do_DELETE(self) -> None:    # noqa: N802
        self._refuse("DELETE")

    def do_PATCH(self) -> None:     # noqa: N802
        self._refuse("PATCH")


FIELDS = frozenset({"action", "target", "confirm", "reason"})


def _checked(req: Any) -> tuple[str, str, str]:
    """(action, target, reason) of an action's body; ValueError, saying what is wrong, otherwise.
    Whether ``target`` names a host or device here is the operator's to say."""
    if not isinstance(req, dict):
        raise ValueError("the body must be a JSON object")
    extra = set(req) - FIELDS
    if extra or not {"action", "target", "confirm"} <= set(req):
        raise ValueError("the fields are action, target, confirm and optionally reason"
                         + (f" (not {', '.join(sorted(repr(str(k)[:32]) for k in extra))})" if extra else ""))
    action, target, reason = req["action"], req["target"], req.get("reason", "by the operator")
    if action not in ACTIONS:
        raise ValueError(f"action must be one of {', '.join(ACTIONS)}")
    if not isinstance(target, str) or not 0 < len(target) <= 128 or not target.isprintable():
        raise ValueError("target must be a host or device name")
    if not isinstance(reason, str) or len(reason) > REASON_MAX or not reason.isprintable():
        raise ValueError(f"reason must be printable text of at most {REASON_MAX} characters")
    return action, target, reason.strip() or "by the operator"
