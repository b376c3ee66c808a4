"""A zygote: one process that has already imported torch forks each worker and spare.

A fresh interpreter spends about 4 s of CPU importing torch and what DistributedDataParallel
pulls in, and every worker, spare and replacement spare pays it again; forked from a zygote, a
worker starts in milliseconds and shares those pages copy-on-write (Chromium's and Android's
zygotes do the same). The zygote imports but never runs an op, starts no thread of its own and
touches no device (it refuses to fork if CUDA got initialised), so CUDA, gloo and OpenMP start in
the worker, after the fork, as in a fresh interpreter. (Measured on CPU and gloo; NCCL on GPUs
has not run forked yet: ``--spawn exec`` is the fallback.)

Warm spares on GPU hosts. A CUDA context cannot be created before the fork (the child could not
use it), so the zygote never holds one. A spare creates its own, after the fork, while it waits
as a spare: the runtime calls ``hotspare.runtime.cudawarm.warm_cuda(device, pool_bytes)`` once
the spare knows its device, which initialises CUDA, binds the device, loads cuBLAS and reserves
a memory pool in the caching allocator. Taking over then costs no CUDA start-up; the zygote
stays CUDA-free, and its check below (``torch.cuda.is_initialized()``) still refuses to fork
if anything it preloads initialised CUDA.

The workers stay the agent's own children. The agent marks itself a child subreaper; the zygote
forks twice for each worker, and when the middle process exits the kernel re-parents the worker to
the agent, which then waits for it (exit status, SIGSTOP) and signals it exactly as one it had
started with ``subprocess``. Each worker leads its own session and dies with the agent
(PR_SET_PDEATHSIG, set once it is the agent's child). Requests and replies are JSON lines over a
socket pair; nothing is unpickled.

A worker runs its script as ``python SCRIPT ARGS`` would: ``__main__``, ``sys.argv``, ``sys.path[0]``,
its own environment and working directory, the exit status of ``sys.exit`` or 1 with the
traceback (starting in the script) for an uncaught exception, non-daemon threads joined and
``atexit`` handlers run at the end. Only that command form is forked (``hotspare run`` builds it);
anything else, or ``hotspare run --spawn exec``, starts fresh interpreters as before.
"""
from __future__ import annotations

import atexit
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

from hotspare.errors import HotspareError

# What a torch training script imports or pulls in first and pays most for: about 2 s of CPU for
# torch, 2 s more for torch._dynamo, which building a DistributedDataParallel imports (with sympy
# and inductor). Only these, known to have no side effect that depends on the worker (its
# environment, rank, device): a worker imports its own modules itself.
TORCH_PRELOAD = ("torch", "torch.nn", "torch.optim", "torch.distributed", "torch.nn.parallel",
                 "torch._dynamo", "numpy", "hotspare.runtime")
PAD = 8192                 # room kept in the zygote's command line and environment for each worker's own
PAD_VAR = "HOTSPARE_ZYGOTE_PAD"
READY_TIMEOUT_S = 120.0    # the zygote's own imports (seconds; minutes on a very loaded machine)
FORK_TIMEOUT_S = 20.0      # one fork, once it is ready
PR_SET_PDEATHSIG, PR_SET_CHILD_SUBREAPER = 1, 36


class ZygoteError(HotspareError):
    """The zygote could not fork a worker (it died, or timed out): start a fresh interpreter."""


def _prctl(option: int, value: int) -> bool:
    try:
        import ctypes
        return ctypes.CDLL("libc.so.6", use_errno=True).prctl(option, value, 0, 0, 0) == 0
    except OSError:        # not Linux
        return False


def die_with_parent() -> bool:
    """SIGKILL this process when its parent dies (PR_SET_PDEATHSIG); False where it cannot (not
    Linux: workers then end when their control connection closes)."""
    return _prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


def forkable(cmd: list[str]) -> bool:
    """Can a zygote run ``cmd``? Only ``[this python, a .py file, args...]``, on Linux."""
    return (sys.platform.startswith("linux") and len(cmd) >= 2 and cmd[0] == sys.executable
            and cmd[1].endswith(".py") and os.path.isfile(cmd[1]))


def preload_for(script: str) -> tuple[str, ...]:
    """What the zygote imports for ``script``: the torch stack if the script imports torch or
    hotspare's runtime (``import hotspare``) at its top level, else nothing (its workers then
    gain only the interpreter's start)."""
    import ast
    try:
        with open(script, "rb") as f:
            tree = ast.parse(f.read(), script)
    except (OSError, SyntaxError, ValueError):
        return ()
    for node in tree.body:
        names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                 else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
        if any(n.split(".")[0] == "torch" or n == "hotspare" or n.startswith("hotspare.runtime")
               for n in names):
            return TORCH_PRELOAD
    return ()


