"""Operating the sidecar: flags from the environment, --help, Prometheus metrics, health
that follows the storage tier, JSON logs."""

from __future__ import annotations

import io
import json
import logging
import os
import shutil
import tempfile
import time
import urllib.request
from collections.abc import Iterator

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families
from sidecar_util import ROOT, filled_device, mimo_geometries

from hicache.cache.config import HiCacheConfig
from hicache.client import HiCacheClient
from hicache.client.health import check_health
from hicache.sidecar.config import ServiceConfig
from hicache.transfer import native
from server import ServerConfig, create_server, parse_args
from server.config import build_parser
from server.envflags import env_argv, env_name, unknown_variables
from server.logs import configure_logging
from server.metrics import metrics_url


@pytest.fixture
def sockdir() -> Iterator[str]:
    d = tempfile.mkdtemp(prefix="hc")
    yield d
    shutil.rmtree(d, ignore_errors=True)


def test_env_names_follow_one_rule():
    assert env_name("--hicache-ratio") == "HICACHE_RATIO"
    assert env_name("--socket") == "HICACHE_SOCKET"
    assert env_name("--hicache-storage-backend-extra-config") == "HICACHE_STORAGE_BACKEND_EXTRA_CONFIG"
    assert env_name("--log-level") == "HICACHE_LOG_LEVEL"
    with pytest.raises(ValueError, match="'-s'"):
        env_name("-s")


def test_every_flag_can_come_from_the_environment_and_the_command_line_wins():
    env = {
        "HICACHE_SOCKET": "/tmp/x/hc.sock",
        "HICACHE_RATIO": "3.5",
        "HICACHE_STORAGE_BACKEND": "none",
        "HICACHE_LISTEN": "127.0.0.1:0",
        "HICACHE_INSECURE": "true",
        "HICACHE_METRICS_PORT": "9400",
        "HICACHE_LOG_FORMAT": "json",
        "HICACHE_IO_BACKEND": "direct",
    }
    config, level = parse_args(["--hicache-ratio", "4"], env)
    assert config.socket == "/tmp/x/hc.sock" and config.listen == "127.0.0.1:0" and config.insecure
    assert config.service.hierarchy.ratio == 4.0 and config.service.hierarchy.storage_backend == "none"
    assert config.metrics_port == 9400 and config.log_format == "json" and level == "INFO"
    assert config.service.io_backend == "direct"
    assert parse_args([], {"HICACHE_RATIO": "3.5", "HICACHE_STORAGE_BACKEND": "none"})[0].service.hierarchy.ratio == 3.5
    with pytest.raises(ValueError, match="HICACHE_INSECURE='maybe'"):
        parse_args([], {"HICACHE_INSECURE": "maybe"})
    parser = build_parser()
    every = {env_name(s) for a in parser._actions for s in a.option_strings[:1] if s.startswith("--") and s != "--help"}
    assert len(every) == len(parser._actions) - 1  # one variable per flag
    assert env_argv(parser, {"HICACHE_INSECURE": "0"}) == []
    assert unknown_variables(parser, {"HICACHE_RATIO": "1", "HICACHE_RATOI": "1", "PATH": "/"}) == ["HICACHE_RATOI"]


def test_help_documents_every_flag_with_sglang_names():
    text = build_parser().format_help()
    for flag in (
        "--hicache-ratio",
        "--hicache-size",
        "--hicache-mem-layout",
        "--hicache-write-policy",
        "--hicache-storage-backend",
        "--hicache-storage-prefetch-policy",
        "--hicache-storage-backend-extra-config",
        "--hicache-io-backend",
        "--page-size",
        "--metrics-port",
        "--log-level",
    ):
        assert flag in text
    parser = build_parser()
    for action in parser._actions:
        if action.option_strings and action.option_strings[0] not in ("-h", "--version"):
            assert action.help and "[env HICACHE_" in action.help, action.option_strings


def scrape(port: int) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return samples(urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode())


