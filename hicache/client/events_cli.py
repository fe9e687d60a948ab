"""`hicache events`: a sidecar's KV events as JSON lines, one per event, for routers and jq."""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from typing import Any, TextIO

from hicache.api import EventBatch, Tier
from hicache.client import ClientTls, HiCacheClient, HiCacheRpcError


def event_lines(batch: EventBatch) -> Iterator[dict[str, Any]]:
    """One JSON-ready dict per event (keys as hex), then {"kind": "dropped", ...} when the
    subscriber lost events after them. `seq` numbers events as the batch does."""
    for i, e in enumerate(batch.events):
        p = e.pool
        line: dict[str, Any] = {"seq": batch.sequence + i, "ts": round(batch.timestamp, 6), "kind": e.kind.value}
        if e.tier is not Tier.NONE:
            line["tier"] = e.tier.value
            line["keys"] = [k.hex() for k in e.keys]
        line.update(
            pool_id=p.pool_id, namespace=p.namespace, model_id=p.model_id, group=p.group, tp_rank=p.tp_rank,
            tp_size=p.tp_size,
        )  # fmt: skip
        yield line
    if batch.dropped:
        yield {"seq": batch.sequence + len(batch.events), "kind": "dropped", "count": batch.dropped}


def print_events(
    target: str,
    *,
    namespace: str | None,
    snapshot: bool,
    duration: float | None,
    token: str | None,
    admin_token: str | None,
    out: TextIO = sys.stdout,
    tls: ClientTls | None = None,
) -> int:
    """Follow the sidecar's events until interrupted or `duration` s; returns 0, or 1 if
    the sidecar refused (wrong admin token) or went away."""
    with HiCacheClient(target, token=token, retries=0, admin_token=admin_token, tls=tls) as client:
        try:
            for batch in client.events(namespace, snapshot=snapshot, duration=duration):
                for line in event_lines(batch):
                    out.write(json.dumps(line) + "\n")
                out.flush()
        except HiCacheRpcError as exc:
            print(f"hicache events: {target}: {exc}", file=sys.stderr)
            return 1
    return 0
