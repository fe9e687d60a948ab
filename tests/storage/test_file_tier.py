import errno
import os
import random
import signal
import stat
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from helpers import eventually, held_by_another_thread, in_forked_child
from tier_helpers import GEOMETRIES, GEOMETRY_NAMES, identity, key, payload

from hicache.storage import page_format as fmt
from hicache.storage.file import FileTier

WRITER = """
import sys
sys.path[:0] = [{tests!r}]
from tier_helpers import GEOMETRIES, identity, key, payload
from hicache.storage.file import FileTier
g = GEOMETRIES[{name!r}]
tier = FileTier(identity(g), {dir!r}, fsync=False)  # SIGKILL keeps the page cache
i = 0
while True:
    assert tier.set(key(i), payload(g, i))
    print(i, flush=True)  # acknowledged
    i += 1
"""


@pytest.mark.parametrize("name", GEOMETRY_NAMES)
def test_sigkill_mid_write_then_restart_serves_every_acknowledged_page(tmp_path, name):
    g = GEOMETRIES[name]
    script = WRITER.format(tests=str(Path(__file__).resolve().parents[1]), name=name, dir=str(tmp_path))
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    acked = []
    for line in proc.stdout:
        acked.append(int(line))
        if len(acked) == 40:
            break
    proc.send_signal(signal.SIGKILL)  # most likely in the middle of the next write
    proc.wait()
    tier = FileTier(identity(g), tmp_path)  # a restart: rescans the folder
    tier.check_integrity()
    assert not list(tier.root.rglob("*.tmp")), "temporary files of unacknowledged writes are cleaned up"
    for i in acked:
        assert bytes(tier.get(key(i))) == payload(g, i)
    stored = tier.stats().pages or 0
    assert stored >= len(acked)
    for i in range(stored + 2):  # a page written but not yet acknowledged is exact or absent
        got = tier.get(key(i))
        assert got is None or bytes(got) == payload(g, i)
    assert tier.stats().corrupt == 0


def test_torn_and_corrupt_files_are_misses_deleted_and_counted(tmp_path):
    g = GEOMETRIES["mimo_kv"]
    tier = FileTier(identity(g), tmp_path)
    for i in range(3):
        assert tier.set(key(i), payload(g, i))
    # a flipped byte in the payload: a miss, deleted, counted
    p0 = tier.path_of(key(0))
    data = bytearray(p0.read_bytes())
    data[-7] ^= 0x40
    p0.write_bytes(data)
    assert tier.get(key(0)) is None and not p0.exists()
    # a page of another key moved into place (same size): foreign
    tier.path_of(key(1)).replace(tier.path_of(key(2)))
    assert tier.get(key(2)) is None
    s = tier.stats()
    assert (s.corrupt, s.foreign, s.hits) == (1, 1, 0)
    # a torn file (power loss without fsync) is dropped by the scan on restart
    assert tier.set(key(5), payload(g, 5))
    p5 = tier.path_of(key(5))
    p5.write_bytes(p5.read_bytes()[:100])
    (p5.parent / ".junk.tmp").write_bytes(b"x")
    again = FileTier(identity(g), tmp_path)
    again.check_integrity()
    assert again.get(key(5)) is None and not p5.exists() and again.stats().corrupt == 1
    assert not (p5.parent / ".junk.tmp").exists()


