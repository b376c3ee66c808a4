"""The generators' fast readers (runtime/rngstate.py) give exactly the public API's bytes, in
every state a script can leave them in, and a capture taken through them restores exactly."""
import random
import subprocess
import sys
import timeit

import numpy as np

from hotspare.runtime import rngstate as rng
from hotspare.runtime.rankstate import RankState


def _moves():
    """Ways a script moves the two generators: plain draws, a cached Gaussian left behind or
    consumed, a reseed, a state set back through the public API."""
    saved_py, saved_np = random.getstate(), np.random.get_state()
    return [
        lambda: random.random(),
        lambda: random.gauss(0, 1),                 # leaves gauss_next cached
        lambda: random.gauss(0, 1),                 # consumes it
        lambda: random.seed(1234),
        lambda: random.getrandbits(4096),
        lambda: random.setstate(saved_py),
        lambda: np.random.rand(3),
        lambda: np.random.randn(),                  # leaves has_gauss = 1
        lambda: np.random.randn(),                  # consumes it, the twister unmoved
        lambda: np.random.randn(5),
        lambda: np.random.seed(7),
        lambda: np.random.set_state(saved_np),
        lambda: np.random.randint(0, 10, size=1000),
    ]


def test_the_fast_readers_give_the_public_apis_bytes_in_every_state():
    py, nump = rng.python_reader(), rng.numpy_reader(np)
    assert py is not None and nump is not None, "the probes found no layout on this interpreter"
    moves = _moves()
    for i in range(200):
        moves[(i * 7) % len(moves)]()
        assert py() == rng.python_save_public(), i
        assert nump() == rng.numpy_save_public(np), i


def test_a_capture_through_the_fast_readers_restores_the_generators_exactly():
    rs = RankState()
    random.gauss(0, 1), np.random.randn()          # cached Gaussians behind, in both
    blob = rs.capture().clone()
    first = (random.random(), random.gauss(0, 1), np.random.randn(3).tolist(), np.random.randn())
    random.seed(99), np.random.seed(99)
    rs.restore(blob)
    assert (random.random(), random.gauss(0, 1), np.random.randn(3).tolist(), np.random.randn()) == first


def test_the_fast_readers_are_faster_than_the_public_api():
    # ratios in one process, never absolute times (the machine is shared)
    py, nump = rng.python_reader(), rng.numpy_reader(np)
    fast = min(timeit.repeat(lambda: (py(), nump()), number=200, repeat=5))
    public = min(timeit.repeat(lambda: (rng.python_save_public(), rng.numpy_save_public(np)), number=200, repeat=5))
    assert fast * 3 < public, (fast, public)


def test_a_process_forked_after_the_probe_reads_its_own_generators():
    # the zygote forks workers: a reader built before the fork reads the child's generators
    code = (
        "import os, random, numpy as np\n"
        "from hotspare.runtime import rngstate as rng\n"
        "py, nump = rng.python_reader(), rng.numpy_reader(np)\n"
        "pid = os.fork()\n"
        "if pid == 0:\n"
        "    random.seed(5); np.random.seed(5); np.random.randn()\n"
        "    ok = py() == rng.python_save_public() and nump() == rng.numpy_save_public(np)\n"
        "    os._exit(0 if ok else 3)\n"
        "_, status = os.waitpid(pid, 0)\n"
        "raise SystemExit(os.waitstatus_to_exitcode(status))\n")
    assert subprocess.run([sys.executable, "-c", code], timeout=60).returncode == 0
