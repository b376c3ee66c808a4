"""In a real headless Chromium (Debian's chromium + chromium-driver, driven by Selenium): the
dashboard of a running job asks for the token, then shows the job live; when rank 2's device
reports Xid 79 (the GPU fell off the bus) the timeline shows the failure and the recovery and
the device's tile changes colour from healthy. The coordinator service's dashboard shows its
agent's host and devices; an operator clicks cordon on a device, the page asks for a
confirmation, and once confirmed the tile changes colour (a dismissed dialog changes nothing).
The service's page shows its newest job, and another one chosen in its job selector.
Screenshots are kept ($HOTSPARE_ARTIFACTS, or the test's temp folder)."""
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hotspare.testing.local import EXAMPLE

pytestmark = pytest.mark.slow


def _browser():
    try:
        from selenium import webdriver
    except ImportError:
        pytest.fail("no selenium: pip install -e '.[test]'")
    from selenium.webdriver.chrome.service import Service
    binary, driver = shutil.which("chromium"), shutil.which("chromedriver")
    if not (binary and driver):
        pytest.fail("no chromium/chromedriver: apt-get install -y chromium chromium-driver (.ci/run does)")
    opts = webdriver.ChromeOptions()
    opts.binary_location = binary
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--window-size=1400,1300"):
        opts.add_argument(arg)
    return webdriver.Chrome(options=opts, service=Service(driver))


def _wait(what, predicate, timeout, job=None):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        if job is not None and job.poll() is not None:
            raise AssertionError(f"the job ended (exit {job.returncode}) before {what}")
        time.sleep(0.3)
    raise AssertionError(f"no {what} within {timeout} s")


def test_dashboard_shows_the_failure_the_recovery_and_the_device_turning_unhealthy(tmp_path):
    artifacts = Path(os.environ.get("HOTSPARE_ARTIFACTS", tmp_path))
    artifacts.mkdir(parents=True, exist_ok=True)
    log = tmp_path / "job.log"
    # The browser shares the test machine's cores with the job: slow steps there are contention,
    # not a straggling device, and a straggler migration would take the spare the Xid needs.
    rules = tmp_path / "rules.toml"
    rules.write_text('[[rule]]\nname = "straggler"\nwhen = "straggler_score < policy.straggler_score_min"\n'
                     'held = 5\naction = "watch"\nreason = "straggler (watched only in this test)"\n')
    job = subprocess.Popen([sys.executable, "-m", "hotspare", "run", "--nproc", "4", "--spares", "1",
                            "--health-rules", str(rules), "--dashboard", "127.0.0.1:0", "--inject", "xid:rank=2:step=60:code=79", "--",
                            str(EXAMPLE), "--model", "tiny", "--steps", "400"],
                           stdout=open(log, "w"), stderr=subprocess.STDOUT,
                           env={**os.environ, "OMP_NUM_THREADS": "1"}, start_new_session=True)
    browser = None
    try:
        line = _wait("dashboard line", lambda: re.search(r"dashboard: (http://\S+) .*token in (\S+)\)",
                                                         log.read_text()), 60, job)
        url, token = line.group(1), Path(line.group(2)).read_text().strip()
        browser = _browser()
        browser.get(url)
        assert browser.current_url.endswith("/login")         # nothing but the login without the token
        assert browser.execute_script("return document.getElementById('timeline')") is None
        browser.execute_script("document.getElementById('token').value = arguments[0]", token)
        browser.execute_script("document.getElementById('login').click()")
        _wait("running status", lambda: browser.execute_script(
            "const s = document.getElementById('status'); return s && s.textContent === 'running'"), 60, job)

        def js(code, *args):        # read the page in one go: it re-renders as records arrive
            return browser.execute_script(code, *args)
        device = _wait("rank 2 on a device tile", lambda: js(
            "const t = [...document.querySelectorAll('.dev')].find(t => t.textContent.includes('rank 2'));"
            "return t ? t.dataset.device : null;"), 90, job)
        tile = ("const t = [...document.querySelectorAll('.dev')].find(t => t.dataset.device === arguments[0]);"
                "return t ? [t.dataset.state, getComputedStyle(t).backgroundColor] : null;")
        state, before = js(tile, device)
        assert state == "healthy", state

        _wait("failure in the timeline", lambda: js("return document.querySelector('[data-kind=failure]') !== null"),
              120, job)
        _wait("recovery in the timeline", lambda: js("return document.querySelector('[data-kind=recovered]') !== null"),
              60, job)
        state, after = _wait("rank 2's old device out of service", lambda: (
            v if (v := js(tile, device)) and v[0] != "healthy" else None), 30, job)
        assert state in ("cordoned", "quarantined"), state
        assert after != before, (before, after)
        text = js("return document.getElementById('timeline').innerText")
        assert "FAILURE rank 2" in text and "health:gpu-lost" in text and "RECOVERED" in text, text
        assert "lost steps 0" in text
        browser.save_screenshot(str(artifacts / "dashboard.png"))
    finally:
        if browser is not None:
            browser.quit()
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGTERM)
            try:
                job.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(job.pid, signal.SIGKILL)
                job.wait()


