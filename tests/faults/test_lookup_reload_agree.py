"""Lookup and Reload agree in every tier, whatever is done to the stored pages: a property
test draws damage per page (missing, truncated, a flipped byte, another type, another size,
a foreign page under its name) in the file and Redis tiers. A key that Lookup reports as
present is served by Reload with exactly the bytes that were offloaded, or, after the first
failed read, Lookup reports it gone. No damaged page is ever served."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from sidecar_util import filled_device, keys, register, service
from tier_helpers import RedisServer

from hicache.api import KeyStatus as S
from hicache.api import Tier

DAMAGE = ["none", "missing", "truncated", "flipped", "wrong_type", "wrong_size", "foreign"]
N = 6


@pytest.fixture(scope="module")
def redis_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    server = RedisServer(tmp_path_factory.mktemp("redis"))
    server.start()
    yield server.url
    server.stop()


def _damage_file(path: Path, how: str, other: Path) -> None:
    if how == "missing":
        path.unlink()
    elif how == "truncated":
        os.truncate(path, path.stat().st_size // 2)
    elif how == "flipped":
        data = bytearray(path.read_bytes())
        data[len(data) // 2] ^= 0x40
        path.write_bytes(bytes(data))
    elif how == "wrong_type":
        path.unlink()
        os.mkfifo(path)
    elif how == "wrong_size":
        with open(path, "ab") as f:
            f.write(b"\0" * 4096)
    elif how == "foreign":
        shutil.copyfile(other, path)  # a valid page, of another key


def _damage_redis(raw: Any, name: bytes, how: str, other: bytes) -> None:
    value = raw.get(name)
    if how == "missing":
        raw.delete(name)
    elif how == "truncated":
        raw.set(name, value[: len(value) // 2])
    elif how == "flipped":
        data = bytearray(value)
        data[len(data) // 2] ^= 0x40
        raw.set(name, bytes(data))
    elif how == "wrong_type":
        raw.delete(name)
        raw.rpush(name, b"x")
    elif how == "wrong_size":
        raw.set(name, value + b"\0" * 4096)
    elif how == "foreign":
        theirs = raw.get(other) if raw.type(other) == b"string" else None
        raw.set(name, theirs if theirs else value[:-1] + bytes([value[-1] ^ 1]))


def _check(svc: Any, pool_id: str, dev: Any, ks: list[bytes], want: list[torch.Tensor], damage: list[str]) -> None:
    for i, k in enumerate(ks):
        tier = svc.lookup(pool_id, [k]).tiers[0]
        if damage[i] == "none":
            assert tier == Tier.STORAGE
        got = svc.reload(f"r{i}", pool_id, [k], [7], layerwise=False).statuses[0]
        if got == S.LOADED_FROM_STORAGE:
            assert damage[i] == "none" and torch.equal(dev.read_page(7), want[i])  # never a damaged page
        else:
            assert got == S.NOT_FOUND and damage[i] != "none"
            assert svc.lookup(pool_id, [k]).tiers[0] == Tier.NONE  # gone after the failed read
        svc.evict(f"e{i}", pool_id, [k], 0)  # back to storage only, for the next key


@pytest.mark.parametrize("backend", ["file", "redis"])
@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(damage=st.lists(st.sampled_from(DAMAGE), min_size=N, max_size=N))
def test_lookup_and_reload_agree_under_random_tier_damage(backend: str, damage: list[str], request: Any) -> None:
    tmp = Path(tempfile.mkdtemp(prefix="hc-agree-"))
    try:
        if backend == "redis":
            import redis

            url = request.getfixturevalue("redis_url")
            raw = redis.Redis.from_url(url)
            raw.flushall()
            svc = service(tmp, "redis", extra={"url": url})
        else:
            svc = service(tmp, "file")
        dev = filled_device(8, seed=len(damage))
        info = register(svc, dev)
        ks = keys(N, seed=1)
        want = [dev.read_page(p).clone() for p in range(N)]
        assert svc.offload("o", info.pool_id, ks, list(range(N))).statuses == (S.STORED,) * N
        assert svc.pool(info.pool_id).cache.flush(60)
        svc.evict("e", info.pool_id, ks, 0)  # storage only from here on
        if backend == "redis":
            names = {n[-len(k) :]: n for n in raw.keys(b"hicache:*") for k in ks if n.endswith(k)}
        else:
            paths = {k: next((tmp / "tier").rglob(k.hex() + ".page")) for k in ks}
        for i, how in enumerate(damage):
            other = ks[(i + 1) % N]
            if backend == "redis":
                _damage_redis(raw, names[ks[i]], how, names[other])
            else:
                path, other_path = paths[ks[i]], paths[other]
                if how == "foreign" and damage[(i + 1) % N] != "none" and (i + 1) % N < i:
                    how = "flipped"  # the other page was damaged already: any damage will do
                _damage_file(path, how, other_path)
        _check(svc, info.pool_id, dev, ks, want, damage)
        svc.close()
        dev.close()
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
