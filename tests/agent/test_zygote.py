"""Workers forked from the zygote behave as ``python SCRIPT`` processes the agent started itself:
the agent's children (waitpid sees their stops and exits), their own sessions, dying with the
agent, running the script as __main__ with its own argv, environment and exit status."""
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from hotspare.agent.zygote import TORCH_PRELOAD, Zygote, ZygoteError, forkable, preload_for
from hotspare.testing.local import EXAMPLE

PROBE = str(Path(__file__).resolve().parents[1] / "scripts" / "zygote_probe.py")
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


@pytest.fixture(scope="module")
def zygote():
    z = Zygote(ENV)
    yield z
    z.close()


def spawn(zygote, tmp_path, how, env=None):
    out = tmp_path / "probe.json"
    proc = zygote.spawn([sys.executable, PROBE, str(out), how], env or ENV, cwd=str(tmp_path))
    return proc, out


def wait(pid):
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status)


def test_a_forked_worker_runs_its_script_as_python_would(zygote, tmp_path):
    proc, out = spawn(zygote, tmp_path, "ok", env={**ENV, "PROBE": "yes", "RANK": "3"})
    assert wait(proc.pid) == 0                     # our child: re-parented to this process
    seen = json.loads(out.read_text())
    assert seen["name"] == "__main__" and seen["argv"] == [PROBE, str(out), "ok"]
    assert seen["path0"] == os.path.dirname(PROBE) and seen["cwd"] == str(tmp_path)
    assert seen["env"] == {"PROBE": "yes", "RANK": "3", "HOME": os.environ.get("HOME")}
    assert seen["ppid"] == os.getpid() and seen["leads_session"] and seen["preloaded"]
    assert Path(str(out) + ".atexit").exists()


def test_exit_status_threads_and_the_traceback_of_an_uncaught_exception(capfd, tmp_path):
    zygote = Zygote(ENV)     # started here, so its workers write to the stderr capfd captures
    proc, _ = spawn(zygote, tmp_path, "exit:3")
    assert wait(proc.pid) == 3
    proc, out = spawn(zygote, tmp_path, "thread")
    assert wait(proc.pid) == 0 and Path(str(out) + ".thread").exists()     # joined before the exit
    proc, _ = spawn(zygote, tmp_path, "raise")
    assert wait(proc.pid) == 1
    err = capfd.readouterr().err
    tb = err[err.index("Traceback"):]
    assert "ValueError: a bug in the script" in tb and "fail_here()" in tb
    # It starts in the script, as under `python SCRIPT`: none of the zygote's or runpy's frames.
    assert f'File "{PROBE}"' in tb.splitlines()[1] and "runpy" not in tb and "zygote.py" not in tb
    zygote.close()


def test_ps_pgrep_and_proc_show_the_worker_not_the_zygote(zygote, tmp_path):
    proc, out = spawn(zygote, tmp_path, "sleep", env={**ENV, "RANK": "2", "PROBE": "shown"})
    while not out.exists():
        time.sleep(0.01)
    cmdline = open(f"/proc/{proc.pid}/cmdline", "rb").read().rstrip(b"\0").split(b"\0")
    assert cmdline == [os.fsencode(a) for a in (sys.executable, PROBE, str(out), "sleep")]
    environ = [e for e in open(f"/proc/{proc.pid}/environ", "rb").read().split(b"\0") if e]
    assert b"RANK=2" in environ and b"PROBE=shown" in environ
    assert not any(e.startswith(b"HOTSPARE_ZYGOTE_PAD=") for e in environ)
    found = subprocess.run(["pgrep", "-f", f"zygote_probe.py {out} sleep"], capture_output=True, text=True)
    assert found.stdout.split() == [str(proc.pid)]
    os.kill(proc.pid, signal.SIGKILL)
    assert wait(proc.pid) == -signal.SIGKILL


def test_the_agent_sees_its_stops_and_its_death_by_signal(zygote, tmp_path):
    proc, out = spawn(zygote, tmp_path, "sleep")
    while not out.exists():
        time.sleep(0.01)
    os.killpg(proc.pid, signal.SIGSTOP)            # it leads its own process group
    _, status = os.waitpid(proc.pid, os.WUNTRACED)
    assert os.WIFSTOPPED(status)
    os.kill(proc.pid, signal.SIGKILL)
    assert wait(proc.pid) == -signal.SIGKILL


def test_workers_die_with_their_agent(tmp_path):
    out = tmp_path / "probe.json"
    agent = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import os, sys, time
        from hotspare.agent.zygote import Zygote
        z = Zygote(dict(os.environ))
        p = z.spawn([sys.executable, {PROBE!r}, {str(out)!r}, "sleep"], dict(os.environ))
        print(p.pid, z._proc.pid, flush=True)
        time.sleep(600)""")], stdout=subprocess.PIPE, text=True, env=ENV)
    worker, zygote = map(int, agent.stdout.readline().split())
    while not out.exists():
        time.sleep(0.01)
    agent.kill()
    agent.wait()
    deadline = time.time() + 10
    while time.time() < deadline and not (gone(worker) and gone(zygote)):
        time.sleep(0.05)
    assert gone(worker) and gone(zygote)


def gone(pid):
    """Dead: no such process, or a zombie (re-parented to this test process, if an earlier test
    made it a subreaper: then it is reaped here)."""
    try:
        if os.waitpid(pid, os.WNOHANG)[0] == pid:
            return True
    except ChildProcessError:
        pass
    try:
        return open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def test_a_dead_zygote_says_so(tmp_path):
    z = Zygote(ENV)
    z._proc.kill()
    with pytest.raises(ZygoteError, match="the zygote exited with code -9"):
        spawn(z, tmp_path, "ok")
    z.close()


def test_only_a_python_script_is_forked(tmp_path):
    assert forkable([sys.executable, PROBE, "x"])
    assert not forkable([sys.executable, "-m", "hotspare"])               # a module: exec it
    assert not forkable(["/usr/bin/python3.9", PROBE])                     # another interpreter
    assert not forkable([sys.executable, str(tmp_path / "missing.py")])


def test_the_torch_stack_is_preloaded_only_for_a_script_that_imports_it(tmp_path):
    assert preload_for(str(EXAMPLE)) == TORCH_PRELOAD
    assert preload_for(str(Path(__file__).resolve().parents[1] / "scripts" / "echo_worker.py")) == ()   # protocol only
    plain = tmp_path / "plain.py"
    plain.write_text("import os\nfrom hotspare.protocol import messages\n")
    uses = tmp_path / "uses.py"
    uses.write_text('"""doc"""\nimport os\n\nimport hotspare\n')
    assert preload_for(str(uses)) == TORCH_PRELOAD
    broken = tmp_path / "broken.py"
    broken.write_text("def (:\n")
    assert preload_for(str(plain)) == () and preload_for(str(broken)) == ()
    assert preload_for(str(tmp_path / "missing.py")) == ()