def test_service_dashboard_cordons_a_device_after_a_confirmation(tmp_path):
    import secrets as _secrets

    from selenium.webdriver.common.by import By
    from selenium.webdriver.support import expected_conditions
    from selenium.webdriver.support.ui import WebDriverWait

    import socket
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    artifacts = Path(os.environ.get("HOTSPARE_ARTIFACTS", tmp_path))
    artifacts.mkdir(parents=True, exist_ok=True)
    secret = tmp_path / "secret"
    secret.write_text(_secrets.token_hex(32))
    secret.chmod(0o600)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    log, agent_log = tmp_path / "service.log", tmp_path / "agent.log"
    procs = [subprocess.Popen([sys.executable, "-m", "hotspare", "coordinator", "--listen", f"127.0.0.1:{port}",
                               "--state", str(tmp_path / "state"), "--secret-file", str(secret),
                               "--dashboard", "127.0.0.1:0"], stdout=open(log, "w"), stderr=subprocess.STDOUT,
                              env=env, start_new_session=True)]
    browser = None
    try:
        line = _wait("dashboard line", lambda: re.search(r"dashboard: (http://\S+) .*token in (\S+)\)",
                                                         log.read_text()), 60, procs[0])
        url, token = line.group(1), Path(line.group(2)).read_text().strip()
        procs.append(subprocess.Popen([sys.executable, "-m", "hotspare", "agent", "--coordinator", f"127.0.0.1:{port}",
                                       "--secret-file", str(secret), "--devices", "cpu:2", "--name", "hosta"],
                                      stdout=open(agent_log, "w"), stderr=subprocess.STDOUT, env=env,
                                      start_new_session=True))
        browser = _browser()
        browser.get(url)
        assert browser.current_url.endswith("/login")
        browser.execute_script("document.getElementById('token').value = arguments[0]", token)
        browser.execute_script("document.getElementById('login').click()")

        def js(code, *args):
            return browser.execute_script(code, *args)
        tile = ("const t = document.querySelector(`.dev[data-device='${arguments[0]}']`);"
                "return t ? [t.dataset.state, getComputedStyle(t).backgroundColor] : null;")
        state, before = _wait("hosta/cpu1's tile", lambda: js(tile, "hosta/cpu1"), 60, procs[0])
        assert state == "healthy", state
        button = 'button[data-action="{}"][data-target="hosta/cpu1"]'

        browser.find_element(By.CSS_SELECTOR, button.format("drain")).click()      # dismissed: nothing happens
        alert = WebDriverWait(browser, 10).until(expected_conditions.alert_is_present())
        assert alert.text.startswith("Drain hosta/cpu1?"), alert.text
        alert.dismiss()
        assert "not confirmed" in js("return document.getElementById('action-result').textContent")

        browser.find_element(By.CSS_SELECTOR, button.format("cordon")).click()
        alert = WebDriverWait(browser, 10).until(expected_conditions.alert_is_present())
        assert alert.text.startswith("Cordon hosta/cpu1?"), alert.text
        alert.accept()
        state, after = _wait("hosta/cpu1 cordoned", lambda: (
            v if (v := js(tile, "hosta/cpu1")) and v[0] != "healthy" else None), 30, procs[0])
        assert state == "cordoned" and after != before, (state, before, after)
        assert js(tile, "hosta/cpu0")[0] == "healthy"
        assert "hosta/cpu1 healthy -> cordoned" in js("return document.getElementById('action-result').textContent")
        assert re.search(r"DASHBOARD cordon hosta/cpu1 by 127\.0\.0\.1:\d+: hosta/cpu1 healthy -> cordoned",
                         log.read_text()), log.read_text()[-2000:]
        assert "DASHBOARD drain" not in log.read_text()
        browser.save_screenshot(str(artifacts / "service-dashboard.png"))
    finally:
        if browser is not None:
            browser.quit()
        for p in reversed(procs):
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGTERM)
                try:
                    p.wait(30)
                except subprocess.TimeoutExpired:
                    os.killpg(p.pid, signal.SIGKILL)
                    p.wait()


