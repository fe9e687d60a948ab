"""HiCacheSidecarStorage: hicache as SGLang's HiCache storage backend (the L3 below SGLang's
host pool), over a running hicache-server.

SGLang builds it with `cls(storage_config, kwargs)` and registers its host pools; every
host pool (the KV pool, and an SWA pool for hybrid models) becomes one sidecar pool, whose
geometry the sidecar checks at registration, so a mismatch fails SGLang's start-up. A
sidecar that is down at start-up does not stop SGLang: one warning, misses, and the pool is
registered once the sidecar answers (what is settled before a pool registers, and the
refusals that stop SGLang's start-up, are in pool_setup). The data-path methods never
raise: a sidecar that is down or restarting gives misses (False, 0).
"""

from __future__ import annotations

import logging
import threading
from typing import Any

import torch
from sglang.srt.mem_cache.hicache_storage import (
    HiCacheStorage,
    HiCacheStorageConfig,
    HiCacheStorageExtraInfo,
    PoolHitPolicy,
    PoolTransfer,
    PoolTransferResult,
)

from hicache.client import HiCacheClient, HiCacheRpcError
from hicache.integrations.sglang.link import PoolLink, page_numbers
from hicache.integrations.sglang.options import Options
from hicache.integrations.sglang.pool_setup import (
    check_mla_readers,
    copy_path,
    pool_geometry,
    pool_identity,
    sglang_kv_cache_dtype,  # noqa: F401
    sglang_nodes,
)

log = logging.getLogger("hicache.integrations.sglang")
GROUPS = {"kv": "full", "swa": "swa"}  # SGLang host pool name -> hicache KV group
RETRY_S = 1.0  # how often a sidecar that was down at start-up is asked again


