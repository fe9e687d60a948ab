"""The adapter's keys in vLLM's kv_connector_extra_config.

vLLM reads its own keys from the same mapping (spec_name, blocks_per_chunk, ...), and new
vLLM releases add more, so keys hicache does not know are left to vLLM; a value of the wrong
type for one of hicache's keys is an error."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from hicache.integrations.options import adapter_options


@dataclass(frozen=True)
class Options:
    """target: the sidecar ("unix:///path", "/path" or "host:port"; default $HICACHE_SOCKET,
    else the server's default socket). token: its --token (default $HICACHE_TOKEN).
    namespace: the tenant. model_id: the stored pages' model identity (default vLLM's model
    name). model_config: an HF config.json that gives each group's KVGeometry (default
    <model>/config.json when the model is a local folder, else vLLM's own hf_config).
    timeout_s: each call's deadline, and how long start-up waits for the sidecar.
    lookup_ttl_s: how long a lookup answer is reused before the sidecar is asked again.
    retry_s: after a failed call, how long the scheduler answers MISS before trying again.
    rendezvous_dir: where workers publish their pool ids to the scheduler (default: the
    sidecar socket's folder, or the temp folder for a TCP target). admin_token: the sidecar's
    --admin-token (default $HICACHE_ADMIN_TOKEN), which its KV events need: with vLLM's KV
    events on, the scheduler reports hicache's stores and removals through them."""

    target: str
    token: str | None = None
    namespace: str = ""
    model_id: str | None = None
    model_config: str | None = None
    timeout_s: float = 10.0
    lookup_ttl_s: float = 1.0
    retry_s: float = 5.0
    rendezvous_dir: str | None = None
    admin_token: str | None = None

    # By hand, not pydantic: seven fields, and the messages name vLLM's config key as operators
    # type it; pydantic's would be longer and name model fields.
    @classmethod
    def parse(cls, extra: Mapping[str, Any] | None) -> Options:
        """Raises ValueError naming the key and its bad value."""
        mine = adapter_options(
            dict(extra or {}),
            cls.__dataclass_fields__,
            "kv_connector_extra_config",
            strings=("token", "model_id", "model_config", "rendezvous_dir", "admin_token"),
            seconds=("timeout_s", "lookup_ttl_s", "retry_s"),
        )
        mine.setdefault("admin_token", os.environ.get("HICACHE_ADMIN_TOKEN"))
        return cls(**mine)

    @property
    def meeting_dir(self) -> str:
        """The folder where an engine's workers publish their pool ids."""
        if self.rendezvous_dir:
            return self.rendezvous_dir
        path = self.target.removeprefix("unix://")
        if path.startswith("/"):
            return os.path.join(os.path.dirname(path), "vllm")
        return os.path.join(tempfile.gettempdir(), "hicache-vllm")