def test_size_cap_lru_and_order_survives_restart(tmp_path):
    g = GEOMETRIES["deepseek_mla"]
    size = fmt.stored_size(identity(g), key(0))
    tier = FileTier(identity(g), tmp_path, max_bytes=3 * size)
    for i in range(3):
        assert tier.set(key(i), payload(g, i))
    assert tier.get(key(0)) is not None  # 0 is now the most recent: 1 is the oldest
    assert tier.set(key(3), payload(g, 3))
    assert tier.batch_contains([key(i) for i in range(4)]) == [True, False, True, True]
    assert tier.stats().evictions == 1 and tier.stats().bytes == 3 * size
    tier.check_integrity()
    # restart: LRU order from modification times (a read refreshes it): 2, 0, 3
    os.utime(tier.path_of(key(2)), ns=(1, 1))
    again = FileTier(identity(g), tmp_path, max_bytes=3 * size)
    assert again.set(key(4), payload(g, 4))
    assert again.batch_contains([key(i) for i in range(5)]) == [True, False, False, True, True]
    again.check_integrity()
    # a read is not a write on disk: its recency reaches the files at close (or every
    # RECENCY_BATCH reads), oldest read first
    for i in (0, 3, 4):
        os.utime(again.path_of(key(i)), ns=(10 + i, 10 + i))
    assert again.get(key(0)) is not None and again.path_of(key(0)).stat().st_mtime_ns == 10
    again.close()
    assert again.path_of(key(0)).stat().st_mtime_ns > 1000
    third = FileTier(identity(g), tmp_path, max_bytes=3 * size)  # order now 3, 4, 0
    assert third.set(key(5), payload(g, 5))
    assert not third.contains(key(3)) and third.contains(key(0)) and third.contains(key(4))
    tiny = FileTier(identity(g), tmp_path / "tiny", max_bytes=size - 1)  # a page never fits
    assert tiny.set(key(1), payload(g, 1)) is False and tiny.stats().no_space == 1


def test_the_read_order_is_written_off_the_read_path_and_completed_at_close(tmp_path, monkeypatch):
    import hicache.storage.file as file_tier

    g = GEOMETRIES["deepseek_mla"]
    tier = FileTier(identity(g), tmp_path)
    for i in range(6):
        assert tier.set(key(i), payload(g, i))
    monkeypatch.setattr(file_tier, "RECENCY_BATCH", 4)
    release, calls, real = threading.Event(), [], os.utime

    def utime(path, *args, **kw):
        calls.append((threading.get_ident(), path.name))
        assert release.wait(30)  # a slow disk: the reads below must not wait for it
        real(path, *args, **kw)

    monkeypatch.setattr(file_tier.os, "utime", utime)
    for i in (2, 0, 1, 3):  # the 4th read starts the write of 2, 0, 1, 3
        assert tier.get(key(i)) == payload(g, i)
    eventually(lambda: len(calls) == 1, what="the writer's first utime")  # it has taken its keys
    assert tier.get(key(5)) == payload(g, 5)  # read while the writer waits: left for close
    release.set()
    tier.close()  # joins the writer, then writes 5 from here
    assert [name for _, name in calls] == [tier.path_of(key(i)).name for i in (2, 0, 1, 3, 5)]
    me = threading.get_ident()
    assert all(who != me for who, _ in calls[:4]) and calls[4][0] == me
    mtimes = [tier.path_of(key(i)).stat().st_mtime_ns for i in (2, 0, 1, 3, 5)]
    assert mtimes == sorted(mtimes) and mtimes[0] > tier.path_of(key(4)).stat().st_mtime_ns


def test_each_page_of_a_batch_is_checked_against_the_cap_by_its_own_size(tmp_path):
    g = GEOMETRIES["deepseek_mla"]
    short, long = b"s" * 8, b"l" * 64  # the key is part of a page file's size
    tier = FileTier(identity(g), tmp_path, max_bytes=fmt.stored_size(identity(g), short))
    assert tier.batch_set([(long, payload(g, 1)), (short, payload(g, 2))]) == [False, True]
    assert tier.batch_set([(short, payload(g, 3)), (long, payload(g, 4))]) == [True, False]
    assert tier.batch_contains([short, long]) == [True, False] and tier.get(short) == payload(g, 3)
    assert tier.stats().no_space == 2 and tier.stats().evictions == 0
    tier.check_integrity()


def test_disk_full_fails_cleanly_and_is_counted(tmp_path, monkeypatch):
    g = GEOMETRIES["mimo_fp4"]
    tier = FileTier(identity(g), tmp_path)
    assert tier.set(key(0), payload(g, 0))
    real = __import__("hicache.storage.file", fromlist=["write_file"]).write_file

    def full(path, parts, fsync):
        real(path, parts[:1], fsync)  # a partial temp file, then the disk fills up
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr("hicache.storage.file.write_file", full)
    assert tier.batch_set([(key(1), payload(g, 1)), (key(2), payload(g, 2))]) == [False, False]
    s = tier.stats()
    assert (s.writes, s.write_failures, s.no_space) == (1, 2, 2) and "No space" in s.last_error
    assert not list(tier.root.rglob("*.tmp")) and not tier.exists(key(1))
    monkeypatch.undo()
    assert tier.set(key(1), payload(g, 1)) and bytes(tier.get(key(0))) == payload(g, 0)
    tier.check_integrity()