class HiCacheSidecarStorage(HiCacheStorage):  # type: ignore[misc]
    def __init__(self, storage_config: HiCacheStorageConfig, kwargs: dict[str, Any] | None = None):
        self.storage_config = storage_config
        self.options = Options.parse(storage_config.extra_config)
        self.model_id = self.options.model_id or storage_config.model_name
        if not self.model_id:
            raise ValueError("SGLang gave no model_name: set 'model_id' in --hicache-storage-backend-extra-config")
        self.client = HiCacheClient(self.options.target, token=self.options.token, timeout=self.options.timeout_s)
        self.links: dict[str, PoolLink] = {}
        self.registered_pools: dict[str, Any] = {}
        self._said: set[str] = set()
        self._waiting: set[str] = set()  # host pools whose sidecar was down at start-up
        self._closed = threading.Event()

    # ---- registration (start-up: a refusal raises, so SGLang fails to start) ---------------
    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        super().register_mem_pool_host(mem_pool_host)
        self._link("kv", mem_pool_host)

    def register_mem_host_pool_v2(self, host_pool: Any, host_pool_name: Any) -> None:
        super().register_mem_host_pool_v2(host_pool, host_pool_name)
        name = str(host_pool_name)
        if name not in self.links:
            self._link(name, host_pool)

    def _link(self, name: str, host_pool: Any) -> None:
        group = GROUPS.get(name)
        if group is None:
            self._say(f"pool:{name}", f"host pool {name!r} has no hicache group ({sorted(GROUPS)}); it gets misses")
            return
        cfg, opts = self.storage_config, self.options
        mla = bool(cfg.is_mla_model)
        geometry = pool_geometry(cfg, opts, name, group, host_pool)
        register_kw = pool_identity(cfg, opts.namespace, self.model_id)
        direct, how = copy_path(opts, self.client.target, host_pool)

        def connect() -> PoolLink:
            link = PoolLink(
                self.client,
                host_pool,
                geometry,
                group=group,
                flat_pages=opts.staging_pages,
                register_kw=register_kw,
                direct=direct,
            )
            if mla and name == "kv":
                try:
                    check_mla_readers(cfg, opts.target, self.client, link, sglang_nodes, self._say)
                except BaseException:
                    link.close()
                    raise
            return link

        try:
            link = connect()
        except (HiCacheRpcError, OSError) as exc:
            if not down(exc):
                raise ValueError(f"hicache sidecar at {opts.target} refused SGLang's {name!r} pool: {exc}") from None
            self._say(
                "down",
                f"the sidecar at {opts.target} does not answer ({exc}): SGLang starts without it and its "
                f"{name!r} pool gets misses until it answers (asked every {RETRY_S:g} s; is hicache-server "
                "running there? check 'target' in the extra config)",
            )
            self._waiting.add(name)
            threading.Thread(target=self._link_later, args=(name, connect, how), daemon=True).start()
            return
        self._linked(name, link, how)

    def _linked(self, name: str, link: PoolLink, how: str) -> None:
        self.links[name] = link
        self._waiting.discard(name)
        log.info("hicache: SGLang pool %r is sidecar pool %s, %s (%s)", name, link.pool_id, how, link.geometry)

    def _link_later(self, name: str, connect: Any, how: str) -> None:
        """A pool whose sidecar was down at start-up: connect() every RETRY_S s until it
        answers (quietly: start-up said it once). A refusal then is logged, and it stays
        unlinked (misses)."""
        while not self._closed.wait(RETRY_S):
            try:
                link = connect()
            except (HiCacheRpcError, OSError) as exc:
                if down(exc):
                    continue
                log.error("hicache: the sidecar at %s refused SGLang's %r pool: %s", self.options.target, name, exc)
                return
            except ValueError as exc:
                log.error("hicache: SGLang's %r pool cannot use the sidecar at %s: %s", name, self.options.target, exc)
                return
            self._linked(name, link, how)
            return

    # ---- the data path: never raises ---------------------------------------------------------
    def _say(self, what: str, message: str) -> None:
        """Log `message` once per `what` (a failing sidecar must not flood SGLang's log)."""
        if what not in self._said:
            self._said.add(what)
            log.warning("hicache: %s", message)

    def _failed(self, method: str, exc: Exception) -> None:
        if isinstance(exc, KeyError) and exc.args and exc.args[0] in self._waiting:
            return  # not linked yet: start-up said so once
        kind = exc.code.name if isinstance(exc, HiCacheRpcError) else type(exc).__name__
        self._say(f"{method}:{kind}", f"{method} answered as a miss: {exc}")

    @staticmethod
    def _keys(keys: list[str]) -> list[bytes]:
        """SGLang's 64-hex SHA-256 page hashes as hicache's 32-byte keys (ValueError if not)."""
        out = [bytes.fromhex(k) for k in keys]
        if any(len(k) != 32 for k in out):
            raise ValueError("SGLang keys must be 64-hex-digit SHA-256 strings")
        return out

    def _writer(self) -> bool:
        return bool(getattr(self.storage_config, "is_storage_writer", True))

    def batch_exists(self, keys: list[str], extra_info: HiCacheStorageExtraInfo | None = None) -> int:
        try:
            return self.links["kv"].exists(self._keys(keys)) if keys else 0
        except Exception as exc:
            self._failed("batch_exists", exc)
            return 0

    def batch_get_v1(
        self, keys: list[str], host_indices: torch.Tensor, extra_info: HiCacheStorageExtraInfo | None = None
    ) -> list[bool]:
        return self._io("batch_get_v1", "kv", keys, host_indices, write=False)

    def batch_set_v1(
        self, keys: list[str], host_indices: torch.Tensor, extra_info: HiCacheStorageExtraInfo | None = None
    ) -> list[bool]:
        return self._io("batch_set_v1", "kv", keys, host_indices, write=True)

    def _io(self, method: str, name: str, keys: list[str], host_indices: Any, *, write: bool) -> list[bool]:
        if write and not self._writer():
            return [True] * len(keys)  # MLA: one rank stores what every rank reads
        try:
            link = self.links[name]
            pages = page_numbers(host_indices, link.host_pool.page_size, len(keys))
            ks = self._keys(keys)
            return link.set(ks, pages) if write else link.get(ks, pages)
        except Exception as exc:
            self._failed(f"{method}[{name}]", exc)
            return [False] * len(keys)

    # ---- hybrid models: one PoolTransfer per host pool (SGLang's v2 interface) ---------------
    def batch_exists_v2(
        self,
        keys: list[str],
        pool_transfers: list[PoolTransfer] | None = None,
        extra_info: HiCacheStorageExtraInfo | None = None,
    ) -> PoolTransferResult:
        try:
            ks = self._keys(keys)
            kv = self.links["kv"].exists(ks) if ks else 0
            hits: dict[str, int] = {"kv": kv} if kv else {}
            restorable = set(range(1, kv + 1))
            for t in pool_transfers or []:
                name = str(t.name)
                present = self.links[name].tiers(ks[:kv]) if name in self.links and kv else [False] * kv
                if t.hit_policy == PoolHitPolicy.TRAILING_PAGES:  # only the last len(t.keys) pages
                    window = max(1, len(t.keys or []))
                    ok = {n for n in range(1, kv + 1) if all(present[max(0, n - window) : n])}
                else:  # ALL_PAGES: every page of the prefix
                    ok = set(range(1, next((i for i, p in enumerate(present) if not p), kv) + 1))
                if ok:
                    hits[name] = max(ok)
                restorable &= ok
            final = sorted(restorable)
            return PoolTransferResult(final[-1] if final else 0, hits, final)
        except Exception as exc:
            self._failed("batch_exists_v2", exc)
            return PoolTransferResult.empty()

    def batch_get_v2(
        self, transfers: list[PoolTransfer], extra_info: HiCacheStorageExtraInfo | None = None
    ) -> dict[str, list[bool]]:
        return {
            str(t.name): self._io("batch_get_v2", str(t.name), t.keys or [], t.host_indices, write=False)
            for t in transfers
        }

    def batch_set_v2(
        self, transfers: list[PoolTransfer], extra_info: HiCacheStorageExtraInfo | None = None
    ) -> dict[str, list[bool]]:
        return {
            str(t.name): self._io("batch_set_v2", str(t.name), t.keys or [], t.host_indices, write=True)
            for t in transfers
        }

    # ---- flat pages (SGLang without interface_v1) ----------------------------------------------
    def get(self, key: str, target_location: Any = None, target_sizes: Any = None) -> torch.Tensor | None:
        got = self.batch_get([key], [target_location])
        return got[0] if isinstance(got, list) else None

    def batch_get(self, keys: list[str], target_locations: Any = None, target_sizes: Any = None) -> list[Any]:
        out: list[Any] = []
        try:
            link, ks = self.links["kv"], self._keys(keys)
            for i, k in enumerate(ks):
                given = target_locations[i] if target_locations is not None else None
                flat = given if isinstance(given, torch.Tensor) else link.host_pool.get_dummy_flat_data_page()
                if not link.get_flat([k], [flat])[0]:
                    break
                out.append(flat)
        except Exception as exc:  # K != V pools have no flat pages: use interface_v1
            self._failed("batch_get", exc)
        return out + [None] * (len(keys) - len(out))

    def set(self, key: str, value: Any = None, target_location: Any = None, target_sizes: Any = None) -> bool:
        return self.batch_set([key], [value])

    def batch_set(
        self, keys: list[str], values: Any = None, target_locations: Any = None, target_sizes: Any = None
    ) -> bool:
        if not self._writer():
            return True
        try:
            link, ks = self.links["kv"], self._keys(keys)
            return all(link.set_flat(ks, list(values)))
        except Exception as exc:
            self._failed("batch_set", exc)
            return False

    def exists(self, key: str) -> bool:
        return self.batch_exists([key]) == 1

    def clear(self) -> None:
        """Evict this engine's pages from the sidecar's host memory (the storage tier keeps its
        pages: they are shared with other engines)."""
        for link in self.links.values():
            try:
                link.call(lambda pid, link=link: self.client.evict(num_pages=link.host_pages, pool=pid))
            except Exception as exc:
                self._failed("clear", exc)

    def close(self) -> None:
        self._closed.set()
        self.client.close()
        for link in self.links.values():
            link.close()


def down(exc: Exception) -> bool:
    """Whether a failed call means the sidecar is not there (rather than refusing)."""
    if isinstance(exc, HiCacheRpcError):
        return exc.code.name in ("UNAVAILABLE", "DEADLINE_EXCEEDED")
    return isinstance(exc, OSError)
