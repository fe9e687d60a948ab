"""Key safety: a stored page is a hit only for the same geometry (dtype, shape, page size),
the same model identity (name + revision) and the same namespace, on the file tier and on
Redis, even when a client sends the very same key bytes. Host pages belong to one
registered pool. A page stored from one host layout is served exact to another (stored
pages use one canonical, layout-independent format)."""

from __future__ import annotations

import gc
import shutil
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from sidecar_util import filled_device, keys, zero_pages
from tier_helpers import GEOMETRIES, RedisServer

from hicache.api import KeyStatus, PoolInfo, Tier
from hicache.cache.config import HiCacheConfig
from hicache.geometry import KVGeometry
from hicache.pools import DeviceKVPool
from hicache.sidecar.config import ServiceConfig
from hicache.sidecar.service import HiCacheService
from hicache.storage.file import FileTier

S = KeyStatus
G = GEOMETRIES["mimo_kv"]
MODEL = "XiaomiMiMo/MiMo-V2-Flash@rev1"


@pytest.fixture(params=["file", "redis"])
def tier_config(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[tuple[str, dict[str, object]]]:
    if request.param == "file":
        yield "file", {"dir": str(tmp_path / "tier")}
        return
    server = RedisServer(tmp_path)
    server.start()
    yield "redis", {"url": server.url, "timeout_s": 2.0}
    server.stop()


def sidecar(tier: tuple[str, dict[str, object]], layout: str = "layer_first") -> HiCacheService:
    backend, extra = tier
    hierarchy = HiCacheConfig(storage_backend=backend, extra_config=dict(extra), ratio=1.0)
    return HiCacheService(ServiceConfig(hierarchy=hierarchy, host_layout=layout))


def register(svc: HiCacheService, dev: DeviceKVPool, model: str = MODEL, namespace: str = "t") -> str:
    info = svc.register(
        uuid.uuid4().hex,
        geometry=dev.geometry,
        device_pages=dev.num_pages,
        device_memory=dev.handle,
        model_id=model,
        namespace=namespace,
    )
    assert isinstance(info, PoolInfo)
    return info.pool_id


def store(tier: tuple[str, dict[str, object]], ks: list[bytes], layout: str = "layer_first") -> list[torch.Tensor]:
    """One sidecar stores ks (bf16, MODEL, namespace "t") and shuts down; returns the pages."""
    svc = sidecar(tier, layout)
    dev = filled_device(4, geometry=G, seed=1)
    pid = register(svc, dev)
    assert svc.offload("o", pid, ks, range(len(ks))).statuses == (S.STORED,) * len(ks)
    assert svc.pool(pid).cache.flush(30)
    src = [dev.read_page(p).clone() for p in range(len(ks))]
    svc.close()
    dev.close()
    return src


VARIANTS = {
    "dtype float16 (same page size)": (KVGeometry(**{**G.to_dict(), "dtype": "float16"}), MODEL, "t"),
    "another revision": (G, "XiaomiMiMo/MiMo-V2-Flash@rev2", "t"),
    "another model": (G, "other/model@rev1", "t"),
    "another namespace": (G, MODEL, "u"),
    "page size 8": (KVGeometry(**{**G.to_dict(), "page_size": 8}), MODEL, "t"),
    "another layer set": (KVGeometry(**{**G.to_dict(), "layer_ids": [0, 6]}), MODEL, "t"),
}


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_same_key_bytes_never_hit_across_identity(tier_config, variant):
    geometry, model, namespace = VARIANTS[variant]
    assert geometry.page_bytes <= 2 * G.page_bytes
    ks = keys(2)
    store(tier_config, ks)
    svc = sidecar(tier_config)
    dev = filled_device(4, geometry=geometry, seed=2)
    zero_pages(dev, range(4))
    pid = register(svc, dev, model, namespace)
    assert svc.lookup(pid, ks).tiers == (Tier.NONE,) * 2  # the very same key bytes: no hit
    assert svc.reload("r", pid, ks, [0, 1]).statuses == (S.NOT_FOUND,) * 2
    assert not any(dev.read_page(p).any() for p in range(4))
    assert svc.prefetch("p", pid, ks, "wait_complete").statuses == (S.MISSING,) * 2
    svc.close()
    control = sidecar(tier_config)  # the same identity does hit: the test is not vacuous
    same = filled_device(4, geometry=G, seed=3)
    pid = register(control, same)
    assert control.lookup(pid, ks).tiers == (Tier.STORAGE,) * 2
    control.close()
    dev.close()
    same.close()


@pytest.mark.parametrize("stored_layout,served_layout", [("page_first", "layer_first"), ("layer_first", "page_first")])
def test_page_stored_from_one_host_layout_is_served_exact_to_another(tier_config, stored_layout, served_layout):
    ks = keys(3)
    src = store(tier_config, ks, stored_layout)
    svc = sidecar(tier_config, served_layout)
    dev = filled_device(4, geometry=G, seed=5)
    pid = register(svc, dev)
    assert svc.reload("r", pid, ks, [3, 2, 1]).statuses == (S.LOADED_FROM_STORAGE,) * 3
    assert all(torch.equal(src[i], dev.read_page(3 - i)) for i in range(3))
    svc.check_integrity()
    svc.close()
    dev.close()


@pytest.mark.parametrize("other", [{"namespace": "u"}, {"model": MODEL + "-other"}])
def test_host_pages_belong_to_their_namespace_and_model(other):
    svc = HiCacheService(ServiceConfig())  # host memory only
    a, b = filled_device(4, geometry=G, seed=1), filled_device(4, geometry=G, seed=2)
    pa, pb = register(svc, a), register(svc, b, **other)  # same key bytes, another tenant or model
    ks = keys(2)
    svc.offload("o", pa, ks, [0, 1])
    zero_pages(b, range(4))
    assert svc.lookup(pb, ks).tiers == (Tier.NONE,) * 2
    assert svc.reload("r", pb, ks, [0, 1]).statuses == (S.NOT_FOUND,) * 2
    assert svc.evict("e", pb, ks).statuses == (S.NOT_FOUND,) * 2  # nor can another pool drop them
    assert not any(b.read_page(p).any() for p in range(4))
    assert svc.lookup(pa, ks).tiers == (Tier.HOST,) * 2
    svc.close()
    a.close()
    b.close()


def test_a_page_planted_under_another_identity_is_refused_and_deleted(tmp_path):
    """Copy tenant t's page file into tenant u's folder under the same name: the header's
    namespace hash gives it away; it is a miss, counted foreign, and deleted."""
    tier = ("file", {"dir": str(tmp_path / "tier")})
    ks = keys(1)
    store(tier, ks)
    dev = filled_device(4, geometry=G, seed=7)
    svc = sidecar(tier)
    pid = register(svc, dev, namespace="u")
    victim = svc.pool(pid).cache.storage
    assert isinstance(victim, FileTier)
    svc.close()
    planted = victim.path_of(ks[0])
    del victim, svc  # the tier goes with its last pool (make_tier shares a live one)
    gc.collect()
    (source,) = (p for p in (tmp_path / "tier").rglob(planted.name) if p != planted)
    planted.parent.mkdir(parents=True, exist_ok=True)
    shutil.copy(source, planted)
    svc = sidecar(tier)  # a restart indexes the planted file (its size is right)
    pid = register(svc, dev, namespace="u")
    zero_pages(dev, [0])
    assert svc.lookup(pid, ks).tiers == (Tier.STORAGE,)
    assert svc.reload("r", pid, ks, [0]).statuses == (S.NOT_FOUND,)
    assert not dev.read_page(0).any()
    st = svc.pool(pid).cache.storage.stats()
    assert st.foreign == 1 and not planted.exists() and source.exists()
    svc.close()
    dev.close()