def test_batch_read_reuses_one_buffer_and_stops_at_the_first_miss(tmp_path):
    g = GEOMETRIES["mimo_kv"]
    tier = FileTier(identity(g), tmp_path)
    for i in range(3):
        assert tier.set(key(i), payload(g, i))
    seen: list[tuple[int, bytes, int]] = []

    def sink(i: int, data: memoryview) -> None:
        seen.append((i, bytes(data), id(data.obj)))

    assert tier.batch_read([key(0), key(1), key(9), key(2)], sink) == 2
    assert [(i, b) for i, b, _ in seen] == [(0, payload(g, 0)), (1, payload(g, 1))]
    assert seen[0][2] == seen[1][2]  # the same buffer, read into again: no allocation per page
    p2 = tier.path_of(key(2))
    p2.write_bytes(p2.read_bytes()[:-1] + b"\x00")  # a flipped last byte: the checksum fails
    assert tier.batch_read([key(2)], sink) == 0 and tier.stats().corrupt == 1 and not p2.exists()


def test_group_commit_flushes_once_per_batch_and_acknowledges_durable_pages(tmp_path, monkeypatch):
    from hicache.storage import file as file_module

    flushes, fsyncs = [], []
    real_syncfs, real_fsync = file_module._libc_syncfs, os.fsync
    monkeypatch.setattr(file_module, "_libc_syncfs", lambda fd: flushes.append(fd) or real_syncfs(fd))
    monkeypatch.setattr(os, "fsync", lambda fd: fsyncs.append(fd) or real_fsync(fd))
    g = GEOMETRIES["mimo_kv"]
    tier = FileTier(identity(g), tmp_path, fsync="batch")
    assert tier.batch_set([(key(i), payload(g, i)) for i in range(8)]) == [True] * 8
    assert len(flushes) == 1 and fsyncs == []  # one flush for the batch, no fsync per file or folder
    again = FileTier(identity(g), tmp_path, fsync="batch")  # what a restart finds
    assert [bytes(again.get(key(i))) for i in range(8)] == [payload(g, i) for i in range(8)]
    monkeypatch.setattr(file_module, "_libc_syncfs", lambda fd: -1)  # the flush fails: nothing acknowledged
    assert tier.batch_set([(key(9), payload(g, 9))]) == [False] and tier.stats().errors == 1
    with pytest.raises(ValueError, match='"fsync" must be true, false or "batch", got \'always\''):
        FileTier(identity(g), tmp_path, fsync="always")


