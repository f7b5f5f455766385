"""Free TCP ports on this machine's loopback, for the sockets the engine's processes open among themselves."""

from __future__ import annotations

import socket


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def free_port_range(width: int) -> int:
    """A port p with p .. p + width - 1 all free (a P2pConnector's kv_port: the engine's, then one per rank)."""
    for _ in range(100):
        port = free_port()
        if port + width < 65000 and all(_is_free(port + offset) for offset in range(1, width)):
            return port
    raise RuntimeError(f"no {width} consecutive free ports")


def _is_free(port: int) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True
