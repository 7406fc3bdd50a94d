"""A free TCP port on this host, for a process group's rendezvous (MASTER_PORT) or a launcher's --master_port."""

from __future__ import annotations

import socket


def free_port() -> int:
    """A port the OS says is free now (another process may take it before it is used: the callers retry or fail
    with the launcher's own message)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
