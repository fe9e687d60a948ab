"""Free loopback ports for throwaway servers: drawn below the kernel's ephemeral range, each
checked by binding it, optionally with its Redis Cluster bus port (port + 10000) too.

LocalRedisCluster (redis_cluster) picks its nodes' ports here; the tests use it for their own
servers.
"""

from __future__ import annotations

import random
import socket
from pathlib import Path


def free_ports(n: int, bus: bool = True) -> list[int]:
    """n distinct loopback ports free now (with their cluster bus ports, port + 10000, when
    `bus`; no port is another's bus port), drawn below the kernel's ephemeral range: a port in
    that range can be taken by any outgoing connection between this check and the server's
    bind."""
    low = _ephemeral_low()
    span = range(10000, low - 10000) if bus else range(10000, low)
    ports: list[int] = []
    for _ in range(100 * n):
        if len(ports) == n:
            break
        port = random.choice(span) if len(span) > 100 else _any_port()
        clash = {port, port + 10000, port - 10000} if bus else {port}
        if clash & set(ports) or (bus and port + 10000 > 65535):
            continue
        if _bindable(port) and (not bus or _bindable(port + 10000)):
            ports.append(port)
    if len(ports) < n:
        raise RuntimeError(f"found only {len(ports)} of {n} free loopback ports")
    return ports


def _ephemeral_low() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default


def _bindable(port: int) -> bool:
    try:
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))
        return True
    except OSError:
        return False


def _any_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])
