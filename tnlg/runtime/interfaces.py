"""Which network interface a launched job's gloo sockets bind to: the one its rendezvous store uses.

gloo, given no device, binds its listening sockets to the address the host name resolves to: on a
cluster node (host name -> LAN address) a single-node job would listen on the LAN although its store
is on loopback. tnlg's launcher (:mod:`.launch`) therefore names the interface in
``GLOO_SOCKET_IFNAME`` (read by torch's gloo backend when a process group is made) for its workers,
by the rule its store follows:

* one node (no ``--rdzv-endpoint``): the loopback interface (``lo`` on Linux, ``lo0`` on macOS);
* several nodes: the interface of the route to ``--rdzv-endpoint``'s host (the local address a socket
  connected there gets, and the interface holding that address: IPv4 on Linux); where that cannot be
  told (an IPv6-only endpoint, no interface table) nothing is set and gloo keeps its own choice;
* a ``GLOO_SOCKET_IFNAME`` the user set wins over both (any interface, or several, comma-separated).

This module imports only the standard library.
"""

from __future__ import annotations

import os
import socket
import struct
import sys
from typing import Optional

__all__ = ["GLOO_IFNAME_ENV", "gloo_interface", "interface_of", "loopback_interface", "route_address"]

GLOO_IFNAME_ENV = "GLOO_SOCKET_IFNAME"
_SIOCGIFADDR = 0x8915  # <linux/sockios.h>: an interface's IPv4 address


def _address_of(name: str) -> Optional[str]:
    """The (first) IPv4 address of interface ``name`` (Linux), else ``None``."""
    if not sys.platform.startswith("linux"):
        return None
    import fcntl
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            packed = fcntl.ioctl(s.fileno(), _SIOCGIFADDR, struct.pack("256s", name[:15].encode()))
        except OSError:  # no IPv4 address on it
            return None
    return socket.inet_ntoa(packed[20:24])


def _names() -> list[str]:
    try:
        return [name for _, name in socket.if_nameindex()]
    except OSError:
        return []


def interface_of(address: str) -> Optional[str]:
    """The local interface that holds IPv4 ``address``, ``None`` when none does (or it cannot be told)."""
    return next((name for name in _names() if _address_of(name) == address), None)


def loopback_interface() -> Optional[str]:
    """The loopback interface's name: the one holding 127.0.0.1, else ``lo`` / ``lo0`` if present."""
    names = _names()
    return interface_of("127.0.0.1") or next((n for n in ("lo", "lo0") if n in names), None)


def route_address(host: str, port: int) -> Optional[str]:
    """The local address this host uses to reach ``host:port`` (a UDP socket's connect: nothing is sent)."""
    try:
        family, _, _, _, target = socket.getaddrinfo(host.strip("[]"), port, proto=socket.IPPROTO_UDP)[0]
        with socket.socket(family, socket.SOCK_DGRAM) as s:
            s.connect(target)
            return s.getsockname()[0]
    except OSError:
        return None


def gloo_interface(rdzv_endpoint: Optional[str]) -> Optional[str]:
    """The interface a job's gloo sockets should bind to (see the module docstring): the user's
    ``GLOO_SOCKET_IFNAME``, loopback for one node, the route's interface to ``rdzv_endpoint``
    (``HOST:PORT``) for several; ``None``: leave gloo's own choice."""
    if os.environ.get(GLOO_IFNAME_ENV):
        return os.environ[GLOO_IFNAME_ENV]
    if not rdzv_endpoint:
        return loopback_interface()
    host, _, port = rdzv_endpoint.rpartition(":")
    local = route_address(host, int(port))
    return interface_of(local) if local else None