def test_service_page_shows_the_newest_job_or_the_one_chosen(tmp_path):
    """The service's dashboard (in this process, fed two jobs' records as the service's observers
    give them): the page shows j2, the newest, with the host it borrowed from j1 on its timeline;
    choosing j1 in the selector shows j1's failure
    and its records as they come; the dashboard's close is said on the page."""
    from selenium.webdriver.support.ui import Select

    from hotspare.coordinator import events as ev
    from hotspare.observe.dashboard import Dashboard, dashboard_token

    t0 = time.time()
    dash = Dashboard("127.0.0.1", 0, dashboard_token(b"s" * 32), lambda line: None)
    for i, job in enumerate(("j1", "j2")):
        dash({**ev.record("run_start", t0 + i, {"job": {"script": f"train_{job}.py"}, "schema": ev.SCHEMA}),
              "job": job})
        dash({**ev.record("failure", t0 + i + 0.5, {"rank": i + 1, "worker": f"{job}.w{i + 1}", "step": 7,
                                                    "kind": "killed"}), "job": job})
    dash({**ev.to_record(ev.DeviceLoaned("j2", "j1", ("hostb",), 1, 1000, 0, "j1 is preemptible and of lower "
                                         "priority", t0 + 2.5)), "job": "j2"})
    dash(ev.record("cluster", t0 + 3, {"hosts": [], "devices": []}))
    browser = None
    try:
        browser = _browser()
        browser.get(f"http://{dash.address}/login")
        browser.execute_script("document.getElementById('token').value = arguments[0]", dash.token)
        browser.execute_script("document.getElementById('login').click()")

        def shown():
            return browser.execute_script(
                "const sel = document.getElementById('jobsel');"
                "return [document.getElementById('job').textContent, sel.hidden, [...sel.options].map(o => o.value),"
                "        [...document.querySelectorAll('#timeline .item')].map(i => i.textContent),"
                "        document.getElementById('status').textContent];")
        job, hidden, options, items, _ = _wait("j2 shown", lambda: (v := shown())[0].startswith("train_j2") and v, 30)
        assert not hidden and options == ["", "j2", "j1"], options
        assert len(items) == 2 and "rank 2 (j2.w2) killed at step 7" in items[1], items
        assert "BORROWED j2 got hostb (1 slots) from j1, paused" in items[0], items   # newest first
        Select(browser.find_element("id", "jobsel")).select_by_value("j1")
        job, _, _, items, _ = _wait("j1 shown", lambda: (v := shown())[0].startswith("train_j1") and v, 30)
        assert len(items) == 1 and "rank 1 (j1.w1) killed at step 7" in items[0], items
        dash({**ev.record("failure", time.time(), {"rank": 0, "worker": "j1.w0", "step": 9, "kind": "killed"}),
              "job": "j1"})
        dash({**ev.record("failure", time.time(), {"rank": 3, "worker": "j2.w3", "step": 9, "kind": "killed"}),
              "job": "j2"})
        items = _wait("j1's new failure", lambda: len((v := shown())[3]) == 2 and v[3], 30)
        assert any("j1.w0" in i for i in items) and not any("j2" in i for i in items), items
        assert browser.execute_script("return document.getElementById('jobsel').value") == "j1"
        dash.close()
        _wait("the close said", lambda: "dashboard closed" in shown()[4], 30)
    finally:
        if browser is not None:
            browser.quit()
        dash.close()
