"""A real Prometheus server (Debian's ``prometheus``; .ci/run installs it) on loopback, started
and stopped by the test that asks for it, scraping one target every half second."""
import json
import shutil
import socket
import subprocess
import time
import urllib.parse
import urllib.request

import pytest


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Prometheus:
    def __init__(self, proc: subprocess.Popen, port: int, log: str):
        self.proc, self.port, self.log = proc, port, log

    def get(self, path: str, **params) -> dict:
        url = f"http://127.0.0.1:{self.port}{path}?{urllib.parse.urlencode(params)}"
        with urllib.request.urlopen(url, timeout=5) as r:
            return json.load(r)

    def query(self, promql: str) -> list[dict]:
        """An instant query's result vector."""
        answer = self.get("/api/v1/query", query=promql)
        assert answer["status"] == "success", answer
        return answer["data"]["result"]

    def value(self, promql: str) -> float | None:
        """The value of a query with one sample (None: no sample)."""
        result = self.query(promql)
        assert len(result) <= 1, result
        return float(result[0]["value"][1]) if result else None

    def targets(self) -> list[dict]:
        return self.get("/api/v1/targets")["data"]["activeTargets"]

    def output(self) -> str:
        with open(self.log) as f:
            return f.read()[-4000:]


@pytest.fixture(scope="module")
def prometheus(tmp_path_factory):
    """``start(target)``: a Prometheus scraping ``target`` (HOST:PORT) every 0.5 s."""
    tmp_path = tmp_path_factory.mktemp("prometheus")
    binary = shutil.which("prometheus")
    if binary is None:
        pytest.fail("no `prometheus` binary: apt-get install -y prometheus (.ci/run does)")
    started: list[subprocess.Popen] = []

    def start(target: str) -> Prometheus:
        config = tmp_path / "prometheus.yml"
        config.write_text(
            "global:\n  scrape_interval: 500ms\n  scrape_timeout: 400ms\n  evaluation_interval: 10s\n"
            f"scrape_configs:\n  - job_name: hotspare\n    static_configs:\n      - targets: ['{target}']\n")
        port = free_port()
        log = str(tmp_path / "prometheus.log")
        proc = subprocess.Popen(
            [binary, f"--config.file={config}", f"--storage.tsdb.path={tmp_path / 'tsdb'}",
             f"--web.listen-address=127.0.0.1:{port}", "--log.level=warn"],
            stdout=open(log, "w"), stderr=subprocess.STDOUT, cwd=tmp_path)
        started.append(proc)
        prom = Prometheus(proc, port, log)
        deadline = time.monotonic() + 30
        while True:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/-/ready", timeout=2) as r:
                    if r.status == 200:
                        return prom
            except OSError:
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                raise AssertionError(f"prometheus did not become ready:\n{prom.output()}")
            time.sleep(0.1)

    yield start
    for proc in started:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
