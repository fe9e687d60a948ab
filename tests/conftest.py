import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from helpers import redis_binary

from hicache.demo.redis_cluster import LocalRedisCluster
from hicache.transfer import native

CONFIG_DIR = Path(__file__).parent / "fixtures" / "model_configs"
CONFIG_NAMES = sorted(p.stem for p in CONFIG_DIR.glob("*.json"))

# The CPU copy backends the round-trip tests run on. "native" needs the C extension, which
# test_native_copy.py::test_extension_is_built requires wherever a C compiler exists.
CPU_BACKENDS = ["torch", *(["native"] if native.available() else [])]


MOONCAKE_TESTS = "mooncake_tier"


def pytest_ignore_collect(collection_path: Path, config: pytest.Config) -> bool | None:
    """The Mooncake tier's tests move their pytest process into a network namespace of its
    own, so they run only in a pytest process that names their folder (make test-mooncake,
    which make test runs after the rest)."""
    if collection_path.name == MOONCAKE_TESTS and not any(MOONCAKE_TESTS in str(a) for a in config.args):
        return True
    return None


def load_config(name: str) -> dict[str, Any]:
    return json.loads((CONFIG_DIR / f"{name}.json").read_text())


@pytest.fixture
def mimo_config() -> dict[str, Any]:
    return load_config("mimo_v2_flash")


@pytest.fixture
def redis_server(tmp_path: Path) -> Iterator[Any]:
    """A private redis-server on a loopback port, for one test (tier_helpers.RedisServer)."""
    from tier_helpers import RedisServer  # it imports this module: not at the top

    server = RedisServer(tmp_path)
    server.start()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def redis_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalRedisCluster]:
    """A 3-master, 3-replica Redis Cluster on loopback ports, shared by the session's tests
    that only read and write (tests that kill or reshard start their own)."""
    redis_binary()
    with LocalRedisCluster(tmp_path_factory.mktemp("redis-cluster")) as cluster:
        yield cluster
