"""The Mooncake backend's extra config, checked before anything connects (no master needed)."""

import pytest
from tier_helpers import GEOMETRIES, identity

from hicache.demo.loopback_ports import free_ports
from hicache.storage import make_tier
from hicache.storage.factory import BACKEND_OPTIONS, backend_reachable, check_extra
from hicache.storage.mooncake_options import MooncakeOptions, master_problem, parse_size

MASTER = {"master_server_address": "127.0.0.1:50051"}


def test_the_keys_are_sglangs_and_the_defaults_match_a_cpu_deployment():
    assert {
        "master_server_address",
        "metadata_server",
        "protocol",
        "device_name",
        "global_segment_size",
        "local_buffer_size",
    } <= set(BACKEND_OPTIONS["mooncake"])
    o = MooncakeOptions.from_extra({**MASTER, "global_segment_size": "2gb", "local_buffer_size": "512MB"})
    assert (o.global_segment_size, o.local_buffer_size) == (2 << 30, 512 << 20)
    assert (o.metadata_server, o.protocol, o.device_name) == ("P2PHANDSHAKE", "tcp", "")
    assert o.hostname() == "127.0.0.1"  # the address that routes to the master
    assert MooncakeOptions.from_extra({**MASTER, "local_hostname": "10.0.0.7"}).hostname() == "10.0.0.7"


@pytest.mark.parametrize("value, size", [(0, 0), (4096, 4096), ("4gb", 4 << 30), (" 16 MB ", 16 << 20), ("1kb", 1024)])
def test_sizes(value, size):
    assert parse_size("global_segment_size", value) == size


@pytest.mark.parametrize("value", [-1, "lots", "gb", "1.5gb", True, None, 2.0])
def test_bad_sizes_name_the_value(value):
    with pytest.raises(ValueError, match=f"global_segment_size .*{value!r}"):
        MooncakeOptions.from_extra({**MASTER, "global_segment_size": value})


@pytest.mark.parametrize(
    "extra, match",
    [
        ({}, 'needs "master_server_address"'),
        ({"master_server_address": "localhost"}, "host:port, got 'localhost'"),
        ({"master_server_address": "h:0"}, "host:port, got 'h:0'"),
        ({"master_server_address": "h:99999"}, "host:port, got 'h:99999'"),
        ({**MASTER, "protocol": "udp"}, "protocol must be one of.*'udp'"),
        ({**MASTER, "metadata_server": ""}, "metadata_server must not be empty"),
        ({**MASTER, "device_name": 3}, "device_name must be a string, got 3"),
        ({**MASTER, "local_buffer_size": 0}, "local_buffer_size must be >= 1 byte, got 0"),
        ({**MASTER, "backoff_initial_s": 0}, "backoff_initial_s must be a finite number > 0, got 0"),
        ({**MASTER, "backoff_initial_s": 5, "backoff_max_s": 1}, "backoff_max_s 1 is below backoff_initial_s 5"),
        ({**MASTER, "tenant": "x"}, r"unknown extra-config key\(s\) \['tenant'\]"),
    ],
)
def test_bad_options_are_refused_before_connecting(extra, match):
    with pytest.raises(ValueError, match=match):
        check_extra("mooncake", extra)
    with pytest.raises(ValueError, match=match):
        make_tier("mooncake", extra, identity(GEOMETRIES["mimo_kv"]))


def test_an_unreachable_master_is_named():
    (port,) = free_ports(1, bus=False)
    extra = {"master_server_address": f"127.0.0.1:{port}", "connect_timeout_s": 0.5}
    problem = master_problem(MooncakeOptions.from_extra(extra))
    assert f"mooncake master 127.0.0.1:{port} is unreachable" in problem
    assert backend_reachable("mooncake", extra) == (False, problem)
    assert backend_reachable("mooncake", {"master_server_address": "nope"})[0] is False


def test_a_missing_mooncake_package_is_named(monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "mooncake.store", None)  # import fails as without the wheel
    reachable, why = backend_reachable("mooncake", MASTER)
    assert not reachable and "pip install hicache[mooncake]" in why and "libibverbs1" in why