@pytest.mark.parametrize("fused", [True, False], ids=["checksum-while-reading", "python-reads"])
def test_batch_read_into_reads_across_iov_max_and_refuses_bad_files(tmp_path, monkeypatch, fused):
    """Both read paths: the C read that checksums each window as it lands (where the
    extension is built), and the Python preadv loop with the checksum after it."""
    import hicache.storage.file as file_tier
    import hicache.storage.page_format as fmt

    if fused and fmt._pread_xxh3 is None:
        pytest.skip("hicache.storage._xxh3 is not built")
    if not fused:
        monkeypatch.setattr(fmt, "_pread_xxh3", None)
    monkeypatch.setattr(file_tier, "IOV_MAX", 3)  # 9 pieces: three preadv calls per page (Python path)
    g = GEOMETRIES["mimo_kv"]
    tier = FileTier(identity(g), tmp_path)
    for i in range(4):
        assert tier.set(key(i), payload(g, i))
    step = g.page_bytes // 9
    cuts = [k * step for k in range(9)] + [g.page_bytes]
    pages = [bytearray(g.page_bytes) for _ in range(4)]

    def pieces_of(i: int) -> list[memoryview]:
        return [memoryview(pages[i])[a:b] for a, b in zip(cuts, cuts[1:], strict=False)]

    assert tier.batch_read_into([key(3), key(0)], pieces_of) == 2
    assert bytes(pages[0]) == payload(g, 3) and bytes(pages[1]) == payload(g, 0)
    p1 = tier.path_of(key(1))
    data = bytearray(p1.read_bytes())
    data[-g.page_bytes // 2] ^= 0x10  # a flipped byte in the middle of the payload
    p1.write_bytes(data)
    p2 = tier.path_of(key(2))
    p2.write_bytes(p2.read_bytes()[:-5])  # a short file: refused by its size, before reading
    assert tier.batch_read_into([key(1)], pieces_of) == 0 and not p1.exists()
    assert tier.batch_read_into([key(2)], pieces_of) == 0 and not p2.exists()
    s = tier.stats()
    assert (s.hits, s.corrupt, s.misses) == (2, 2, 2)


@pytest.mark.parametrize("threads", [1, 4])
def test_batch_read_into_on_several_threads_lands_each_page_in_its_own_pieces(tmp_path, threads):
    g = GEOMETRIES["mimo_kv"]
    tier = FileTier(identity(g), tmp_path, read_threads=threads)
    for i in range(12):
        assert tier.set(key(i), payload(g, i))
    order = [7, 3, 11, 0, 5, 9, 1, 10, 2, 8, 6, 4]
    pages = [bytearray(g.page_bytes) for _ in order]
    half = g.page_bytes // 2

    def pieces_of(i: int) -> list[memoryview]:
        return [memoryview(pages[i])[:half], memoryview(pages[i])[half:]]

    assert tier.batch_read_into([key(k) for k in order], pieces_of) == len(order)
    assert all(bytes(pages[i]) == payload(g, k) for i, k in enumerate(order))
    assert tier.stats().hits == len(order)
    pages = [bytearray(g.page_bytes) for _ in order]
    wanted = [key(0), key(1), key(2), key(99), key(3), key(4)]  # key 99 is in no file
    assert tier.batch_read_into(wanted, pieces_of) == 3  # the prefix before the miss
    assert [bytes(pages[i]) for i in range(3)] == [payload(g, k) for k in range(3)]
    tier.close()
    tier.close()  # idempotent
    assert tier.batch_read_into([key(5), key(6)], pieces_of) == 2  # a closed tier's readers come back
    assert bytes(pages[1]) == payload(g, 6)


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_a_forked_child_reads_on_reader_threads_of_its_own(tmp_path):
    """The parent's reader threads are not copied by fork, nor is a parent thread that held
    the pool's lock at the fork: the child's batch_read_into must start threads of its own
    rather than queue work for threads that are not there, or wait on that lock (hangs)."""
    g = GEOMETRIES["mimo_kv"]
    tier = FileTier(identity(g), tmp_path, read_threads=4)
    for i in range(4):
        assert tier.set(key(i), payload(g, i))
    pages = [bytearray(g.page_bytes) for _ in range(4)]
    assert tier.batch_read_into([key(i) for i in range(4)], lambda i: [memoryview(pages[i])]) == 4  # threads started

    def child() -> bool:
        fresh = [bytearray(g.page_bytes) for _ in range(4)]
        found = tier.batch_read_into([key(3 - i) for i in range(4)], lambda i: [memoryview(fresh[i])])
        tier.close()
        return found == 4 and all(bytes(fresh[i]) == payload(g, 3 - i) for i in range(4))

    with held_by_another_thread(tier._readers._lock):  # a parent thread inside the pool's lock at the fork
        assert in_forked_child(child)
    tier.close()


def test_batch_read_into_checks_every_key_and_piece_before_reading_any(tmp_path):
    g = GEOMETRIES["mimo_kv"]
    tier = FileTier(identity(g), tmp_path, read_threads=4)
    for i in range(4):
        assert tier.set(key(i), payload(g, i))
    pages = [bytearray(g.page_bytes) for _ in range(4)]

    def pieces_of(i: int) -> list[memoryview]:
        return [memoryview(pages[i])[: -1 if i == 3 else None]]  # page 3's pieces are a byte short

    with pytest.raises(ValueError, match=f"add up to {g.page_bytes - 1} bytes"):
        tier.batch_read_into([key(i) for i in range(4)], pieces_of)
    with pytest.raises(ValueError):
        tier.batch_read_into([key(0), b""], pieces_of)  # an empty key
    assert tier.stats().hits == 0 and not any(any(p) for p in pages)  # nothing was read


@pytest.mark.parametrize("bad", [0, -1, 65, 2.0, "2", True, None])
def test_read_threads_must_be_an_int_from_1_to_64(tmp_path, bad):
    from hicache.storage.factory import check_extra

    g = GEOMETRIES["mimo_kv"]
    with pytest.raises(ValueError, match=f'"read_threads" must be an int from 1 to 64, got {bad!r}'):
        FileTier(identity(g), tmp_path, read_threads=bad)
    with pytest.raises(ValueError, match=f"got {bad!r}"):
        check_extra("file", {"dir": str(tmp_path), "read_threads": bad})


def test_write_file_writes_many_parts_gathered_in_order(tmp_path, monkeypatch):
    import hicache.storage.file as file_tier

    monkeypatch.setattr(file_tier, "IOV_MAX", 3)  # 10 parts: four writev calls
    rng = random.Random(4)
    parts = [rng.randbytes(n) for n in (80, 0, 81_920, 1, 0, 5000, 81_920, 7, 0, 3)]
    path = tmp_path / "page"
    file_tier.write_file(path, [memoryview(p) for p in parts], fsync=True)
    assert path.read_bytes() == b"".join(parts)
    file_tier.write_file(path, [b"short"], fsync=False)  # an existing file is replaced, not kept longer
    assert path.read_bytes() == b"short"


def test_with_fsync_a_new_folder_s_entry_is_made_durable_before_its_first_page_is_acknowledged(tmp_path, monkeypatch):
    """fsync=True fsynced the shard folder a page was renamed into, but not the folder that
    holds a new shard folder's entry (nor, at start, the new tier folder's): after a power
    loss the whole folder, with acknowledged pages, could vanish."""
    synced: list[Path] = []
    real_fsync = os.fsync

    def fsync(fd: int) -> None:
        if stat.S_ISDIR(os.fstat(fd).st_mode):
            synced.append(Path(os.readlink(f"/proc/self/fd/{fd}")))
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    g = GEOMETRIES["mimo_kv"]
    base = tmp_path / "new" / "tiers"  # made by the tier, two levels
    tier = FileTier(identity(g), base, fsync=True)
    assert set(synced) == {tier.root, base, tmp_path / "new", tmp_path}  # each made folder's entry, and the root
    synced.clear()
    assert tier.set(key(1), payload(g, 1))
    shard = tier.path_of(key(1)).parent
    assert synced == [shard, tier.root]  # the rename, then the new folder's entry
    synced.clear()
    same = next(k for k in (key(i) for i in range(2, 4096)) if tier.path_of(k).parent == shard)
    assert tier.set(same, payload(g, 2))
    assert synced == [shard]  # the folder's entry is durable already
    synced.clear()
    again = FileTier(identity(g), base, fsync=True)  # a restart: the folders it finds count as durable
    assert synced == [again.root]
    synced.clear()
    assert again.set(key(5000), payload(g, 3)) and synced[0] == again.path_of(key(5000)).parent


def test_a_file_tier_shared_by_two_pools_stays_open_until_both_have_closed_it(tmp_path):
    """Two pools of one identity (an engine registering again before its old lease ran out)
    share one FileTier; the first pool's close shut its reader threads down under the second
    (a read then raised "cannot schedule new futures after shutdown", or leaked new threads)."""
    from hicache.storage.factory import make_tier

    g = GEOMETRIES["mimo_kv"]
    extra = {"dir": str(tmp_path), "fsync": False}
    first, second = make_tier("file", extra, identity(g)), make_tier("file", extra, identity(g))
    assert first is second
    assert first.batch_set([(key(i), payload(g, i)) for i in range(3)]) == [True] * 3
    readers = second._readers.get()
    first.close()  # the old pool goes
    out = [bytearray(g.page_bytes) for _ in range(3)]
    assert second.batch_read_into([key(i) for i in range(3)], lambda i: [memoryview(out[i])]) == 3
    assert [bytes(o) for o in out] == [payload(g, i) for i in range(3)]
    assert second._readers.get() is readers  # the same threads, not a new set
    second.close()
    second.close()  # the last user is gone: idempotent from here
    third = make_tier("file", extra, identity(g))  # a later pool gets a fresh tier, with the pages
    assert third is not first and bytes(third.get(key(2))) == payload(g, 2)
    third.close()