def samples(body: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """(name, labels but pool and namespace) -> value of each sample in a /metrics body."""
    out = {}
    for family in text_string_to_metric_families(body):
        for s in family.samples:
            out[(s.name, tuple(sorted((k, v) for k, v in s.labels.items() if k not in ("pool", "namespace"))))] = (
                s.value
            )
    return out


def test_metrics_count_pages_bytes_tiers_and_rpc_latency(sockdir):
    hierarchy = HiCacheConfig(storage_backend="file", extra_config={"dir": os.path.join(sockdir, "pages")}, ratio=0.5)
    svc = ServiceConfig(expected=mimo_geometries(), hierarchy=hierarchy)
    cfg = ServerConfig(socket=os.path.join(sockdir, "hc.sock"), service=svc, metrics_port=0, metrics_host="127.0.0.1")
    srv, address = create_server(cfg)
    try:
        assert srv.metrics_port
        dev = filled_device(8)
        with HiCacheClient(address) as client:
            info = client.register(dev, model_id="mimo@test")
            keys = client.page_keys(list(range(16 * 6)))

            def drain() -> None:  # write_through: storage writes are asynchronous
                for _ in range(400):
                    if client.stats()[0].storage_write_queue == 0:
                        return
                    time.sleep(0.05)

            client.offload(keys[:4], [0, 1, 2, 3])
            drain()
            client.offload(keys[4:], [4, 5])  # a 4-page host pool: 2 evictions
            drain()
            client.reload(keys[4:], [6, 7]).wait()
            client.lookup(keys)
            m = scrape(srv.metrics_port)
        g = ("group", "full")
        pb = info.host_pages and dev.geometry.page_bytes
        assert m[("hicache_pages_total", (("direction", "device_to_host"), g, ("tier", "host")))] == 6
        assert m[("hicache_bytes_total", (("direction", "host_to_device"), g, ("tier", "host")))] == 2 * pb
        assert m[("hicache_pages_total", (("direction", "host_to_storage"), g, ("tier", "storage")))] == 6
        assert m[("hicache_evictions_total", (g, ("tier", "host")))] == 2
        assert m[("hicache_host_pool_capacity_pages", (g,))] == 4
        assert m[("hicache_host_pool_pages", (g, ("state", "used")))] == 4
        assert not any(labels and ("state", "total") in labels for _, labels in m)  # capacity is its own metric
        assert m[("hicache_transfer_seconds_total", (("direction", "device_to_host"), g))] > 0
        assert not any(name.endswith("_gbps") for name, _ in m)  # base units only
        assert m[("process_resident_memory_bytes", ())] > 0  # the process collector
        assert m[("hicache_hits_total", (g, ("tier", "host")))] >= 1
        assert m[("hicache_checksum_failures_total", (g, ("tier", "storage")))] == 0
        assert m[("hicache_storage_healthy", (("backend", "file"), g))] == 1.0
        assert m[("hicache_pools", ())] == 1
        backend = "native" if native.available() else "torch"
        assert m[("hicache_copy_backend_info", (("backend", backend), g))] == 1.0
        offload, register = (("method", f"hicache.v1.HiCache/{rpc}") for rpc in ("Offload", "RegisterPool"))
        assert m[("hicache_rpc_duration_seconds_count", (("code", "OK"), offload))] == 2
        assert m[("hicache_rpc_duration_seconds_count", (("code", "OK"), register))] == 1
        dev.close()
    finally:
        srv.stop(0)


def test_health_is_not_serving_while_the_storage_tier_is_down(sockdir):
    hierarchy = HiCacheConfig(storage_backend="redis", extra_config={"url": "redis://127.0.0.1:1/0", "timeout_s": 0.2})
    svc = ServiceConfig(expected=mimo_geometries(), hierarchy=hierarchy, io_backend="kernel")
    srv, address = create_server(
        ServerConfig(socket=os.path.join(sockdir, "hc.sock"), service=svc, health_interval_s=0.05)
    )
    try:
        assert check_health(address, timeout=15) == "NOT_SERVING"  # no pool yet: the configured Redis itself is probed
        dev = filled_device(4)
        with HiCacheClient(address) as client:
            client.register(dev, model_id="mimo@test")
            assert srv.service.pool_snapshots()[0].engine.backend == "triton"  # --hicache-io-backend kernel
            for _ in range(400):
                if check_health(address, timeout=15) == "NOT_SERVING":
                    break
                time.sleep(0.05)
            assert check_health(address, timeout=15) == "NOT_SERVING"
            assert check_health(address, service="hicache.v1.HiCache", timeout=15) == "NOT_SERVING"
            assert srv.service.healthy()[1].startswith("pool ") and "redis" in srv.service.healthy()[1]
        for _ in range(400):  # the pool is gone with its client: the backend probe speaks again
            if "unreachable" in srv.service.healthy()[1]:
                break
            time.sleep(0.05)
        assert check_health(address, timeout=15) == "NOT_SERVING" and "unreachable" in srv.service.healthy()[1]
        dev.close()
    finally:
        srv.stop(0)


def test_io_backend_names_are_checked():
    with pytest.raises(ValueError, match="'dma'"):
        ServiceConfig(io_backend="dma")


def test_json_logs_are_one_object_a_line():
    stream = io.StringIO()
    configure_logging("info", "json", stream)
    try:
        logging.getLogger("hicache.test").info("pool %s registered", "p1", extra={"pool_id": "p1"})
        logging.getLogger("hicache.test").debug("hidden")
    finally:
        configure_logging("WARNING", "text")
    (line,) = stream.getvalue().splitlines()
    record = json.loads(line)
    assert record["msg"] == "pool p1 registered" and record["level"] == "INFO" and record["pool_id"] == "p1"
    with pytest.raises(ValueError, match="--log-level"):
        configure_logging("LOUD")
    with pytest.raises(ValueError, match="--log-format"):
        configure_logging("INFO", "xml")


def test_optional_storage_tier_keeps_health_serving(sockdir):
    hierarchy = HiCacheConfig(storage_backend="redis", extra_config={"url": "redis://127.0.0.1:1/0", "timeout_s": 0.2})
    svc = ServiceConfig(expected=mimo_geometries(), hierarchy=hierarchy)
    config = ServerConfig(
        socket=os.path.join(sockdir, "hc.sock"), service=svc, health_interval_s=0.05, storage_optional=True
    )
    srv, address = create_server(config)
    try:
        dev = filled_device(4)
        with HiCacheClient(address) as client:
            client.register(dev, model_id="mimo@test")
            assert not srv.service.healthy()[0]  # the tier is down ...
            srv.monitor.poll()
            assert check_health(address, timeout=15) == "SERVING"  # ... and the sidecar still serves from host
            assert not client.stats()[0].storage_healthy
        dev.close()
    finally:
        srv.stop(0)


def test_only_unknown_ids_map_to_not_found():
    from hicache.sidecar.errors import UnknownId
    from server.servicer import abort_for

    class Aborted(Exception):
        pass

    class Context:
        def abort(self, code, details):  # type: ignore[no-untyped-def]
            raise Aborted(code, details)

    with pytest.raises(Aborted) as unknown:
        abort_for(UnknownId("unknown pool id 'p'"), Context())  # type: ignore[arg-type]
    assert unknown.value.args == (grpc.StatusCode.NOT_FOUND, "unknown pool id 'p'")
    with pytest.raises(Aborted) as internal:
        abort_for(KeyError("some internal table"), Context())  # type: ignore[arg-type]
    assert internal.value.args[0] == grpc.StatusCode.INTERNAL  # a bug, not a missing id


def test_an_internal_error_tells_the_caller_nothing_of_its_cause(caplog: pytest.LogCaptureFixture) -> None:
    from server.servicer import abort_for

    class Aborted(Exception):
        pass

    class Context:
        def abort(self, code: grpc.StatusCode, details: str) -> None:
            raise Aborted(code, details)

    with caplog.at_level(logging.ERROR, logger="hicache.server"), pytest.raises(Aborted) as internal:
        abort_for(OverflowError("secret /srv/path 0xdeadbeef"), Context())  # type: ignore[arg-type]
    code, details = internal.value.args
    assert code == grpc.StatusCode.INTERNAL and "OverflowError" not in details and "secret" not in details
    assert "secret /srv/path 0xdeadbeef" in caplog.text  # the log has it


def test_pool_series_keep_their_name_across_registrations_and_the_dashboard_queries_only_exported_metrics(sockdir):
    import json
    import re

    from hicache.sidecar.config import ServiceConfig as SC

    cfg = ServerConfig(socket=os.path.join(sockdir, "hc.sock"), service=SC(expected=mimo_geometries()), metrics_port=0)
    srv, address = create_server(cfg)
    try:
        dev = filled_device(4)

        def pool_labels() -> set[str]:
            body = urllib.request.urlopen(f"http://127.0.0.1:{srv.metrics_port}/metrics", timeout=10).read().decode()
            return {
                s.labels["pool"] for f in text_string_to_metric_families(body) for s in f.samples if "pool" in s.labels
            }

        with HiCacheClient(address) as client:
            first = client.register(dev, model_id="mimo@test", namespace="ns")
            before = pool_labels()
            client.unregister(first.pool_id)
            second = client.register(dev, model_id="mimo@test", namespace="ns")
            assert second.pool_id != first.pool_id
            assert pool_labels() == before == {"mimo@test|ns|full|tp0of1"}  # not the random pool id
            with HiCacheClient(address) as replica:  # a second pool of the same name: one series
                replica.register(dev, model_id="mimo@test", namespace="ns")
                assert pool_labels() == before
                body = (
                    urllib.request.urlopen(f"http://127.0.0.1:{srv.metrics_port}/metrics", timeout=10).read().decode()
                )
                families = list(text_string_to_metric_families(body))
                samples = {s.name: s.value for f in families for s in f.samples if s.labels.get("pool")}
                # it shares the first one's host cache: counted once, with its two members
                assert samples["hicache_host_pool_capacity_pages"] == second.host_pages
                assert samples["hicache_host_cache_members"] == 2
        exported = {s.name for f in families for s in f.samples}
        dash = json.loads((ROOT / "deploy" / "grafana" / "hicache.json").read_text())
        queried = {
            name
            for p in dash["panels"]
            for t in p["targets"]
            for name in re.findall(r"\b(hicache_[a-z_]+|process_[a-z_]+)\b", t["expr"])
        }
        assert queried and queried <= exported, queried - exported
        dev.close()
    finally:
        srv.stop(0)


def test_health_is_not_serving_until_the_first_storage_check_has_answered(sockdir):
    import threading

    from hicache.sidecar.service import HiCacheService

    service = HiCacheService(ServiceConfig(expected=mimo_geometries()))
    answer = threading.Event()
    checked = threading.Event()

    def slow_check() -> tuple[bool, str]:  # a storage tier slow to answer its first probe
        checked.set()
        answer.wait(60)
        return True, ""

    service.healthy = slow_check  # type: ignore[method-assign]
    sock = os.path.join(sockdir, "hc.sock")
    started: list[object] = []
    thread = threading.Thread(target=lambda: started.append(create_server(ServerConfig(socket=sock), service)))
    thread.start()
    try:
        assert checked.wait(60), "the first health check never ran"
        assert check_health(sock, timeout=15) == "NOT_SERVING"  # before: SERVING, unchecked
    finally:
        answer.set()
        thread.join(60)
    srv, _ = started[0]  # type: ignore[misc]
    try:
        assert check_health(sock, timeout=15) == "SERVING"
    finally:
        srv.stop(0)


def test_counters_of_pools_sharing_a_name_never_go_down_when_one_is_released(sockdir):
    cfg = ServerConfig(
        socket=os.path.join(sockdir, "hc.sock"), service=ServiceConfig(expected=mimo_geometries()), metrics_port=0
    )
    srv, address = create_server(cfg)
    devs = [filled_device(4), filled_device(4)]
    try:
        clients = [HiCacheClient(address) for _ in devs]
        infos = [c.register(d, model_id="mimo@test") for c, d in zip(clients, devs, strict=True)]  # two replicas
        for i, c in enumerate(clients):
            c.offload(c.page_keys(list(range(16 * i, 16 * (i + 2)))), [0, 1])
        moved = ("hicache_pages_total", (("direction", "device_to_host"), ("group", "full"), ("tier", "host")))
        assert scrape(srv.metrics_port)[moved] == 4
        clients[0].unregister(infos[0].pool_id)
        assert scrape(srv.metrics_port)[moved] == 4  # before: 2, a counter reset to Prometheus
        clients[1].offload(clients[1].page_keys(list(range(64, 80))), [2])
        assert scrape(srv.metrics_port)[moved] == 5
        for c in clients:
            c.close()
    finally:
        srv.stop(0)
        for d in devs:
            d.close()


def test_rpc_latency_labels_name_the_service_and_a_cancelled_stream(sockdir):
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    cfg = ServerConfig(socket=os.path.join(sockdir, "hc.sock"), metrics_port=0)
    srv, address = create_server(cfg)
    try:
        with grpc.insecure_channel(address) as channel:
            watch = health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest(service=""))
            next(watch)
            watch.cancel()
            health_watch = (("code", "CANCELLED"), ("method", "grpc.health.v1.Health/Watch"))
            for _ in range(1500):  # the server records the stream once it has seen it end
                if ("hicache_rpc_duration_seconds_count", health_watch) in scrape(srv.metrics_port):
                    break
                time.sleep(0.02)
            m = scrape(srv.metrics_port)
        methods = {dict(labels).get("method") for name, labels in m if name == "hicache_rpc_duration_seconds_count"}
        assert methods == {"grpc.health.v1.Health/Watch"}, methods  # before: "Watch", as HiCache's Watch
        assert m[("hicache_rpc_duration_seconds_count", health_watch)] == 1  # before: code OK
    finally:
        srv.stop(0)


