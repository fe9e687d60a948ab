"""The attacks of reliability round 4 (#46) on the shared host cache and the engine-copy
path, each against a real `python -m server` process; benchmarks/attacks.py runs them with
the earlier rounds' attacks.

1. register/unregister cycles: is each pool's host memory back in /dev/shm within 1 s?
2. an engine-copy offload slowed past its lease while another member offloads into the cache;
3. a member writing through its mapping of the shared host pool, onto pages another member reads;
4. one member pinning the whole shared cache;
5. an engine-copy tenant claiming 10**6 device pages of a sidecar-wide host budget;
6. a page planted in the file tier, in the page format under the victim's identity, with and
   without a tier secret.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from typing import Any

import torch
from attacks import ROOT, Outcome, geometry, rpc_code, sidecar

from hicache.api import KeyStatus
from hicache.client import HiCacheClient
from hicache.memory import MemoryHandle, local_buffer
from hicache.pools import DeviceKVPool
from hicache.storage import TierIdentity, make_tier


def _filled(pages: int, seed: int, private: bool = False) -> DeviceKVPool:
    g = geometry()
    dev = DeviceKVPool(g, pages, memory=local_buffer(g.pool_bytes(pages))) if private else DeviceKVPool(g, pages)
    dev.flat.copy_(
        torch.randint(0, 256, (dev.nbytes,), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))
    )
    return dev


def _same(a: DeviceKVPool, pa: int, b: DeviceKVPool, pb: int) -> bool:
    return bool(torch.equal(a.read_page(pa), b.read_page(pb)))


def pool_memory_release(cycles: int = 20) -> Outcome:
    used = lambda: shutil.disk_usage("/dev/shm").used  # noqa: E731
    late = []
    with sidecar("--hicache-ratio", "32") as (_, addresses):
        base = used()
        for _ in range(cycles):
            dev = _filled(4, seed=1)
            with HiCacheClient(addresses[0], timeout=60) as client:
                client.register(dev, model_id="MiMo-V2-Flash")
                client.offload(client.page_keys(list(range(4 * 64))), [0, 1, 2, 3])
            dev.close()
            t0 = time.monotonic()
            while used() > base and time.monotonic() - t0 < 1.0:
                time.sleep(0.01)
            late.append(used() - base)
    grown = max(late)
    return (
        f"{cycles} cycles of a 4-page pool with a 128-page host pool: /dev/shm at most {grown} bytes above the start 1 s after each",
        grown <= 0,
    )


def slowed_grant() -> Outcome:
    slow, other, check = _filled(8, seed=2, private=True), _filled(8, seed=3), _filled(8, seed=4, private=True)
    with sidecar("--lease-timeout", "1", "--hicache-ratio", "1") as (_, addresses):
        a, b = HiCacheClient(addresses[0], timeout=30), HiCacheClient(addresses[0], timeout=30)
        pa, pb = a.register(slow, model_id="m"), b.register(other, model_id="m")
        copier = a._copiers[pa.pool_id]
        write, started = copier.writer.offload, threading.Event()

        def paused(*args: Any, **kw: Any) -> int:
            started.set()
            time.sleep(2.5)  # the engine's copy outlives its 1 s lease; its KeepAlives go on
            return write(*args, **kw)

        copier.writer.offload = paused  # type: ignore[method-assign]
        a_keys = a.page_keys([7] * (4 * 64), pool=pa)
        t = threading.Thread(target=lambda: a.offload(a_keys, [0, 1, 2, 3], pool=pa))
        t.start()
        started.wait(30)
        time.sleep(1.5)
        b_keys = b.page_keys([8] * (8 * 64), pool=pb)
        stored = b.offload(b_keys, list(range(8)), pool=pb).statuses
        t.join(60)
        kept = [i for i, s in enumerate(stored) if s == KeyStatus.STORED]
        fresh = _filled(8, seed=3)
        b.reload([b_keys[i] for i in kept], kept, pool=pb)
        b_exact = all(_same(other, i, fresh, i) for i in kept)
        pc = a.register(check, model_id="m")
        a_back = a.reload(a_keys, [0, 1, 2, 3], pool=pc).statuses
        a_exact = a_back == (KeyStatus.LOADED,) * 4 and all(_same(slow, i, check, i) for i in range(4))
        a.close()
        b.close()
    held = b_exact and a_exact
    return (
        f"the other member: {len(kept)} STORED, {len(stored) - len(kept)} NO_SPACE, served exact: {b_exact}; the slow copy's pages exact: {a_exact}",
        held,
    )


SCRIBBLER = textwrap.dedent(
    """
    import sys
    sys.path.insert(0, "tests")
    from hicache.client import HiCacheClient
    from hicache.memory import local_buffer
    from hicache.pools import DeviceKVPool
    from sidecar_util import mimo_full
    g = mimo_full(64)
    dev = DeviceKVPool(g, 2, memory=local_buffer(g.pool_bytes(2)))
    client = HiCacheClient(sys.argv[1], timeout=10)
    info = client.register(dev, model_id="m")
    grant = client.begin_copy([bytes.fromhex(sys.argv[2])], offload=False, pool=info)  # where the victim's page lives
    host = client._copiers[info.pool_id].host
    host.flat[host.layout.page_spans([grant.host_pages[0]])[0][0]] ^= 0xFF
    print("wrote", flush=True)
    """
)


def scribbler() -> Outcome:
    victim = _filled(2, seed=5)
    with sidecar("--lease-timeout", "2") as (_, addresses), HiCacheClient(addresses[0], timeout=30) as client:
        client.register(victim, model_id="m")
        keys = client.page_keys([9] * 64)
        client.offload(keys, [0])
        out = subprocess.run(
            [sys.executable, "-c", SCRIBBLER, addresses[0], keys[0].hex()],
            cwd=ROOT, capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        back = client.reload(keys, [1]).statuses
        exact = back == (KeyStatus.LOADED,) and _same(victim, 0, victim, 1)
    wrote = "wrote" in out.stdout
    return (
        f"the write {'landed' if wrote else f'faulted (exit {out.returncode})'}; the victim's reload exact: {exact}",
        exact and not wrote,
    )


def pin_everything() -> Outcome:
    a_dev, b_dev = _filled(8, seed=6), _filled(8, seed=7)
    with sidecar("--hicache-ratio", "2") as (_, addresses):
        a, b = HiCacheClient(addresses[0], timeout=30), HiCacheClient(addresses[0], timeout=30)
        a.register(a_dev, model_id="m")
        b.register(b_dev, model_id="m")
        keys = [a.page_keys([s] * (8 * 64)) for s in (10, 11)]
        for ks in keys:
            a.offload(ks, list(range(8)))
        codes = [rpc_code(lambda ks=ks: a.pin(ks)) for ks in keys]  # type: ignore[misc]
        stored = b.offload(b.page_keys([12] * (8 * 64)), list(range(8))).statuses.count(KeyStatus.STORED)
        a.close()
        b.close()
    held = codes == ["OK", "RESOURCE_EXHAUSTED"] and stored == 8
    return f"pins of 8 then 8 more of 16 pages: {codes}; the other member then stored {stored} of 8", held


def huge_claim() -> Outcome:
    g, victim_dev = geometry(), _filled(8, seed=8)
    with sidecar("--hicache-size", f"{64 * g.page_bytes / 1e9:.9f}") as (_, addresses):
        victim, tenant = HiCacheClient(addresses[0], timeout=30), HiCacheClient(addresses[0], timeout=30)
        alone = victim.register(victim_dev, model_id="m", namespace="victim").host_pages
        for i in range(3):  # memory kind "engine": the sidecar cannot check the size claimed
            tenant.register_memory(g, 10**6, MemoryHandle("engine", 0), model_id=f"x{i}", namespace="claimant")
        after = victim.stats()[0].host_pages
        victim.close()
        tenant.close()
    victim_dev.close()
    held = after >= alone // 4
    return f"the other tenant's host share: {alone} pages alone, {after} after three claims of 10**6 pages", held


def planted_page() -> Outcome:
    """A page written into the file tier by someone without the secret, under the victim's
    identity: served without a tier secret (what that trusts), a miss with one."""
    got = []
    folder = tempfile.mkdtemp(prefix="hctier")
    secret = os.path.join(folder, "secret")
    with open(secret, "w") as f:
        f.write("a-secret-of-the-attacked-tier")
    for flags in ((), ("--hicache-tier-secret-file", secret)):
        dev = _filled(1, seed=9)
        extra = json.dumps({"dir": os.path.join(folder, "tier")})
        with sidecar("--hicache-storage-backend", "file", "--hicache-storage-backend-extra-config", extra, *flags) as (
            _,
            addresses,
        ):
            with HiCacheClient(addresses[0], timeout=30) as client:
                pool = client.register(dev, model_id="m")
                keys = client.page_keys(list(range(64)))
                client.offload(keys, [0])
                while client.stats()[0].writes_done < 1:
                    time.sleep(0.01)
                client.evict(num_pages=1)
                ident = TierIdentity(pool.geometry_fingerprint, dev.geometry.page_bytes, "m", "")
                attacker = make_tier("file", {"dir": os.path.join(folder, "tier")}, ident)
                attacker.set(keys[0], bytes(dev.geometry.page_bytes))  # chosen bytes: zeros
                attacker.close()
                got.append(client.reload(keys, [0]).statuses[0].name)
        dev.close()
    shutil.rmtree(folder, ignore_errors=True)
    held = got[1] == "NOT_FOUND"
    return f"without a secret the planted page is {got[0]}; with one, {got[1]}", held


def round4() -> list[tuple[str, Outcome]]:
    return [
        ("register/unregister cycles (host memory back)", pool_memory_release()),
        ("engine-copy offload slowed past its lease", slowed_grant()),
        ("a member writes onto another's host page", scribbler()),
        ("one member pins the whole shared cache", pin_everything()),
        ("an engine-copy tenant claims 10**6 device pages", huge_claim()),
        ("a page planted in the file tier (tier secret)", planted_page()),
    ]
