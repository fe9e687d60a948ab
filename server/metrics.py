"""Prometheus metrics of the sidecar (`--metrics-port`).

A collector reads the service's pools at scrape time (the service keeps its own counters;
nothing here adds work to a call), and an interceptor times every RPC:

  hicache_pages_total{direction,tier}           pages moved: device_to_host, host_to_device
  hicache_bytes_total{direction,tier}             (tier host), host_to_storage, storage_to_host (tier storage)
  hicache_hits_total{tier} / hicache_misses_total{tier}   lookups per tier
  hicache_evictions_total{tier}                 host: LRU evictions; storage: its size cap
  hicache_checksum_failures_total{tier}         stored pages that failed their checksum (served as misses)
  hicache_forged_pages_total{tier}              with a tier secret: stored pages without a valid MAC (misses)
  hicache_transfer_seconds_total{direction}     time in device<->host copies (rate: bytes / seconds)
  hicache_host_pool_pages{state}                used, pinned; hicache_host_pool_capacity_pages
  hicache_host_cache_members                    pools sharing the host cache (engines, ranks of one model)
  hicache_storage_healthy{backend}, hicache_storage_write_queue_pages, hicache_pools
  hicache_copy_backend_info{backend}            1 for the pool's copy path: native, torch or triton
  hicache_rpc_duration_seconds{method,code}     histogram of every RPC (method: service/method)

Per-pool series carry the labels pool (model|namespace|group|rank: stable across
re-registrations), group and namespace. Pools that share a host cache (one model and rank
slice: hicache.sidecar.shared_cache) share that name; the cache's own figures (host pages,
hits, misses, evictions, storage traffic) are counted once, the copies of each pool summed.
The process collector adds process_* (CPU, memory, open fds).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import grpc
from prometheus_client import CollectorRegistry, Histogram, ProcessCollector, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from hicache.api import PoolStats
from hicache.sidecar.service import HiCacheService

if TYPE_CHECKING:
    from hicache.sidecar.pool import RegisteredPool

log = logging.getLogger("hicache.metrics")
POOL = ["pool", "group", "namespace"]
RPC_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


Series = tuple[Any, ...]  # (family, *label values)


class ServiceCollector(Collector):
    """Turns the service's per-pool stats into metric families at each scrape. A pool's
    series are labelled by its stable name (model|namespace|group|rank), not its random id,
    so they continue across re-registrations; pools that share a name (two replicas of one
    engine) are summed. A counter keeps what a released pool counted, read once it closed
    (the service's release hook), so that it never goes down and loses nothing."""

    def __init__(self, service: HiCacheService):
        self.service = service
        self._lock = threading.Lock()  # one scrape or release at a time: they share the tables below
        self._seen: dict[str, dict[Series, float]] = {}  # pool or cache id -> its counters at the last scrape
        self._released: dict[Series, float] = defaultdict(float)  # what released pools counted
        service.add_release_hook(self.released)

    def collect(self) -> Iterator[Metric]:
        with self._lock:
            families = self._families()
        yield from families

    def released(self, pool: RegisteredPool) -> None:
        """A pool was released (and closed: its transfers and storage writes are done): keep
        its final counts, including what it counted since the last scrape."""
        owners = [pool.identity.pool_id]
        if pool.shared.closing:  # its cache closed with it: the cache's counters end too
            owners.append(pool.shared.cache_id)
        with self._lock:
            try:
                mine, cache, _ = _counts(pool)
                finals = [mine, cache]
            except Exception:  # unreadable: what the last scrape saw is the best there is
                log.warning("pool %s: final counters unreadable; metrics keep its last scrape", pool.identity.pool_id)
                finals = [self._seen.get(owner) or {} for owner in owners]
            for owner, final in zip(owners, finals, strict=False):
                self._seen.pop(owner, None)
                for series, value in final.items():
                    self._released[series] += value

    def _families(self) -> list[Metric]:
        c, g = CounterMetricFamily, GaugeMetricFamily
        pages = c("hicache_pages", "Pages moved, by direction and tier", labels=[*POOL, "direction", "tier"])
        nbytes = c("hicache_bytes", "Bytes moved, by direction and tier", labels=[*POOL, "direction", "tier"])
        seconds = c("hicache_transfer_seconds", "Time spent in device<->host copies", labels=[*POOL, "direction"])
        hits = c("hicache_hits", "Keys found, per tier", labels=[*POOL, "tier"])
        misses = c("hicache_misses", "Keys not found, per tier", labels=[*POOL, "tier"])
        evictions = c("hicache_evictions", "Pages evicted, per tier", labels=[*POOL, "tier"])
        checksum = c("hicache_checksum_failures", "Stored pages that failed their checksum", labels=[*POOL, "tier"])
        forged = c(
            "hicache_forged_pages", "Stored pages without a valid MAC of the tier secret", labels=[*POOL, "tier"]
        )
        host = g("hicache_host_pool_pages", "Host pool pages in use, by state", labels=[*POOL, "state"])
        capacity = g("hicache_host_pool_capacity_pages", "Host pool pages in all", labels=POOL)
        members = g("hicache_host_cache_members", "Registered pools sharing the host cache", labels=POOL)
        healthy = g("hicache_storage_healthy", "1 if the storage tier can serve", labels=[*POOL, "backend"])
        queue = g("hicache_storage_write_queue_pages", "Pages waiting to be written to storage", labels=POOL)
        offloads = c("hicache_offload_keys", "Offloaded keys, by answer", labels=[*POOL, "status"])
        writes = c("hicache_storage_writes", "Storage writes, by outcome", labels=[*POOL, "result"])
        copies = g(
            "hicache_copy_backend_info",
            "1 for the backend of the pool's device<->host copies",
            labels=[*POOL, "backend"],
        )
        sums: dict[Series, float] = defaultdict(float)
        lows: dict[Series, float] = {}
        infos: set[Series] = set()
        seen: dict[str, dict[Series, float]] = {}
        pools = self.service.pool_snapshots()
        for pool in pools:
            pool_id, cache_id = pool.identity.pool_id, pool.shared.cache_id
            try:
                counts, cache_counts, s = _counts(pool)
            except Exception:  # closing while we looked: carried below
                continue
            ids = (pool.identity.series, s.group, s.namespace)
            seen[pool_id] = counts
            infos.add((*ids, s.copy_backend))
            if cache_id in seen:  # another member counted its cache
                continue
            seen[cache_id] = cache_counts
            sums[("host", *ids, "used")] += s.used_pages
            sums[("host", *ids, "pinned")] += s.pinned_pages
            sums[("capacity", *ids)] += s.host_pages
            sums[("members", *ids)] += s.cache_members
            sums[("queue", *ids)] += s.storage_write_queue
            key = ("healthy", *ids, s.storage_backend)
            lows[key] = min(lows.get(key, 1.0), 1.0 if s.storage_healthy else 0.0)
        for owner, counts in self._seen.items():
            if owner not in seen:  # closing: as last seen until its release hook retires it
                seen[owner] = counts
        self._seen = seen
        for series, value in self._released.items():
            sums[series] += value
        for counts in seen.values():
            for series, value in counts.items():
                sums[series] += value
        families: dict[str, CounterMetricFamily | GaugeMetricFamily] = {
            "pages": pages, "bytes": nbytes, "seconds": seconds, "hits": hits, "misses": misses,
            "evictions": evictions, "checksum": checksum, "forged": forged, "host": host, "capacity": capacity, "queue": queue,
            "members": members, "offloads": offloads, "writes": writes,
        }  # fmt: skip
        for (name, *labels), value in sums.items():
            families[name].add_metric(labels, value)
        for (_, *labels), value in lows.items():
            healthy.add_metric(labels, value)
        for info in sorted(infos):
            copies.add_metric(list(info), 1.0)
        pool_count = GaugeMetricFamily("hicache_pools", "Registered pools", value=len(pools))
        return [*families.values(), healthy, copies, pool_count]


def _counts(pool: RegisteredPool) -> tuple[dict[Series, float], dict[Series, float], PoolStats]:
    """The pool's own counter series (its copies), its host cache's (shared with the cache's
    other members: tiers' hits and misses, evictions, storage traffic), and its stats (for
    the gauges). Raises what a closing pool's reads raise."""
    s, cs = pool.stats(), pool.cache.stats()
    with pool.lock:
        copy_s = (pool.counters.offload_s, pool.counters.reload_s)
    ids = (pool.identity.series, s.group, s.namespace)
    st, pb = cs["storage"], max(s.page_bytes, 1)
    mine: dict[Series, float] = defaultdict(float)
    cache: dict[Series, float] = defaultdict(float)
    moved = (
        (mine, "device_to_host", "host", s.offload_bytes // pb, s.offload_bytes),
        (mine, "host_to_device", "host", s.reload_bytes // pb, s.reload_bytes),
        (cache, "host_to_storage", "storage", st["writes"], st["bytes_written"]),
        (cache, "storage_to_host", "storage", st["bytes_read"] // pb, st["bytes_read"]),
    )
    for counts, direction, tier, n_pages, n_bytes in moved:
        counts[("pages", *ids, direction, tier)] += n_pages
        counts[("bytes", *ids, direction, tier)] += n_bytes
    mine[("seconds", *ids, "device_to_host")] += copy_s[0]
    mine[("seconds", *ids, "host_to_device")] += copy_s[1]
    for t in s.tiers:
        cache[("hits", *ids, t.tier.value)] += t.hits
        cache[("misses", *ids, t.tier.value)] += t.misses
    cache[("evictions", *ids, "host")] += pool.index.evictions
    cache[("evictions", *ids, "storage")] += st["evictions"]
    cache[("checksum", *ids, "storage")] += st["corrupt"]
    cache[("forged", *ids, "storage")] += st["forged"]
    for status, n in (("stored", s.offload_stored), ("deduplicated", s.offload_deduplicated),
                      ("no_space", s.offload_no_space)):  # fmt: skip
        mine[("offloads", *ids, status)] += n
    for result, n in (("done", s.writes_done), ("dropped", s.writes_dropped), ("failed", s.write_failures)):
        cache[("writes", *ids, result)] += n
    return dict(mine), dict(cache), s


class LatencyInterceptor(grpc.ServerInterceptor):
    """Observes every RPC's duration in `histogram`, labelled with the method, as service/method
    ("hicache.v1.HiCache/Watch" and "grpc.health.v1.Health/Watch" are two), and the status
    code: CANCELLED for a call that ended without its answer (the client went away). Only
    the server's own methods are labels: another name gets no handler (UNIMPLEMENTED)."""

    def __init__(self, histogram: Histogram):
        self.histogram = histogram

    def intercept_service(
        self, continuation: Callable[[grpc.HandlerCallDetails], Any], handler_call_details: grpc.HandlerCallDetails
    ) -> Any:
        handler = continuation(handler_call_details)
        if handler is None or handler.request_streaming:
            return handler
        method = handler_call_details.method.lstrip("/")
        observe = self.histogram

        def record(t0: float, context: grpc.ServicerContext, failed: bool) -> None:
            code = _code(context) or ("CANCELLED" if not context.is_active() else "UNKNOWN" if failed else "OK")
            observe.labels(method, code).observe(time.perf_counter() - t0)

        if handler.unary_unary is not None:
            inner = handler.unary_unary

            def unary(request: Any, context: grpc.ServicerContext) -> Any:
                t0, failed = time.perf_counter(), True
                try:
                    out = inner(request, context)
                    failed = False
                    return out
                finally:
                    record(t0, context, failed)

            return grpc.unary_unary_rpc_method_handler(unary, handler.request_deserializer, handler.response_serializer)
        inner_stream = handler.unary_stream

        def stream(request: Any, context: grpc.ServicerContext) -> Iterator[Any]:
            t0, failed = time.perf_counter(), True
            try:
                yield from inner_stream(request, context)
                failed = False
            finally:
                record(t0, context, failed)

        return grpc.unary_stream_rpc_method_handler(stream, handler.request_deserializer, handler.response_serializer)


def _code(context: grpc.ServicerContext) -> str | None:
    code = getattr(context, "code", lambda: None)()
    return code.name if isinstance(code, grpc.StatusCode) else None


class Metrics:
    """A registry with the service collector and the RPC histogram; serve() exposes it."""

    def __init__(self, service: HiCacheService):
        self.registry = CollectorRegistry()
        self.registry.register(ServiceCollector(service))
        ProcessCollector(registry=self.registry)
        self.rpc_seconds = Histogram(
            "hicache_rpc_duration_seconds",
            "RPC latency by method and status code",
            ["method", "code"],
            buckets=RPC_BUCKETS,
            registry=self.registry,
        )
        self.interceptor = LatencyInterceptor(self.rpc_seconds)
        self._httpd: Any = None

    def serve(self, port: int, host: str = "127.0.0.1") -> int:
        """Start the HTTP endpoint (/metrics); returns the bound port (port 0 picks one)."""
        self._httpd, _thread = start_http_server(port, addr=host, registry=self.registry)
        bound = int(self._httpd.server_port)
        log.info("metrics on %s", metrics_url(host, bound))
        return bound

    def stop(self) -> None:
        if self._httpd is not None:
            self._httpd.shutdown()
            self._httpd.server_close()
            self._httpd = None


def metrics_url(host: str, port: int) -> str:
    """The /metrics URL of host:port (an IPv6 address in brackets)."""
    return f"http://{f'[{host}]' if ':' in host else host}:{port}/metrics"
