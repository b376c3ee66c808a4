"""The coordinator service with its dashboard, for the dashboard's tests: the service in this
process (tests/service/svcloop.py), its ``ServiceWatch`` with the dashboard on loopback, real
HTTP requests, a login with the token and the nonce its page carries."""
import http.client
import json
import os
import re
import sys
import time
import urllib.parse
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "service"))
from svcloop import Log, Loopback  # noqa: E402

from hotspare.observe.dashboard import dashboard_token  # noqa: E402
from hotspare.observe.service import ServiceWatch  # noqa: E402
from hotspare.protocol import auth  # noqa: E402

DEVICE = "hosta/cpu1"


class Cluster:
    def __init__(self, tmp_path: Path):
        self.secret_file = secret_file = tmp_path / "secret"
        secret_file.write_text(os.urandom(32).hex())
        secret_file.chmod(0o600)
        self.said = Log()
        self.watch = ServiceWatch.start(None, "127.0.0.1:0", auth.load_secret(str(secret_file)), self.said)
        self.pool = Loopback(str(tmp_path / "state"), str(secret_file), observe=self.watch.install)
        self.watch.attach(self.pool.svc)
        self.dash, self.registry = self.watch.dashboard, self.pool.svc.registry
        self.token = dashboard_token(auth.load_secret(str(secret_file)))

    def request(self, method: str, path: str, body: bytes | str | None = None, headers: dict | None = None):
        conn = http.client.HTTPConnection("127.0.0.1", self.dash.port, timeout=10)
        conn.request(method, path, body=body, headers=headers or {})
        r = conn.getresponse()
        return r, r.read().decode()

    def login(self) -> tuple[str, str]:
        """A session: its cookie, and the nonce its page carries."""
        r, _ = self.request("POST", "/login", urllib.parse.urlencode({"token": self.token}),
                            {"Content-Type": "application/x-www-form-urlencoded"})
        cookie = r.getheader("Set-Cookie").split(";")[0]
        _, page = self.request("GET", "/", headers={"Cookie": cookie})
        return cookie, re.search(r'<meta name="hotspare-nonce" content="([^"]+)">', page).group(1)

    def act(self, fields: dict, cookie: str | None = None, nonce: str | None = None, **headers):
        hdrs = {"Content-Type": "application/json", **headers}
        if cookie:
            hdrs["Cookie"] = cookie
        if nonce:
            hdrs["X-Hotspare-Nonce"] = nonce
        r, body = self.request("POST", "/api/action", json.dumps(fields), hdrs)
        return r.status, (json.loads(body) if body.startswith("{") else body)

    def state(self, device: str = DEVICE) -> str:
        rec = self.registry.find(device)
        return rec.state.value if rec else "no record"

    def shown(self, device: str, state: str, timeout: float = 30) -> None:
        """Wait until the dashboard's cluster record shows ``device`` in ``state``."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            recs = [r for r in self.dash.snapshot() if r["kind"] == "cluster"]
            if recs and any(d["device"] == device and d["state"] == state for d in recs[-1]["data"]["devices"]):
                return
            time.sleep(0.1)
        raise AssertionError(f"the dashboard never showed {device} {state}: {recs[-1:] if recs else 'nothing'}")

    def close(self) -> None:
        self.pool.close()
        self.watch.close()
