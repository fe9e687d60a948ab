"""One registered pool on the sidecar: the engine's mapped device pool, the host mirror,
the host index and the transfers between them. Validates everything before changing state.
"""

from __future__ import annotations

import contextlib
import secrets
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from hicache.batch_checks import check_keys, check_pages
from hicache.cache.index import HostIndex
from hicache.operations import Operation, OperationTable
from hicache.pools import DeviceKVPool, HostKVPool
from hicache.service_types import (
    Counters,
    EvictResult,
    KeyStatus,
    LookupResult,
    PoolStats,
    StateError,
    Tier,
    TierStats,
    TransferResult,
)
from hicache.transfer import TransferEngine


@dataclass(frozen=True)
class PoolIdentity:
    pool_id: str
    group: str
    namespace: str
    model_id: str
    key_hash: str
    key_bytes: int


class RegisteredPool:
    """Thread-safe: one lock guards the index, counters and operations. Offloads and
    all-layer reloads copy under the lock; layer-wise reloads copy in a worker thread,
    holding references on the host pages they read so that nothing evicts them.
    """

    def __init__(
        self,
        identity: PoolIdentity,
        device: DeviceKVPool,
        host: HostKVPool,
        *,
        max_batch: int,
        finished_ops_kept: int,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.identity = identity
        self.device = device
        self.host = host
        self.engine = TransferEngine(device, host)
        self.geometry = device.geometry
        self.index = HostIndex(host.num_pages)
        self.max_batch = max_batch
        self.counters = Counters()
        self.lock = threading.Lock()
        self.closed = False
        self._ops = OperationTable(finished_ops_kept)
        self._workers: list[threading.Thread] = []
        self._clock = clock

    # ---- validation (no state changes) --------------------------------------------------
    def _open(self) -> None:
        if self.closed:
            raise StateError(f"pool {self.identity.pool_id} is closed")

    def check_keys(self, keys: Sequence[bytes], *, unique: bool = False) -> list[bytes]:
        return check_keys(keys, self.identity.key_bytes, self.identity.key_hash, self.max_batch, unique=unique)

    def check_pages(self, device_pages: Sequence[int], n: int) -> list[int]:
        return check_pages(device_pages, n, self.device.num_pages)

    # ---- transfers ------------------------------------------------------------------------
    def offload(self, keys: Sequence[bytes], device_pages: Sequence[int]) -> TransferResult:
        """Copy device_pages[i] to host under keys[i]. A resident key is DEDUPLICATED; keys
        past the free + evictable host pages are NO_SPACE (the earliest keys get stored)."""
        ks = self.check_keys(keys, unique=True)
        pages = self.check_pages(device_pages, len(ks))
        with self.lock:
            self._open()
            statuses: list[KeyStatus] = [KeyStatus.DEDUPLICATED] * len(ks)
            resident = [k for k in ks if k in self.index]
            for key in resident:  # hold them so that this allocation cannot evict them
                self.index.touch(key)
                self.index.ref(key)
            new = [i for i, k in enumerate(ks) if k not in self.index]
            fits = min(len(new), self.index.free_pages + self.index.evictable_pages)
            got = self.index.allocate(fits)
            for key in resident:
                self.index.unref(key)
            assert got is not None
            host_pages, _evicted = got
            stored, refused = new[:fits], new[fits:]
            t0 = time.perf_counter()
            try:
                nbytes = self.engine.offload([pages[i] for i in stored], host_pages)
            except BaseException:
                self.index.release(host_pages)
                raise
            for i, hp in zip(stored, host_pages, strict=True):
                self.index.bind(ks[i], hp)
                statuses[i] = KeyStatus.STORED
            for i in refused:
                statuses[i] = KeyStatus.NO_SPACE
            c = self.counters
            c.offload_bytes += nbytes
            c.offload_s += time.perf_counter() - t0 if stored else 0.0
            c.stored += len(stored)
            c.deduplicated += len(resident)
            c.no_space += len(refused)
            return TransferResult(tuple(statuses), nbytes)

    def reload(self, keys: Sequence[bytes], device_pages: Sequence[int], *, layerwise: bool) -> TransferResult:
        """Copy the host page of keys[i] into device_pages[i]; absent keys are NOT_FOUND.

        Not layer-wise: copies before returning (done=True). Layer-wise: returns at once
        with an op id; a worker copies one layer at a time and publishes each to Watch.
        """
        ks = self.check_keys(keys)
        pages = self.check_pages(device_pages, len(ks))
        with self.lock:
            self._open()
            op = Operation("op-" + secrets.token_hex(8), self.geometry.layer_num)
            self._ops.add(op)
            found = [i for i, k in enumerate(ks) if k in self.index]
            statuses = tuple(KeyStatus.LOADED if k in self.index else KeyStatus.NOT_FOUND for k in ks)
            host_pages = [self.index.ref(ks[i]) for i in found]
            dev_pages = [pages[i] for i in found]
            nbytes = len(found) * self.geometry.page_bytes
            if not layerwise:
                try:
                    self._copy_layers(op, host_pages, dev_pages, per_layer=False)
                finally:
                    self._unref(ks, found)
                return TransferResult(statuses, nbytes, op.op_id, True)
            worker = threading.Thread(
                target=self._reload_worker, args=(op, ks, found, host_pages, dev_pages), daemon=True
            )
            self._workers = [w for w in self._workers if w.is_alive()] + [worker]
            worker.start()
            return TransferResult(statuses, nbytes, op.op_id, False)

    def _reload_worker(
        self, op: Operation, ks: list[bytes], found: list[int], host_pages: list[int], dev_pages: list[int]
    ) -> None:
        try:
            self._copy_layers(op, host_pages, dev_pages, per_layer=True)
        except Exception:
            pass  # already published to the operation as FAILED
        finally:
            with self.lock:
                self._unref(ks, found)

    def _copy_layers(self, op: Operation, host_pages: list[int], dev_pages: list[int], *, per_layer: bool) -> None:
        """Copy (one layer at a time when per_layer, publishing each), count, publish DONE or
        FAILED. per_layer runs without the lock held; otherwise the caller holds it."""
        t0, nbytes, layer_num = time.perf_counter(), 0, self.geometry.layer_num
        try:
            for layer in range(layer_num) if per_layer else ():
                nbytes += self.engine.reload(host_pages, dev_pages, layers=[layer])
                op.layer_done(layer, layer + 1)
            if not per_layer:
                nbytes = self.engine.reload(host_pages, dev_pages)
                for layer in range(layer_num):
                    op.layer_done(layer, layer + 1)
        except Exception as exc:
            op.failed(f"{type(exc).__name__}: {exc}", 0)
            raise
        seconds = time.perf_counter() - t0 if host_pages else 0.0
        with self.lock if per_layer else contextlib.nullcontext():
            self.counters.reload_bytes += nbytes
            self.counters.reload_s += seconds
        op.done()

    def _unref(self, ks: list[bytes], found: list[int]) -> None:
        for i in found:
            self.index.unref(ks[i])

    # ---- index operations -------------------------------------------------------------------
    def prefetch(self, keys: Sequence[bytes]) -> tuple[KeyStatus, ...]:
        """No storage tier yet: RESIDENT for keys in host memory, MISSING for the rest."""
        ks = self.check_keys(keys)
        with self.lock:
            self._open()
            return tuple(KeyStatus.RESIDENT if k in self.index else KeyStatus.MISSING for k in ks)

    def evict(self, keys: Sequence[bytes], num_pages: int) -> EvictResult:
        """Drop `keys` (EVICTED / NOT_FOUND / BUSY when pinned or being read), or, with no
        keys, free up to num_pages least recently used pages. Raises ValueError for both or neither."""
        ks = self.check_keys(keys)
        if isinstance(num_pages, bool) or not isinstance(num_pages, int) or num_pages < 0:
            raise ValueError(f"num_pages must be an int >= 0, got {num_pages!r}")
        if bool(ks) == bool(num_pages):
            raise ValueError(f"give either keys or num_pages, got {len(ks)} keys and num_pages={num_pages}")
        with self.lock:
            self._open()
            if not ks:
                return EvictResult((), len(self.index.evict(num_pages)))
            statuses = []
            for key in ks:
                if key not in self.index:
                    statuses.append(KeyStatus.NOT_FOUND)
                elif self.index.pins(key) or self.index.refs(key):
                    statuses.append(KeyStatus.BUSY)
                else:
                    self.index.remove(key)
                    statuses.append(KeyStatus.EVICTED)
            return EvictResult(tuple(statuses), statuses.count(KeyStatus.EVICTED))

    def lookup(self, keys: Sequence[bytes]) -> LookupResult:
        """Longest resident prefix and each key's tier; the prefix becomes most recently used."""
        ks = self.check_keys(keys)
        with self.lock:
            self._open()
            prefix = self.index.prefix_length(ks)
            for key in reversed(ks[:prefix]):  # the first page ends up most recently used
                self.index.touch(key)
            tiers = tuple(Tier.HOST if k in self.index else Tier.NONE for k in ks)
            hits = tiers.count(Tier.HOST)
            self.counters.host_hits += hits
            self.counters.host_misses += len(ks) - hits
            return LookupResult(prefix, tiers)

    def pin(self, keys: Sequence[bytes]) -> tuple[KeyStatus, ...]:
        ks = self.check_keys(keys)
        with self.lock:
            self._open()
            out = []
            for key in ks:
                if key in self.index:
                    self.index.pin(key)
                    out.append(KeyStatus.PINNED)
                else:
                    out.append(KeyStatus.NOT_FOUND)
            return tuple(out)

    def unpin(self, keys: Sequence[bytes]) -> tuple[KeyStatus, ...]:
        ks = self.check_keys(keys)
        with self.lock:
            self._open()
            out = []
            for key in ks:
                if key not in self.index:
                    out.append(KeyStatus.NOT_FOUND)
                elif self.index.pins(key) == 0:
                    out.append(KeyStatus.NOT_PINNED)
                else:
                    self.index.unpin(key)
                    out.append(KeyStatus.UNPINNED)
            return tuple(out)

    def operation(self, op_id: str) -> Operation:
        with self.lock:
            return self._ops.get(op_id)

    def stats(self) -> PoolStats:
        with self.lock:
            c, g, ident = self.counters, self.geometry, self.identity
            used = len(self.index)
            pinned = sum(1 for k in self.index.keys() if self.index.pins(k))
            tiers = (
                TierStats(Tier.HOST, used, used * g.page_bytes, c.host_hits, c.host_misses),
                TierStats(Tier.STORAGE, 0, 0, 0, 0),
            )
            return PoolStats(
                ident.pool_id,
                ident.group,
                ident.namespace,
                ident.model_id,
                self.device.num_pages,
                self.host.num_pages,
                used,
                pinned,
                g.page_bytes,
                tiers,
                c.offload_bytes,
                c.gbps(c.offload_bytes, c.offload_s),
                c.reload_bytes,
                c.gbps(c.reload_bytes, c.reload_s),
                len(self._ops.in_flight()),
            )

    # ---- lifecycle ----------------------------------------------------------------------------
    def close(self) -> None:
        """Refuse new calls, let in-flight transfers finish, then release host memory (unlink)
        and the device mapping. Idempotent."""
        with self.lock:
            if self.closed:
                return
            self.closed = True
            workers = list(self._workers)
        for worker in workers:
            worker.join()
        self.host.close()
        self.device.close()

    def check_integrity(self) -> None:
        with self.lock:
            self.index.check_integrity()
            if not self.closed:
                self.host.check_integrity()
                self.device.check_integrity()
                assert self.host.geometry == self.device.geometry == self.geometry
