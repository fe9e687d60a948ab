"""Whether the registered pools' storage tiers can serve (what the gRPC health service says)."""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from hicache.sidecar.pool import RegisteredPool


HEALTH_PROBE_KEY = b"hicache-health-probe"
log = logging.getLogger("hicache.sidecar.service")


def storage_health(pools: Iterable[RegisteredPool]) -> tuple[bool, str]:
    """(True, "") when every pool's tier can serve; (False, why) naming each tier that is down."""
    down = []
    for pool in pools:
        storage = pool.cache.storage
        try:
            storage.contains(HEALTH_PROBE_KEY)  # an idle tier notices it is down only when used
            health = storage.health()
            ok, detail = health.healthy, health.detail
        except Exception as exc:  # a probe that fails is a tier that is down
            ok, detail = False, f"{type(exc).__name__}: {exc}"
        if not ok:
            down.append(f"pool {pool.identity.pool_id} storage tier {storage.backend!r} is down: {detail}")
    return not down, "; ".join(down)


def degraded_but_serving(pools: Iterable[RegisteredPool]) -> tuple[bool, str]:
    """storage_health() for a sidecar whose storage tier is optional: logs what is down (so
    the operator sees it) but always answers serving, since host memory still serves."""
    ok, why = storage_health(pools)
    if not ok:
        log.warning("storage degraded, still serving from host memory: %s", why)
    return True, ""
