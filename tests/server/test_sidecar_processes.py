"""Two real processes: this test process is the engine (a CPU DeviceKVPool in shared memory),
the sidecar runs as `python -m server` on a Unix socket."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from sidecar_util import PAGE_SIZE, filled_device, mimo_full, shm_exists, start_sidecar

from hicache.api import KeyStatus
from hicache.client import HiCacheClient, HiCacheRpcError
from hicache.geometry import KVGeometry
from hicache.pools import DeviceKVPool

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def sidecar() -> Iterator[str]:
    sockdir = tempfile.mkdtemp(prefix="hc")
    proc, address = start_sidecar(sockdir)
    yield address
    proc.terminate()
    proc.wait(timeout=60)
    shutil.rmtree(sockdir, ignore_errors=True)


def attention(pool: DeviceKVPool, layer: int, pages: list[int], q: torch.Tensor) -> torch.Tensor:
    """softmax(q K^T / sqrt(d)) V over the tokens of `pages`. Shape: [heads, v_head_dim]."""
    slots = torch.cat([torch.arange(p * PAGE_SIZE, (p + 1) * PAGE_SIZE) for p in pages])
    k, v = pool.k_buffer(layer)[slots].float(), pool.v_buffer(layer)[slots].float()
    scores = torch.einsum("hd,thd->ht", q, k) / k.shape[-1] ** 0.5
    return torch.einsum("ht,thd->hd", scores.softmax(-1), v)


def test_engine_offloads_zeroes_and_reloads_bit_exact(sidecar):
    g = mimo_full()
    assert (g.head_dim, g.v_head_dim) == (192, 128)
    dev = filled_device(16, seed=7)
    client = HiCacheClient(sidecar, timeout=60)
    client.register(dev, namespace="tenant", model_id="MiMo-V2-Flash")
    gen = torch.Generator().manual_seed(1)
    sequences = [torch.randint(0, 150000, (n * PAGE_SIZE + 3,), generator=gen).numpy() for n in (3, 2, 2)]
    placed = [[0, 1, 2], [3, 4], [5, 6]]
    moved = [[8, 9, 10], [11, 12], [13, 14]]
    q = torch.randn(g.head_num, g.head_dim, generator=gen)
    keys, pages_before, attn_before = [], [], []
    for tokens, pages in zip(sequences, placed, strict=True):
        ks = client.page_keys(tokens)
        assert len(ks) == len(pages)
        keys.append(ks)
        pages_before.append([dev.read_page(p).clone() for p in pages])
        attn_before.append([attention(dev, layer, pages, q) for layer in range(g.layer_num)])
        assert client.offload(ks, pages).statuses == (KeyStatus.STORED,) * len(ks)
    assert client.offload(keys[0], placed[0]).statuses == (KeyStatus.DEDUPLICATED,) * 3
    dev.flat.zero_()
    for i, (ks, pages) in enumerate(zip(keys, moved, strict=True)):
        assert client.lookup(ks).prefix_length == len(ks)
        handle = client.reload(ks, pages, layerwise=(i == 1))
        handle.wait(timeout=60)
        assert handle.statuses == (KeyStatus.LOADED,) * len(ks)
    for i, pages in enumerate(moved):
        for before, p in zip(pages_before[i], pages, strict=True):
            assert torch.equal(before, dev.read_page(p))
        for layer in range(g.layer_num):
            assert torch.equal(attn_before[i][layer], attention(dev, layer, pages, q))
    assert not dev.flat[: dev.page_slots(0).stop].any()  # page 0 stayed zero: nothing reloaded into it
    stats = client.stats()[0]
    assert stats.used_pages == 7 and stats.offload_bytes == 7 * g.page_bytes
    dev.check_integrity()
    client.close()
    dev.close()


def test_v192_engine_is_refused_naming_v_head_dim(sidecar):
    wrong = KVGeometry(**{**mimo_full().to_dict(), "v_head_dim": 192})
    dev = DeviceKVPool(wrong, 2)
    with HiCacheClient(sidecar, timeout=60) as client:
        with pytest.raises(HiCacheRpcError) as exc:
            client.register(dev, model_id="MiMo-V2-Flash")
    assert exc.value.code.name == "INVALID_ARGUMENT" and "v_head_dim" in exc.value.details
    assert exc.value.details.endswith("model config: v_head_dim (engine 192, sidecar 128)")  # that field only
    dev.close()


DYING_ENGINE = textwrap.dedent(
    """
    import os, sys
    sys.path.insert(0, "tests")
    from sidecar_util import filled_device
    from hicache.client import HiCacheClient
    dev = filled_device(4)
    info = HiCacheClient(sys.argv[1], timeout=60).register(dev, model_id="MiMo-V2-Flash")
    print(info.host_shm_name, dev.handle.name, flush=True)
    os._exit(0)  # dies without unregistering
    """
)


def test_dead_client_is_reclaimed_and_sigterm_shuts_down_cleanly():
    sockdir = tempfile.mkdtemp(prefix="hc")
    proc, address = start_sidecar(sockdir, "--lease-timeout", "2", "--admin-token", "adm")
    try:
        child = subprocess.run(
            [sys.executable, "-c", DYING_ENGINE, address], cwd=ROOT, capture_output=True, text=True, timeout=120
        )
        assert child.returncode == 0, child.stderr
        host_shm, dev_shm = child.stdout.split()
        os.unlink(os.path.join("/dev/shm", dev_shm))  # the child's own leak, not the sidecar's
        client = HiCacheClient(address, timeout=60, admin_token="adm")
        for _ in range(1200):
            if not client.stats(all_pools=True):
                break
            time.sleep(0.05)
        assert client.stats(all_pools=True) == []
        assert not shm_exists(host_shm)
        dev = filled_device(4)
        info = client.register(dev, model_id="MiMo-V2-Flash")
        client.offload(client.page_keys(list(range(PAGE_SIZE))), [0])
        assert shm_exists(info.host_shm_name)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
        assert not shm_exists(info.host_shm_name)
        assert not os.path.exists(address.removeprefix("unix://"))
        dev.close()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        shutil.rmtree(sockdir, ignore_errors=True)
