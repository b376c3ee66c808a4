"""A job's rendezvous store in a process of its own: ``python -m hotspare.pg.storeproc HOST``.

The coordinator service (``hotspare coordinator``) starts one per job, in its own session, so
that the store outlives a crash of the service: the workers keep their process groups, and the
next generation forms through the same store once the service is back. It binds ``HOST`` only
(``bound_store.master_store``), prints its port on the first line, and serves until it is
signalled (the service ends it with its job).
"""
from __future__ import annotations

import signal
import sys

from hotspare.pg.bound_store import master_store


def main(argv: list[str]) -> int:
    if len(argv) not in (1, 2):
        print("usage: python -m hotspare.pg.storeproc HOST [PORT]", file=sys.stderr)
        return 2
    store = master_store(argv[0], int(argv[1]) if len(argv) == 2 else 0)
    print(store.port, flush=True)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    while True:
        signal.pause()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
