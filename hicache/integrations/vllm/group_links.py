"""GroupLinks: one vLLM rank's KV-cache groups, each registered as one sidecar pool.

Registration maps vLLM's own allocation into the sidecar (its fd over the Unix socket, or a
CUDA handle); memory the sidecar cannot map is registered with the copy path "engine".
The pool ids go to the manager through the rendezvous. A sidecar that is down at start-up,
or restarts and forgets the pools, costs misses only: a watchdog thread registers the
groups again once it answers, and a transfer on a forgotten pool registers it on the spot.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field
from typing import Any

from vllm.v1.kv_offload.config import OffloadingConfig

from hicache.api import KeyStatus
from hicache.client import HiCacheClient, HiCacheRpcError
from hicache.geometry import KVGeometry
from hicache.integrations.vllm import rendezvous
from hicache.integrations.vllm.keys import KEY_HASH
from hicache.integrations.vllm.memory import GroupMemory
from hicache.integrations.vllm.options import Options

log = logging.getLogger("hicache.integrations.vllm")


class NotLinked(ConnectionError):
    """A transfer on a group that has no sidecar pool: the sidecar was down when it registered."""


@dataclass
class GroupLink:
    """One group's sidecar pool."""

    name: str
    geometry: KVGeometry
    memory: GroupMemory
    pool_id: str = ""  # "" while not registered (the sidecar was down)
    secret: str = field(default="", repr=False)
    announced: bool = False  # its copy path has been logged