def test_the_readme_metrics_table_names_the_labels_that_are_exported(sockdir):
    import re

    cfg = ServerConfig(socket=os.path.join(sockdir, "hc.sock"), metrics_port=0)
    srv, address = create_server(cfg)
    try:
        dev = filled_device(4)
        with HiCacheClient(address) as client:
            client.register(dev, model_id="mimo@test")
            body = urllib.request.urlopen(f"http://127.0.0.1:{srv.metrics_port}/metrics", timeout=10).read().decode()
        dev.close()
    finally:
        srv.stop(0)
    exported: dict[str, set[str]] = {}
    for family in text_string_to_metric_families(body):
        for sample in family.samples:
            name = family.name if family.type == "histogram" else sample.name
            exported.setdefault(name, set()).update(set(sample.labels) - {"pool", "group", "namespace", "le"})
    rows = 0
    for line in (ROOT / "README.md").read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) != 3 or not cells[0].startswith("`hicache_"):
            continue
        labels = set(re.findall(r"`(\w+)`", re.sub(r"\([^)]*\)", "", cells[2])))
        for metric in re.findall(r"`(hicache_\w+)`", cells[0]):
            rows += 1
            assert exported.get(metric) == labels, (metric, labels, exported.get(metric))
    assert rows >= 10


def _has_ipv6_loopback() -> bool:
    import socket

    try:
        with socket.socket(socket.AF_INET6) as s:
            s.bind(("::1", 0))
    except OSError:
        return False
    return True


