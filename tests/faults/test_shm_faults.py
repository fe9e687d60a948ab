"""Shared memory that runs out or changes under the sidecar: a /dev/shm that holds one host
pool while two engines register at once (Docker's default 64 MiB shm), run in a private
mount namespace with a small tmpfs on /dev/shm."""

from __future__ import annotations

import mmap
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]

RACE = textwrap.dedent(
    """
    import shutil, sys, threading
    sys.path[:0] = [{root!r}, {tests!r}]
    from sidecar_util import mimo_full
    from hicache.api import PoolInfo
    from hicache.cache.config import HiCacheConfig
    from hicache.pools import DeviceKVPool
    from hicache.sidecar.errors import NoSpace
    from hicache.sidecar.config import ServiceConfig
    from hicache.sidecar.service import HiCacheService

    g = mimo_full()
    svc = HiCacheService(ServiceConfig(hierarchy=HiCacheConfig(ratio=8.0)))
    devices = [DeviceKVPool(g, 2) for _ in range(2)]
    print("free before", shutil.disk_usage("/dev/shm").free, flush=True)
    results, start = [None, None], threading.Barrier(2)

    def register(i):
        start.wait()
        results[i] = svc.register(f"r{{i}}", geometry=g, device_pages=2, device_memory=devices[i].handle,
                                  model_id=f"m{{i}}", group="full")  # two models: two host pools

    threads = [threading.Thread(target=register, args=(i,)) for i in range(2)]
    for t in threads: t.start()
    for t in threads: t.join()
    kinds = sorted(type(r).__name__ for r in results)
    print("results", kinds, [str(r) for r in results if isinstance(r, NoSpace)], flush=True)
    assert kinds == ["NoSpace", "PoolInfo"], kinds
    svc.check_integrity()
    svc.close()
    print("ok", flush=True)
    """
)


def _can_unshare() -> bool:
    if os.geteuid() != 0 or not shutil.which("unshare"):
        return False
    probe = subprocess.run(
        ["unshare", "--mount", "--propagation", "private", "sh", "-c", "mount -t tmpfs -o size=1m tmpfs /dev/shm"],
        capture_output=True,
    )
    return probe.returncode == 0


def run_in_small_shm(script: Path, shm_bytes: int, timeout: int) -> str:
    """Run the Python `script` in a private mount namespace whose /dev/shm is a tmpfs of
    shm_bytes; returns its stdout once it exited 0 and printed "ok" last."""
    cmd = f"mount -t tmpfs -o size={shm_bytes} tmpfs /dev/shm && exec {sys.executable} {script}"
    out = subprocess.run(
        ["unshare", "--mount", "--propagation", "private", "sh", "-c", cmd],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, "TRITON_INTERPRET": "1"},
        cwd=ROOT,
    )
    assert out.returncode == 0, (out.returncode, out.stdout[-3000:], out.stderr[-3000:])  # -7 would be SIGBUS
    assert out.stdout.splitlines()[-1] == "ok", out.stdout[-3000:]
    return out.stdout