class GroupLinks:
    def __init__(
        self, options: Options, config: OffloadingConfig, client: HiCacheClient, model_id: str, links: list[GroupLink]
    ):
        self.options, self.config, self.client, self.model_id = options, config, client, model_id
        self.links = links  # the worker's own list: filled before register_all
        self._lock = threading.Lock()
        self._down = False  # a call failed for want of the sidecar; it was logged once
        self.stop = threading.Event()  # ends watch()

    def register_all(self) -> None:
        """Register every link and publish their pools (start-up). A sidecar that is down is
        logged once and the links stay unregistered; any other error raises."""
        try:
            for link in self.links:
                self._register(link)
            self._publish()
        except (HiCacheRpcError, OSError) as exc:
            if not sidecar_down(exc):
                raise
            self.went_down(exc, starting=True)

    def _register(self, link: GroupLink, *, wait: bool = True) -> None:
        """Register one group's memory: vLLM's file (its fd) or CUDA allocation, which the
        sidecar maps; or memory it cannot map (vLLM's CPU worker allocates its KV cache
        privately), registered with the copy path "engine": this worker maps the sidecar's
        host pool and copies itself. That choice is logged once, as a warning, since vLLM
        shows only its own loggers' INFO lines. `wait`: wait up to timeout_s for a sidecar
        that is not up (start-up); else a sidecar that is down fails at once. Raises
        HiCacheRpcError or OSError."""
        p, m = self.config.parallel, link.memory
        common: dict[str, Any] = dict(
            namespace=self.options.namespace,
            model_id=self.model_id,
            group=link.name,
            key_hash=KEY_HASH,
            tp_rank=p.rank,
            tp_size=p.world_size,
        )
        if m.private is not None:
            info = self.client.register_engine_copy(
                link.geometry, m.num_blocks, m.private, device_layout=m.layout, wait=wait, **common
            )
            if not link.announced:  # the first registration, not one after a sidecar restart
                log.warning(
                    "hicache: vLLM's KV cache (group %s) is in private memory: this worker copies it (copy path 'engine')",
                    link.name,
                )
        else:
            (fd_id,) = self.client.send_fds([m.fd]) if m.cuda is None else ("",)
            info = self.client.register_memory(
                link.geometry,
                m.num_blocks,
                m.handle(fd_id),
                device_layout=m.layout,
                cuda_device=m.cuda_device,
                wait=wait,
                **common,
            )
        link.pool_id, link.secret, link.announced = info.pool_id, info.secret, True

    def _publish(self) -> None:
        pools = {g: (link.pool_id, link.secret) for g, link in enumerate(self.links)}
        rendezvous.publish(self.options.meeting_dir, self.config.engine_id, self.config.parallel.rank, pools)

    def call_pool(self, link: GroupLink, fn: str, keys: list[bytes], blocks: list[int]) -> tuple[KeyStatus, ...]:
        """client.offload/reload on the link's pool; a pool the sidecar forgot (it restarted)
        is registered again, published, and the call made once more. Raises HiCacheRpcError,
        or NotLinked while the link has no pool and the sidecar is still down."""
        pool_id = link.pool_id
        if pool_id:
            try:
                statuses = getattr(self.client, fn)(keys, blocks, pool=pool_id).statuses
                self.went_up()
                return statuses  # type: ignore[no-any-return]
            except HiCacheRpcError as exc:
                if not _forgotten(exc):
                    raise
        if not self._relink(link, pool_id):
            raise NotLinked(f"group {link.name} is not registered with the sidecar (it was down)")
        return getattr(self.client, fn)(keys, blocks, pool=link.pool_id).statuses  # type: ignore[no-any-return]

    def _relink(self, link: GroupLink, stale: str) -> bool:
        """Register the link again in place of `stale` (its pool id the sidecar forgot, or ""),
        unless another thread did meanwhile, and publish once every link has a pool. Fails at
        once (False) while the sidecar is down; other errors raise."""
        with self._lock:
            if link.pool_id != stale:
                return bool(link.pool_id)
            if stale:
                self.client.forget(stale)  # or the client would keep its secret and renew its lease
                link.pool_id = link.secret = ""
            try:
                self._register(link, wait=False)
            except (HiCacheRpcError, OSError) as exc:
                if not sidecar_down(exc):
                    raise
                self.went_down(exc)
                return False
            if all(other.pool_id for other in self.links):
                self._publish()
            was = f"lost pool {stale} (restarted?)" if stale else "answers"
            log.warning("hicache sidecar %s; group %s registered as pool %s", was, link.name, link.pool_id)
            self.went_up()
            return True

    def watch(self) -> None:
        """Every retry_s until `stop` is set: register the links that have no pool (the sidecar
        was down), or whose pool the sidecar forgot (it restarted), so that lookups find this
        worker's pools again even when vLLM sends no transfer (its scheduler refuses stores
        while lookups fail)."""
        while not self.stop.wait(self.options.retry_s):
            for link in self.links:
                pool_id = link.pool_id
                try:
                    if pool_id:
                        self.client.keep_alive(pool_id)
                        continue
                except HiCacheRpcError as exc:
                    if not _forgotten(exc):
                        if sidecar_down(exc):
                            self.went_down(exc)
                        continue
                except KeyError:  # another thread is registering it again
                    continue
                try:
                    self._relink(link, pool_id)
                except Exception as exc:
                    log.warning("hicache: registering group %s with the sidecar failed: %s", link.name, exc)

    def went_down(self, exc: Exception, *, starting: bool = False) -> None:
        """Log the first failure of an outage (one line); later ones only at debug level."""
        if self._down:
            log.debug("hicache sidecar still down: %s", exc)
            return
        self._down = True
        if starting:
            log.warning(
                "hicache: the sidecar %s does not answer (%s): vLLM serves without it, and this worker registers "
                "when it answers (asked every %.0f s)",
                self.options.target,
                _short(exc),
                self.options.retry_s,
            )
        else:
            log.warning(
                "hicache sidecar %s failed (%s): serving without it until it answers", self.options.target, _short(exc)
            )

    def went_up(self) -> None:
        self._down = False


def sidecar_down(exc: BaseException) -> bool:
    """Whether `exc` says the sidecar is not there (down, restarting, not started yet), as
    opposed to refusing this worker (geometry, token, ...)."""
    if isinstance(exc, HiCacheRpcError):
        return exc.code.name in ("UNAVAILABLE", "DEADLINE_EXCEEDED")
    return isinstance(exc, OSError)  # the fd socket (<socket>.fd) is not there


def _forgotten(exc: HiCacheRpcError) -> bool:
    """A call named a pool the sidecar does not know: it restarted, or the lease ran out."""
    return exc.code.name == "NOT_FOUND" and "pool" in exc.details


def _short(exc: Exception) -> str:
    text = exc.details if isinstance(exc, HiCacheRpcError) else str(exc)
    name = exc.code.name if isinstance(exc, HiCacheRpcError) else type(exc).__name__
    return f"{name}: {text.splitlines()[0] if text else ''}"[:200]
