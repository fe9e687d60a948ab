"""TLS for a client that reaches the sidecar over TCP (`hicache-server --listen --tls-cert ...`)."""

from __future__ import annotations

import os
from dataclasses import dataclass

import grpc


@dataclass(frozen=True)
class ClientTls:
    """PEM files: `ca` verifies the sidecar's certificate; `cert` + `key` are this client's
    certificate for a sidecar that requires one (--tls-client-ca, mutual TLS); `server_name`
    overrides the name checked against the sidecar's certificate (default: the target host).

    Raises ValueError for a cert without its key (or the reverse) or a file that cannot be read.
    """

    ca: str
    cert: str | None = None
    key: str | None = None
    server_name: str | None = None

    def __post_init__(self) -> None:
        if bool(self.cert) != bool(self.key):
            raise ValueError(f"a client certificate needs its key: cert={self.cert!r}, key={self.key!r}")
        for name in ("ca", "cert", "key"):
            path = getattr(self, name)
            if path is not None and not (os.path.isfile(path) and os.access(path, os.R_OK)):
                raise ValueError(f"tls {name} {path!r} is not a readable file")

    def credentials(self) -> grpc.ChannelCredentials:
        def read(path: str | None) -> bytes | None:
            if path is None:
                return None
            with open(path, "rb") as f:
                return f.read()

        return grpc.ssl_channel_credentials(
            root_certificates=read(self.ca), private_key=read(self.key), certificate_chain=read(self.cert)
        )

    def options(self) -> list[tuple[str, str]]:
        return [("grpc.ssl_target_name_override", self.server_name)] if self.server_name else []
