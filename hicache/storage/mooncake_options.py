"""The Mooncake Store tier's options, checked without connecting, and a probe of its master.

The extra-config keys are the ones SGLang's Mooncake backend reads (master_server_address,
metadata_server, protocol, device_name, global_segment_size, local_buffer_size), plus
local_hostname and hicache's backoff. Sizes are bytes, or strings such as "4gb" / "512mb".
"""

from __future__ import annotations

import math
import socket
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

PROTOCOLS = ("tcp", "rdma")
_UNITS = {"kb": 1 << 10, "mb": 1 << 20, "gb": 1 << 30, "tb": 1 << 40}


@dataclass(frozen=True)
class MooncakeOptions:
    """One Mooncake client's settings. Build with from_extra (checks every value)."""

    master_server_address: str  # the master's RPC address, host:port
    metadata_server: str = "P2PHANDSHAKE"  # or an etcd / http metadata server URL
    protocol: str = "tcp"  # "rdma" where the hardware has it (pages are then staged: see mooncake)
    device_name: str = ""  # RDMA devices, e.g. "mlx5_0,mlx5_1"
    global_segment_size: int = 4 << 30  # memory this sidecar lends the Mooncake cluster
    local_buffer_size: int = 16 << 20  # Mooncake's own transfer buffer (the zero-copy calls do not use it)
    local_hostname: str = ""  # the address peers reach this client at; "" = the one that routes to the master
    connect_timeout_s: float = 1.0  # the master's TCP probe before each (re)connect
    backoff_initial_s: float = 0.1
    backoff_max_s: float = 10.0

    @classmethod
    def from_extra(cls, extra: Mapping[str, Any]) -> MooncakeOptions:
        """Options from a backend's extra config. Raises ValueError naming a missing key or
        the first bad value (unknown keys are the factory's check)."""
        if "master_server_address" not in extra:
            raise ValueError('storage backend "mooncake" needs "master_server_address" (host:port) in the extra config')
        known = {f.name for f in fields(cls)}
        values = {k: v for k, v in extra.items() if k in known}
        for name in ("global_segment_size", "local_buffer_size"):
            if name in values:
                values[name] = parse_size(name, values[name])
        options = cls(**values)
        options.check()
        return options

    def check(self) -> None:
        """Raise ValueError naming the first bad option."""
        master_host_port(self.master_server_address)
        for name in ("metadata_server", "device_name", "local_hostname"):
            if not isinstance(getattr(self, name), str):
                raise ValueError(f"mooncake {name} must be a string, got {getattr(self, name)!r}")
        if not self.metadata_server:
            raise ValueError('mooncake metadata_server must not be empty ("P2PHANDSHAKE" needs none)')
        if self.protocol not in PROTOCOLS:
            raise ValueError(f"mooncake protocol must be one of {list(PROTOCOLS)}, got {self.protocol!r}")
        if self.local_buffer_size < 1:
            raise ValueError(f"mooncake local_buffer_size must be >= 1 byte, got {self.local_buffer_size!r}")
        for name in ("connect_timeout_s", "backoff_initial_s", "backoff_max_s"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float) or not 0 < value < math.inf:
                raise ValueError(f"mooncake {name} must be a finite number > 0, got {value!r}")
        if self.backoff_max_s < self.backoff_initial_s:
            raise ValueError(f"backoff_max_s {self.backoff_max_s} is below backoff_initial_s {self.backoff_initial_s}")

    def hostname(self) -> str:
        """local_hostname, else the local address this machine reaches the master from."""
        if self.local_hostname:
            return self.local_hostname
        host, port = master_host_port(self.master_server_address)
        try:
            with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:  # no packet is sent
                probe.connect((host, port))
                return str(probe.getsockname()[0])
        except OSError:
            return "127.0.0.1"


def parse_size(name: str, value: object) -> int:
    """Bytes from an int or a string such as "4gb", "512MB" or "1048576". Raises ValueError
    naming `name` for anything else or a negative size."""
    size: int | None = None
    if isinstance(value, int) and not isinstance(value, bool):
        size = value
    elif isinstance(value, str):
        text = value.strip().lower()
        unit = next((u for u in _UNITS if text.endswith(u)), "")
        number = text[: len(text) - len(unit)].strip()
        if number.isdigit():
            size = int(number) * _UNITS.get(unit, 1)
    if size is None or size < 0:
        raise ValueError(f"mooncake {name} must be bytes >= 0 or a size like '4gb', got {value!r}")
    return size


def master_host_port(address: object) -> tuple[str, int]:
    """(host, port) of a master address "host:port". Raises ValueError naming it otherwise."""
    if isinstance(address, str) and ":" in address:
        host, _, port = address.rpartition(":")
        host = host.strip("[]")
        if host and port.isdigit() and 0 < int(port) < 65536:
            return host, int(port)
    raise ValueError(f"mooncake master_server_address must be host:port, got {address!r}")


def master_problem(options: MooncakeOptions) -> str:
    """Why the master cannot be reached now ("" when its RPC port accepts a connection within
    connect_timeout_s). Never raises. Mooncake's own set-up retries an absent master for about
    90 s while holding the GIL, so a client connects only after this answers ""."""
    host, port = master_host_port(options.master_server_address)
    try:
        with socket.create_connection((host, port), timeout=options.connect_timeout_s):
            return ""
    except OSError as exc:
        return f"mooncake master {options.master_server_address} is unreachable: {exc.strerror or exc}"
