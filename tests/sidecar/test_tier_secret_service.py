"""The tier secret through the sidecar: set by HICACHE_TIER_SECRET or a file, a page another
writer left in the tier is a miss for Reload, counted, and the sidecar's own pages load."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from sidecar_util import filled_device, keys, register, service

from hicache.api import KeyStatus
from hicache.storage import make_tier
from server.config import parse_args

SECRET = b"a-tier-secret-for-the-sidecar-test"
S = KeyStatus


def test_the_secret_comes_from_the_environment_or_a_file_and_is_never_shown(tmp_path) -> None:
    config, _ = parse_args([], {"HICACHE_TIER_SECRET": SECRET.decode()})
    assert config.service.hierarchy.tier_secret == SECRET and SECRET.decode() not in repr(config)
    path = tmp_path / "secret"
    path.write_bytes(SECRET)
    config, _ = parse_args(["--hicache-tier-secret-file", str(path)], {})
    assert config.service.hierarchy.tier_secret == SECRET
    assert parse_args([], {})[0].service.hierarchy.tier_secret == b""  # none: pages carry no MAC
    with pytest.raises(ValueError, match="at least 16 bytes"):
        parse_args([], {"HICACHE_TIER_SECRET": "too-short"})


def test_a_page_overwritten_in_the_tier_is_not_found_and_the_rest_load_exact(tmp_path) -> None:
    svc = service(tmp_path, tier_secret=SECRET)
    dev = filled_device(4)
    try:
        info = register(svc, dev)
        ks, src = keys(4), [dev.read_page(p).clone() for p in range(4)]
        assert svc.offload("o", info.pool_id, ks, [0, 1, 2, 3]).statuses == (S.STORED,) * 4
        cache = svc.pool(info.pool_id).cache
        assert cache.flush(30)
        assert svc.evict("e", info.pool_id, num_pages=4).pages_freed == 4
        # someone who can write to the folder, but has no secret, replaces the last page
        attacker = make_tier(
            "file", {"dir": str(tmp_path / "tier")}, dataclasses.replace(cache.storage.identity, secret=b"")
        )
        assert attacker.set(ks[3], bytes(dev.geometry.page_bytes))
        attacker.close()
        dev.flat.zero_()
        r = svc.reload("r", info.pool_id, ks, [0, 1, 2, 3])
        assert r.statuses == (S.LOADED_FROM_STORAGE,) * 3 + (S.NOT_FOUND,)
        assert all(torch.equal(src[i], dev.read_page(i)) for i in range(3))
        assert cache.storage.stats().forged == 1 and not cache.storage.contains(ks[3])
        svc.check_integrity()
    finally:
        svc.close()
        dev.close()
