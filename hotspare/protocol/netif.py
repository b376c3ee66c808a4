"""Which network interface a host's workers use to reach the others.

gloo picks its interface by resolving the host name, unless ``GLOO_SOCKET_IFNAME`` names one.
On a host with several interfaces (a management network, a container bridge, a network
namespace whose name resolves to nothing it owns) that lookup lands on the wrong one, or on
loopback, and the peers on other hosts cannot connect. The agent therefore asks the kernel
which local address routes to the rendezvous store (``MASTER_ADDR``: a UDP "connect" sends
nothing) and names the interface holding that address.
"""
from __future__ import annotations

import fcntl
import socket
import struct

SIOCGIFADDR = 0x8915


def source_address(peer: str, port: int = 9) -> str:
    """The local IPv4 address this host would use to reach ``peer``."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((peer, port))
        return s.getsockname()[0]


def ipv4_of(ifname: str) -> str | None:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            data = fcntl.ioctl(s.fileno(), SIOCGIFADDR, struct.pack("256s", ifname.encode()[:15]))
        except OSError:
            return None
    return socket.inet_ntoa(data[20:24])


def interface_of(address: str) -> str | None:
    """The name of the interface holding IPv4 ``address`` (None: none here does)."""
    return next((name for _, name in socket.if_nameindex() if ipv4_of(name) == address), None)


def gloo_interface(master_addr: str) -> tuple[str | None, str]:
    """The interface gloo should use to reach ``master_addr``'s network, and why."""
    try:
        local = source_address(master_addr)
    except OSError as e:
        return None, f"no route to {master_addr}: {e}"
    name = interface_of(local)
    if name is None:
        return None, f"no interface holds {local}, the address that routes to {master_addr}"
    return name, f"{name} holds {local}, the address that routes to {master_addr}"
