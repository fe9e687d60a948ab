"""Where the sidecar listens by default (shared by `hicache-server` and the `hicache` CLI)."""

from __future__ import annotations

import os


def default_socket_path() -> str:
    """$XDG_RUNTIME_DIR/hicache/hicache.sock, else /tmp/hicache-$UID/hicache.sock."""
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    if runtime and os.path.isdir(runtime):
        return os.path.join(runtime, "hicache", "hicache.sock")
    return os.path.join(f"/tmp/hicache-{os.getuid()}", "hicache.sock")
