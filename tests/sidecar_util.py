"""Shared helpers for the sidecar tests: MiMo-V2-Flash geometries, services, servers."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch
from conftest import load_config

from hicache.api import PoolInfo
from hicache.cache.config import HiCacheConfig
from hicache.geometry import KVGeometry, model_geometries
from hicache.keys import page_keys
from hicache.memory import shm_dir
from hicache.pools import DeviceKVPool
from hicache.sidecar.config import ServiceConfig
from hicache.sidecar.service import HiCacheService

PAGE_SIZE = 16  # small pages keep the tests fast; the geometry is MiMo-V2-Flash's otherwise
CONFIG_PATH = Path(__file__).parent / "fixtures" / "model_configs" / "mimo_v2_flash.json"
ROOT = Path(__file__).resolve().parent.parent
MODEL = "test-model@rev1"


def mimo_geometries(page_size: int = PAGE_SIZE) -> dict[str, KVGeometry]:
    return model_geometries(load_config("mimo_v2_flash"), tp_size=1, page_size=page_size, dtype="bfloat16")


def mimo_full(page_size: int = PAGE_SIZE) -> KVGeometry:
    return mimo_geometries(page_size)["full"]


def make_service(**overrides: object) -> HiCacheService:
    kwargs: dict[str, object] = {"expected": mimo_geometries()}
    kwargs.update(overrides)
    return HiCacheService(ServiceConfig(**kwargs))  # type: ignore[arg-type]


def filled_device(num_pages: int = 8, seed: int = 0, geometry: KVGeometry | None = None) -> DeviceKVPool:
    """A CPU device pool in shared memory with random finite K/V values."""
    pool = DeviceKVPool(geometry or mimo_full(), num_pages)
    gen = torch.Generator().manual_seed(seed)
    for layer in range(pool.geometry.layer_num):
        for buf in pool.layer_buffers(layer):
            buf.copy_(torch.randn(buf.shape, generator=gen))
    return pool


def keys_for(n_pages: int, seed: int = 0, namespace: str = "") -> list[bytes]:
    tokens = torch.randint(0, 150000, (n_pages * PAGE_SIZE,), generator=torch.Generator().manual_seed(seed))
    return page_keys(tokens.numpy(), PAGE_SIZE, namespace)


def shm_exists(name: str) -> bool:
    return os.path.exists(os.path.join(shm_dir(), name))


def pages_of(pool: DeviceKVPool, pages: list[int]) -> list[torch.Tensor]:
    return [pool.read_page(p).clone() for p in pages]


def zero_pages(pool: DeviceKVPool, pages: range | list[int]) -> None:
    """Overwrite whole pages with zero bytes (every layer and buffer)."""
    zeros = bytes(pool.geometry.page_bytes)
    for p in pages:
        pool.write_page(p, zeros)


def all_zero(pool: DeviceKVPool, pages: range | list[int]) -> bool:
    return all(not pool.read_page(p).any() for p in pages)


def service(tmp: Path, backend: str = "file", **hierarchy: object) -> HiCacheService:
    extra = {"dir": str(tmp / "tier")} if backend == "file" else hierarchy.pop("extra", {})
    cfg = HiCacheConfig(storage_backend=backend, extra_config=extra, ratio=1.0, **hierarchy)  # type: ignore[arg-type]
    return HiCacheService(ServiceConfig(hierarchy=cfg))


def register(svc: HiCacheService, dev, namespace: str = "") -> PoolInfo:  # type: ignore[no-untyped-def]
    info = svc.register(
        "reg",
        geometry=dev.geometry,
        device_pages=dev.num_pages,
        device_memory=dev.handle,
        model_id=MODEL,
        namespace=namespace,
    )
    assert isinstance(info, PoolInfo)
    return info


def keys(n: int, seed: int = 0, namespace: str = "") -> list[bytes]:
    tokens = torch.randint(0, 50000, (n * 4,), generator=torch.Generator().manual_seed(seed))
    return page_keys(tokens.numpy(), 4, namespace)


def start_in_process(sockdir: str, token: str | None = None, **service: object) -> tuple[Any, str]:
    """A sidecar's gRPC server in this process on sockdir/hc.sock, expecting MiMo's geometries
    (with `service` overriding ServiceConfig fields): (server, address)."""
    from server import ServerConfig, create_server

    svc = ServiceConfig(**{"expected": mimo_geometries(), **service})  # type: ignore[arg-type]
    return create_server(ServerConfig(socket=os.path.join(sockdir, "hc.sock"), token=token, service=svc))


def start_sidecar(
    sockdir: str, *extra: str, config: Path = CONFIG_PATH, page_size: int = PAGE_SIZE
) -> tuple[subprocess.Popen[bytes], str]:
    """`python -m server` on sockdir/hc.sock with the model `config` and, unless `extra` names
    a storage backend, the file tier in sockdir/tier."""
    sock = os.path.join(sockdir, "hc.sock")
    args = ["--socket", sock, "--model-config", str(config), "--page-size", str(page_size)]
    if "--hicache-storage-backend" not in extra:  # the default backend: the file tier
        args += ["--hicache-storage-backend-extra-config", json.dumps({"dir": os.path.join(sockdir, "tier")})]
    proc = subprocess.Popen(
        [sys.executable, "-m", "server", *args, "--kv-cache-dtype", "bfloat16", "--log-level", "WARNING", *extra],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    return proc, f"unix://{sock}"


class SecretStub:
    """A raw HiCache stub whose every call carries one pool's secret (x-hicache-pool-secret),
    as HiCacheClient sends it for the pool a call names."""

    def __init__(self, stub: object, secret: str):
        self._stub, self.secret = stub, secret

    def __getattr__(self, name: str) -> object:
        method = getattr(self._stub, name)

        def call(request: object, **kw: object) -> object:
            extra = tuple(kw.pop("metadata", ()))  # type: ignore[arg-type]
            return method(request, metadata=(*extra, ("x-hicache-pool-secret", self.secret)), **kw)

        return call


def wait_stored(client: object, pages: int, tries: int = 2000) -> None:
    """Wait (tries x 10 ms) until the default pool's storage write queue is empty and its
    storage tier holds at least `pages` pages. Raises AssertionError."""
    import time

    for _ in range(tries):
        st = client.stats()[0]  # type: ignore[attr-defined]
        if st.storage_write_queue == 0 and st.tiers[1].pages >= pages:
            return
        time.sleep(0.01)
    raise AssertionError(f"storage writes did not finish: {client.stats()[0]}")  # type: ignore[attr-defined]
