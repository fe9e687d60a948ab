"""Where the sidecar listens: the Unix socket (its folder checked, a stale socket removed),
and --listen's TCP address, with TLS credentials when --tls-cert and --tls-key are given."""

from __future__ import annotations

import os
import socket
import stat

import grpc

from .config import ServerConfig


def _prepare_socket(path: str) -> None:
    """Create the socket's directory (0700 when we make it) and remove a stale socket file.

    Raises ValueError if another user could replace the socket (the folder belongs to
    someone else, or others may write in it without the sticky bit), if `path` exists and
    is not a socket, or if a live server already listens on it.
    """
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, mode=0o700, exist_ok=True)
    st = os.stat(directory)
    if st.st_uid not in (os.getuid(), 0):
        raise ValueError(f"socket folder {directory} belongs to uid {st.st_uid}, not to this user ({os.getuid()})")
    if st.st_mode & 0o022 and not st.st_mode & stat.S_ISVTX:
        raise ValueError(f"socket folder {directory} is writable by others (mode {oct(st.st_mode & 0o777)})")
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(mode):
        raise ValueError(f"{path} exists and is not a socket; not replacing it")
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.connect(path)
    except (ConnectionRefusedError, FileNotFoundError):
        os.unlink(path)  # stale: nobody listens
        return
    finally:
        probe.close()
    raise ValueError(f"a server already listens on {path}")


def tls_credentials(config: ServerConfig) -> grpc.ServerCredentials | None:
    """Server credentials from --tls-cert/--tls-key (and --tls-client-ca for mTLS), or None."""
    if not config.tls_cert or not config.tls_key:
        return None

    def read(path: str) -> bytes:
        with open(path, "rb") as f:
            return f.read()

    client_ca = read(config.tls_client_ca) if config.tls_client_ca else None
    return grpc.ssl_server_credentials(
        [(read(config.tls_key), read(config.tls_cert))],
        root_certificates=client_ca,
        require_client_auth=client_ca is not None,
    )


def _bind(server: grpc.Server, config: ServerConfig, address: str) -> list[str]:
    """Add the socket's and --listen's ports; returns the addresses. Raises ValueError naming an
    address that cannot be bound."""
    try:
        server.add_insecure_port(address)
    except RuntimeError:  # grpcio raises this, not OSError, for an address it cannot bind
        raise ValueError(f"cannot listen on {address}") from None
    if not config.listen:
        return [address]
    creds = tls_credentials(config)
    try:
        port = server.add_secure_port(config.listen, creds) if creds else server.add_insecure_port(config.listen)
    except RuntimeError:
        port = 0
    if port == 0:
        raise ValueError(f"cannot listen on {config.listen}: the port is taken or the host is not an address here")
    return [address, f"{config.listen.rpartition(':')[0]}:{port}"]