def test_the_metrics_url_brackets_an_ipv6_host_and_answers_there(sockdir):
    assert metrics_url("127.0.0.1", 9100) == "http://127.0.0.1:9100/metrics"
    assert metrics_url("::1", 9100) == "http://[::1]:9100/metrics"  # was http://::1:9100, not a URL
    if not _has_ipv6_loopback():
        pytest.skip("this host has no IPv6 loopback")
    srv, _ = create_server(ServerConfig(socket=os.path.join(sockdir, "hc.sock"), metrics_port=0, metrics_host="::1"))
    try:
        assert srv.metrics_port
        body = urllib.request.urlopen(metrics_url("::1", srv.metrics_port), timeout=10).read().decode()
        assert "# TYPE hicache_pages_total counter" in body
    finally:
        srv.stop(0)


def test_a_released_pool_keeps_what_it_counted_after_the_last_scrape(sockdir):
    """Counters count what a pool did between the last scrape and its release (they stopped at
    the last scrape), and a release hook that raises is logged, not the release's failure."""
    cfg = ServerConfig(
        socket=os.path.join(sockdir, "hc.sock"), service=ServiceConfig(expected=mimo_geometries()), metrics_port=0
    )
    srv, address = create_server(cfg)
    srv.service.add_release_hook(lambda pool: 1 / 0)  # the metrics' own hook runs before it
    offloaded = ("hicache_pages_total", (("direction", "device_to_host"), ("group", "full"), ("tier", "host")))
    try:
        dev = filled_device(8)
        with HiCacheClient(address) as client:
            info = client.register(dev, model_id="mimo@test")
            keys = client.page_keys(list(range(16 * 5)))
            client.offload(keys[:2], [0, 1])
            assert scrape(srv.metrics_port)[offloaded] == 2
            client.offload(keys[2:], [2, 3, 4])  # not scraped before the release
            assert client.unregister(info.pool_id)
            assert srv.service.pool_ids == []
            assert scrape(srv.metrics_port)[offloaded] == 5
            again = client.register(dev, model_id="mimo@test")  # the same series goes on from there
            client.offload(keys[:1], [5])
            assert scrape(srv.metrics_port)[offloaded] == 6
            client.unregister(again.pool_id)
    finally:
        srv.stop(0)


def test_a_scrape_while_a_pool_closes_does_not_count_it_twice() -> None:
    from prometheus_client import generate_latest
    from sidecar_util import keys_for, make_service, register

    from server.metrics import Metrics

    svc = make_service()
    metrics = Metrics(svc)
    offloaded = ("hicache_pages_total", (("direction", "device_to_host"), ("group", "full"), ("tier", "host")))

    def counted() -> float:
        return samples(generate_latest(metrics.registry).decode()).get(offloaded, 0.0)

    info = register(svc, filled_device(8))
    svc.offload("r1", info.pool_id, keys_for(2), [0, 1])
    assert counted() == 2
    svc.pool(info.pool_id).close()  # closing, not yet released: no longer listed for metrics
    assert counted() == 2  # its last counts stay until its release retires them
    assert svc.unregister("r2", info.pool_id)
    assert counted() == 2  # retired once (before: the scrape above had retired them already)
    svc.close()