class ForkedProc:
    """A worker forked by the zygote, as the agent sees it: the ``pid`` and ``returncode`` of a
    ``subprocess.Popen`` (the agent reaps it itself with ``os.waitpid``)."""

    def __init__(self, pid: int):
        self.pid, self.returncode = pid, None

    def __repr__(self) -> str:
        return f"ForkedProc(pid={self.pid}, returncode={self.returncode})"


class Zygote:
    """The agent's side: start the zygote once, then ``spawn(argv, env)`` per worker."""

    def __init__(self, env: dict[str, str], preload: tuple[str, ...] = TORCH_PRELOAD, output: int | None = None):
        """Start the zygote process (it imports ``preload`` in the background; the first ``spawn``
        waits for that). ``env``: the workers' common environment, which torch may read at import
        (``OMP_NUM_THREADS``...); each worker gets its own on top. ``output``: a file descriptor
        for the zygote's and its workers' stdout and stderr (default: this process's). Raises
        ``ZygoteError`` where workers could not be re-parented to this process."""
        if not _prctl(PR_SET_CHILD_SUBREAPER, 1):
            raise ZygoteError("this process cannot adopt forked workers (PR_SET_CHILD_SUBREAPER failed)")
        ours, theirs = socket.socketpair()
        serve = (f"from hotspare.agent.zygote import serve; "
                 f"serve({theirs.fileno()}, {os.getpid()}, {json.dumps(list(preload))})")
        # The padding (last in each) is where a worker writes its own command line and
        # environment, so that ps, pgrep and /proc show each worker as `python SCRIPT ARGS`.
        self._proc = subprocess.Popen([sys.executable, "-c", serve, "#" * PAD],
                                      env={**env, PAD_VAR: "#" * PAD}, pass_fds=[theirs.fileno()],
                                      start_new_session=True, stdin=subprocess.DEVNULL,
                                      stdout=output, stderr=output)
        theirs.close()
        self._sock = ours
        self._reader = ours.makefile("r", encoding="utf-8")
        self._lock = threading.Lock()
        self._ready = False

    def spawn(self, argv: list[str], env: dict[str, str], cwd: str | None = None) -> ForkedProc:
        """Fork a worker running ``argv`` (``[python, script.py, args...]``) with ``env``."""
        request = {"argv": list(argv), "env": dict(env), "cwd": cwd or os.getcwd(), "parent": os.getpid()}
        with self._lock:
            if self._proc.poll() is not None:
                raise ZygoteError(f"the zygote exited with code {self._proc.returncode}")
            self._sock.settimeout(FORK_TIMEOUT_S if self._ready else READY_TIMEOUT_S)
            why = "the zygote closed its socket"
            try:
                self._sock.sendall((json.dumps(request) + "\n").encode())
                line = self._reader.readline()
            except OSError as e:            # socket.timeout included
                line, why = "", f"the zygote did not answer ({e or 'timed out'})"
            if not line:
                try:
                    why = f"the zygote exited with code {self._proc.wait(timeout=1.0)}"
                except subprocess.TimeoutExpired:
                    pass
                self.close()
                raise ZygoteError(why)
            self._ready = True
        reply = json.loads(line)
        if "error" in reply:
            raise ZygoteError(reply["error"])
        return ForkedProc(int(reply["pid"]))

    def close(self) -> None:
        """End the zygote (its workers go on: they are the agent's children)."""
        try:
            self._sock.close()
        except OSError:
            pass
        if self._proc.poll() is None:
            self._proc.kill()
        self._proc.wait()


# ---------------------------------------------------------------------- in the zygote process
def serve(fd: int, agent: int, preload: list[str]) -> None:
    """The zygote's loop: import ``preload``, then fork a worker for each request on socket ``fd``."""
    sock = socket.socket(fileno=fd)
    die_with_parent()                            # the zygote dies with its agent
    if os.getppid() != agent:                    # ... which died before that
        return
    # From here on the C library's environment lives on the heap (setenv copies), so nothing
    # refers to the process's original environment strings, which each worker overwrites.
    os.environ.pop(PAD_VAR, None)
    saved = dict(os.environ)
    os.environ.clear()
    os.environ.update(saved)
    # Should anything ask whether CUDA is there while importing, NVML answers: a CUDA runtime
    # initialised before a fork is unusable in the forked process.
    os.environ["PYTORCH_NVML_BASED_CUDA_CHECK"] = "1"
    for name in preload:
        try:
            __import__(name)
        except ImportError:
            pass
    torch = sys.modules.get("torch")
    tainted = torch is not None and torch.cuda.is_initialized()
    reader = sock.makefile("r", encoding="utf-8")
    for line in reader:
        try:
            if tainted:
                raise ZygoteError("CUDA was initialised while preloading; forked workers could not use it")
            request = json.loads(line)
            reply = {"pid": _fork_worker(request, sock.fileno())}
        except Exception as e:  # noqa: BLE001 - a bad request is answered, the zygote goes on
            reply = {"error": f"{type(e).__name__}: {e}"}
        sock.sendall((json.dumps(reply) + "\n").encode())


