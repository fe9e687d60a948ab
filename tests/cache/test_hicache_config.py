import argparse
import ast
from pathlib import Path

import pytest
from tier_helpers import GEOMETRIES, key, payload

from hicache.cache import HiCacheConfig, PrefetchTimeout
from hicache.pools import HostKVPool
from hicache.storage.file import FileTier
from hicache.storage.redis import RedisTier


def parse(*argv: str) -> HiCacheConfig:
    parser = argparse.ArgumentParser()
    HiCacheConfig.add_arguments(parser)
    return HiCacheConfig.from_args(parser.parse_args(list(argv)))


def test_defaults_and_flags(tmp_path):
    d = parse()
    assert (d.storage_backend, d.write_policy, d.prefetch_policy, d.ratio) == (
        "file",
        "write_through",
        "best_effort",
        2.0,
    )
    c = parse(
        "--hicache-storage-backend", "redis",
        "--hicache-write-policy", "write_back",
        "--hicache-storage-prefetch-policy", "timeout",
        "--hicache-storage-backend-extra-config",
        '{"url": "unix:///tmp/r.sock", "timeout_s": 0.5, "prefetch_timeout_base_s": 2, "prefetch_timeout_max_s": 4}',
        "--hicache-size", "0.001",
    )  # fmt: skip
    assert c.storage_extra == {"url": "unix:///tmp/r.sock", "timeout_s": 0.5}
    assert c.prefetch_timeout == PrefetchTimeout(base_s=2, per_ki_token_s=0.25, max_s=4)
    g = GEOMETRIES["mimo_kv"]
    assert c.host_pages(g, 100) == 1_000_000 // g.page_bytes and d.host_pages(g, 100) == 200
    assert isinstance(c.make_tier(g, "m@r"), RedisTier)
    f = parse("--hicache-storage-backend-extra-config", f'{{"dir": "{tmp_path}", "max_bytes": 1000000}}')
    tier = f.make_tier(g, "m@r", namespace="t1")
    assert isinstance(tier, FileTier) and tier.max_bytes == 1_000_000
    pool = HostKVPool(g, 2)
    cache = f.build(pool, tier)
    assert cache.put([key(1)], [payload(g, 1)]) and cache.flush(60) and tier.exists(key(1))
    cache.check_integrity()
    cache.close()
    pool.close()


@pytest.mark.parametrize(
    "argv, match",
    [
        (["--hicache-storage-backend", "s3"], "'s3'"),
        (["--hicache-write-policy", "write_around"], "'write_around'"),
        (["--hicache-storage-prefetch-policy", "eager"], "'eager'"),
        (["--hicache-storage-backend-extra-config", "{dir: 1}"], "not valid JSON"),
        (["--hicache-storage-backend-extra-config", "[1]"], "must be a JSON object, got '\\[1\\]'"),
        (["--hicache-storage-backend-extra-config", '{"dri": "/x"}'], "'dri'"),
        (["--hicache-storage-backend", "redis"], 'needs "url"'),
        (
            ["--hicache-storage-backend-extra-config", '{"prefetch_timeout_max_s": -1}'],
            "max_s must be a finite number >= 0",
        ),
        (["--hicache-ratio", "-1"], "ratio must be a number >= 0, got -1"),
    ],
)
def test_bad_values_name_the_value(argv, match):
    with pytest.raises(ValueError, match=match):
        parse(*argv)


def test_control_path_does_not_import_torch():
    # hicache/__init__ imports the pools (torch), so check the sources, not sys.modules
    root = Path(__file__).resolve().parents[2] / "hicache"
    for path in [*(root / "cache").glob("*.py"), *(root / "storage").glob("*.py")]:
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            if isinstance(node, ast.ImportFrom):
                names = [node.module or ""]
            assert not any(n.split(".")[0] in ("torch", "numpy") or n.startswith("hicache.pools") for n in names), path
