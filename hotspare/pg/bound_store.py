"""The rendezvous store of ``hotspare run``, listening only where it was told.

torch's ``TCPStore(host, port, is_master=True)`` listens on every interface (``*:PORT``, IPv4
and IPv6) whatever ``host`` says. Here the launcher binds the socket itself, to ``host`` only,
and hands it over (``master_listen_fd``, with the default libuv backend). The store itself
stays unauthenticated by torch's design: docs/SECURITY.md."""
from __future__ import annotations

import torch.distributed as dist

from hotspare.protocol.listen import bound_server


def master_store(host: str, port: int = 0) -> dist.TCPStore:
    """A master TCPStore listening on ``host``:``port`` (0: a free port) and nowhere else."""
    sock = bound_server(host, port)
    bound_port = sock.getsockname()[1]
    fd = sock.detach()                    # the store owns the socket from here on
    return dist.TCPStore(host, bound_port, is_master=True, wait_for_workers=False, master_listen_fd=fd)