def _fork_worker(request: dict, zygote_fd: int) -> int:
    """Fork twice: the middle process exits at once, so the worker is re-parented to the agent."""
    r, w = os.pipe()
    middle = os.fork()
    if middle == 0:
        try:
            os.close(r)
            worker = os.fork()
            if worker == 0:
                os.close(w)
                _become_worker(request, zygote_fd)      # never returns
            os.write(w, str(worker).encode())
        finally:
            os._exit(0)
    os.close(w)
    with os.fdopen(r, "rb") as f:
        pid = f.read()
    os.waitpid(middle, 0)           # once it is reaped, the worker is the agent's child
    if not pid:
        raise ZygoteError("the fork of a worker failed")
    return int(pid)


def _become_worker(request: dict, zygote_fd: int) -> None:
    code = 1
    try:
        os.close(zygote_fd)
        os.setsid()                 # its own process group: a fence kills its children too
        deadline = time.time() + 5.0
        while os.getppid() != request["parent"]:          # re-parenting is part of the middle's exit
            if time.time() > deadline:
                os._exit(1)
            time.sleep(0.0005)
        die_with_parent()
        if os.getppid() != request["parent"]:             # the agent died just now
            os._exit(1)
        os.environ.clear()
        os.environ.update(request["env"])
        _show_as(request["argv"], request["env"])
        os.chdir(request["cwd"])
        code = run_script(request["argv"][1], request["argv"][2:])
    except BaseException:  # noqa: BLE001 - a worker never returns into the zygote's loop
        try:
            import traceback
            traceback.print_exc()
        finally:
            code = 1
    finally:
        flush()
        os._exit(code)


def _show_as(argv: list[str], env: dict[str, str]) -> None:
    """Write this worker's command line and environment over the zygote's (where the kernel
    shows them: /proc/self/cmdline, /proc/self/environ), as setproctitle does, so tools that find
    a process by its command line (pgrep -f) or a rank by its environment see the worker. Only
    if the regions are where /proc says; argv[0] is the same interpreter, so it stays as it was."""
    import ctypes
    try:
        with open("/proc/self/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
        arg_start, arg_end, env_start, env_end = (int(x) for x in fields[45:49])   # fields 48-51
        regions = ((arg_start, arg_end, "/proc/self/cmdline", [a.encode() for a in argv]),
                   (env_start, env_end, "/proc/self/environ", [f"{k}={v}".encode() for k, v in env.items()]))
        for start, end, path, items in regions:
            with open(path, "rb") as f:
                if ctypes.string_at(start, end - start) != f.read():
                    return
            data = b"\0".join(items)[:end - start - 1]
            ctypes.memmove(start, data + b"\0" * (end - start - len(data)), end - start)
    except (OSError, ValueError, IndexError, UnicodeEncodeError):
        return


def run_script(script: str, args: list[str]) -> int:
    """What ``python SCRIPT ARGS`` does, in this already-started interpreter; its exit status."""
    import runpy

    script = os.path.abspath(script)
    sys.argv = [script, *args]
    sys.path[0] = os.path.dirname(script)
    code = 0
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as e:
        code = _exit_status(e.code)
    except KeyboardInterrupt:
        code = -signal.SIGINT
    except BaseException as e:  # noqa: BLE001 - reported as the interpreter would, from the script on
        tb = e.__traceback__
        while tb is not None and tb.tb_frame.f_code.co_filename != script:
            tb = tb.tb_next                 # drop the zygote's and runpy's frames
        e = e.with_traceback(tb or e.__traceback__)
        sys.excepthook(type(e), e, e.__traceback__)
        code = 1
    for t in threading.enumerate():         # interpreter exit waits for non-daemon threads
        if t is not threading.current_thread() and not t.daemon:
            t.join()
    atexit._run_exitfuncs()
    if code == -signal.SIGINT:              # as CPython does: die by the signal
        flush()
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
        code = 130
    return code


def _exit_status(code) -> int:
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF
    print(code, file=sys.stderr)
    return 1


def flush() -> None:
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # noqa: BLE001
            pass