@pytest.mark.skipif(not _can_unshare(), reason="needs root and unshare to mount a private /dev/shm")
def test_two_registrations_on_a_shm_that_holds_one_host_pool_refuse_one_and_never_sigbus(tmp_path: Path) -> None:
    sys.path[:0] = [str(ROOT), str(ROOT / "tests")]
    from sidecar_util import mimo_full

    g = mimo_full()
    device, host = g.pool_bytes(2), g.pool_bytes(16)
    size = (2 * device + host + host // 2) // 4096 * 4096  # both device pools, one and a half host pools
    script = tmp_path / "race.py"
    script.write_text(RACE.format(root=str(ROOT), tests=str(ROOT / "tests")))
    out = run_in_small_shm(script, size, timeout=300)
    assert re.search(r"needs \d+ bytes, /dev/shm has \d+ free|does not fit in /dev/shm", out), out


@pytest.fixture
def sockdir() -> Iterator[str]:
    d = tempfile.mkdtemp(prefix="hc")
    yield d
    shutil.rmtree(d, ignore_errors=True)


def _memfd_engine(g: Any, pages: int, flags: int) -> tuple[int, Any]:
    fd = os.memfd_create("engine-kv", os.MFD_CLOEXEC | flags)
    os.ftruncate(fd, g.layer_num * pages * g.page_bytes_for(1))
    return fd, mmap.mmap(fd, os.fstat(fd).st_size)


def test_an_engine_that_shrinks_its_memory_gets_an_error_and_nobody_else_notices(sockdir: str) -> None:
    sys.path[:0] = [str(ROOT), str(ROOT / "tests")]
    from sidecar_util import filled_device, keys_for, mimo_full, start_sidecar

    from hicache.api import KeyStatus
    from hicache.client import HiCacheClient, HiCacheRpcError
    from hicache.memory import MemoryHandle, shm_dir
    from hicache.pools.layouts import block_layout_name

    proc, address = start_sidecar(sockdir)
    g, pages = mimo_full(), 4
    victim, bystander = filled_device(pages, seed=1), filled_device(pages, seed=2)
    a, b, c = (HiCacheClient(address, timeout=60) for _ in range(3))
    fd, mem = _memfd_engine(g, pages, 0)  # a memfd that cannot be sealed (SGLang's, vLLM's)
    try:
        a.register(victim, model_id="m")
        b.register(bystander, model_id="m")
        (fd_id,) = c.send_fds([fd])
        layout = block_layout_name(0, pages * g.page_bytes_for(1), g.page_bytes_for(1))
        c.register_memory(
            g, pages, MemoryHandle("fd", os.fstat(fd).st_size, name=fd_id), device_layout=layout, model_id="m"
        )
        os.truncate(os.path.join(shm_dir(), victim.handle.name), 0)  # the engine shrinks its own segment
        os.ftruncate(fd, 0)
        for client in (a, c):
            with pytest.raises(HiCacheRpcError, match=r"FAILED_PRECONDITION: .*shrank from \d+ to 0 bytes"):
                client.offload(keys_for(2, seed=3), [0, 1])
            with pytest.raises(HiCacheRpcError, match="shrank"):
                client.reload(keys_for(2, seed=3), [0, 1])
        keys = keys_for(2, seed=4)  # the other tenant's cache works on
        assert b.offload(keys, [0, 1]).statuses == (KeyStatus.STORED,) * 2
        assert b.reload(keys, [2, 3]).statuses == (KeyStatus.LOADED,) * 2
        assert proc.poll() is None
    finally:
        for client in (a, b, c):
            client.close()
        mem.close()
        os.close(fd)
        bystander.close()
        proc.terminate()
        proc.wait(timeout=60)


def test_a_memfd_that_allows_sealing_is_sealed_against_shrinking(sockdir: str) -> None:
    sys.path[:0] = [str(ROOT), str(ROOT / "tests")]
    from sidecar_util import keys_for, mimo_full, start_sidecar

    from hicache.api import KeyStatus
    from hicache.client import HiCacheClient
    from hicache.memory import MemoryHandle
    from hicache.pools.layouts import block_layout_name

    proc, address = start_sidecar(sockdir)
    g, pages = mimo_full(), 4
    fd, mem = _memfd_engine(g, pages, os.MFD_ALLOW_SEALING)
    try:
        with HiCacheClient(address, timeout=60) as client:
            (fd_id,) = client.send_fds([fd])
            layout = block_layout_name(0, pages * g.page_bytes_for(1), g.page_bytes_for(1))
            client.register_memory(
                g, pages, MemoryHandle("fd", os.fstat(fd).st_size, name=fd_id), device_layout=layout, model_id="m"
            )
            with pytest.raises(PermissionError):
                os.ftruncate(fd, 0)  # the sidecar's seal: the mapping can never fault
            assert client.offload(keys_for(1, seed=5), [0]).statuses == (KeyStatus.STORED,)
    finally:
        mem.close()
        os.close(fd)
        proc.terminate()
        proc.wait(timeout=60)


ENGINE = textwrap.dedent(
    """
    import sys, time
    sys.path[:0] = [{root!r}, {tests!r}]
    from sidecar_util import filled_device
    from hicache.client import HiCacheClient
    dev = filled_device(2, seed=1)
    client = HiCacheClient({address!r}, timeout=60)
    client.register(dev, model_id="m")
    print("ready", flush=True)
    time.sleep(600)
    """
)


def _segments() -> set[str]:
    from hicache.memory import SHM_PREFIX, shm_dir

    return {n for n in os.listdir(shm_dir()) if n.startswith(SHM_PREFIX)}


def _owned_by(pids: set[int]) -> set[str]:
    """The segments in /dev/shm whose names say one of `pids` made them."""
    return {n for n in _segments() if (m := re.match(r"^hicache-\d+-(\d+)-", n)) and int(m.group(1)) in pids}


def _settle(pids: set[int], want: set[str], timeout: float = 60.0) -> set[str]:
    """Wait until the segments of `pids` are `want`; other processes' segments are not looked at
    (another test run may share this /dev/shm)."""
    deadline = time.monotonic() + timeout
    while _owned_by(pids) != want and time.monotonic() < deadline:
        time.sleep(0.1)
    return _owned_by(pids)


def test_kill_9_loops_of_sidecars_and_engines_leave_no_shared_memory_behind(sockdir: str) -> None:
    sys.path[:0] = [str(ROOT), str(ROOT / "tests")]
    from sidecar_util import filled_device, start_sidecar

    from hicache.client import HiCacheClient
    from hicache.client.health import check_health

    def healthy(address: str) -> None:
        deadline = time.monotonic() + 60
        while check_health(address) != "SERVING" and time.monotonic() < deadline:
            time.sleep(0.05)

    me = {os.getpid()}
    dev = filled_device(2, seed=2)  # this test's own engine segment, alive throughout
    killed: set[int] = set()
    for _ in range(5):  # the sidecar killed with its host pool mapped
        proc, address = start_sidecar(sockdir, "--lease-timeout", "1")
        with HiCacheClient(address, timeout=60) as client:
            client.register(dev, model_id="m")
            assert _owned_by({proc.pid}), "the sidecar made its host pool"
            proc.kill()
            proc.wait(timeout=30)
            assert _owned_by({proc.pid}), "kill -9: nobody unlinked it (the next start-up will)"
            killed.add(proc.pid)
    proc, address = start_sidecar(sockdir, "--lease-timeout", "3")  # 3 s: this test's pool must outlive a busy spell
    try:
        healthy(address)  # its start-up swept the dead sidecars' host pools
        assert _settle(killed, set()) == set()
        assert _owned_by(me) >= {dev.handle.name}  # a live owner's segment stays
        script = Path(sockdir, "engine.py")
        script.write_text(ENGINE.format(root=str(ROOT), tests=str(ROOT / "tests"), address=address))
        engines: set[int] = set()
        for _ in range(5):  # engines killed with their device pools registered
            engine = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
            assert engine.stdout is not None and engine.stdout.readline().strip() == "ready"
            engine.kill()
            engine.wait(timeout=30)
            assert _owned_by({engine.pid}), "its device segment, left behind (the next registration sweeps it)"
            engines.add(engine.pid)
        with HiCacheClient(address, timeout=60) as client:  # a registration sweeps dead owners
            info = client.register(dev, model_id="m")
            assert _settle(engines, set()) == set()
            # the dead engines' host pools went when their leases ran out: only this one is left
            # its host pool, copy window and progress block
            mine = {info.host_shm_name, info.window_shm_name, info.progress_shm_name} - {""}
            assert _settle({proc.pid}, mine) == mine
        assert _settle({proc.pid}, set()) == set()
    finally:
        proc.terminate()
        proc.wait(timeout=60)
        dev.close()
    assert dev.handle.name not in _segments()


def test_the_sweep_skips_a_dead_segment_it_may_not_remove_and_removes_the_rest(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Another uid's dead segment in a sticky /dev/shm cannot be unlinked (EPERM): the sweep,
    which runs at the sidecar's start-up and at each registration, skips it and goes on."""
    sys.path[:0] = [str(ROOT)]
    from hicache.memory import shm

    ns, pid, start = shm._owner()
    names = [f"hicache-{ns}-{pid}-{start + 1}-{i:024x}" for i in range(3)]  # this pid, another start: dead
    for name in names:
        Path(shm.shm_dir(), name).touch()
    real_unlink, refused = os.unlink, []

    def unlink(path: str) -> None:
        if not refused and os.path.basename(path) in names:
            refused.append(os.path.basename(path))
            raise PermissionError(1, "Operation not permitted", path)
        real_unlink(path)

    monkeypatch.setattr(os, "unlink", unlink)
    try:
        removed = shm.sweep_dead_segments()
    finally:
        monkeypatch.undo()
        left = [n for n in names if os.path.exists(os.path.join(shm.shm_dir(), n))]
        for name in left:
            os.unlink(os.path.join(shm.shm_dir(), name))
    assert len(refused) == 1 and left == refused
    assert sorted(set(removed) & set(names)) == sorted(set(names) - set(refused))


FORK = textwrap.dedent(
    """
    import os, signal, sys
    sys.path.insert(0, {root!r})
    from hicache.memory import create_shm, shm_dir

    def exists(name):
        return os.path.exists(os.path.join(shm_dir(), name))

    for how in ("exit", "sigterm"):
        parents = create_shm(4096)
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:
            childs = create_shm(4096)
            os.write(w, childs.handle.name.encode())
            if how == "exit":
                sys.exit(0)  # an ordinary exit: atexit runs the finalizers
            signal.pause()  # until SIGTERM, whose handler the child inherited
            os._exit(1)
        os.close(w)
        child_segment = os.read(r, 256).decode()
        if how == "sigterm":
            os.kill(pid, signal.SIGTERM)
        _, status = os.waitpid(pid, 0)
        print(how, os.WIFSIGNALED(status) and os.WTERMSIG(status), exists(parents.handle.name), exists(child_segment))
        parents.close()
        print(how, "closed", exists(parents.handle.name))
    """
)


def test_a_forked_child_unlinks_its_own_segments_and_never_its_parents(tmp_path: Path) -> None:
    script = tmp_path / "fork.py"
    script.write_text(FORK.format(root=str(ROOT)))
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.splitlines() == [
        "exit False True False",  # the parent's segment stays, the child's own is gone
        "exit closed False",
        f"sigterm {int(signal.SIGTERM)} True False",  # killed by SIGTERM all the same
        "sigterm closed False",
    ], out.stdout
