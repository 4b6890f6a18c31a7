"""A free loopback port for a test's own server, drawn outside the kernel's ephemeral range.

A port that ``bind(("127.0.0.1", 0))`` returns comes from the ephemeral range
(``/proc/sys/net/ipv4/ip_local_port_range``), the same range the kernel hands
to every outgoing connection. Between probing that port and the server's own
``bind`` another process's connection (a concurrent rank test's gloo or c10d
store socket) may take it, and the server fails with "Address already in
use". A port below that range is never handed out implicitly, so only another
explicit ``bind`` can race for it.
"""

from __future__ import annotations

import random
import socket
from pathlib import Path

_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")


def _ephemeral_low() -> int:
    try:
        return int(_RANGE.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port(tries: int = 200) -> int:
    """A loopback TCP port in [10000, the ephemeral range's start) that nothing is bound to now.

    Raises:
        RuntimeError: no free port was found in ``tries`` draws.
    """
    low, high = 10000, _ephemeral_low()
    if high <= low:
        low, high = 1024, high
    for _ in range(tries):
        port = random.randrange(low, high)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free loopback port in [{low}, {high}) after {tries} draws")
