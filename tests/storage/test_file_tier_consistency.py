"""FileTier keeps its index, its files and its answers in agreement: the start-up scan
indexes a file only at its key's own path, a bad page is deleted only while it is still the
file that was read, and a page whose flush failed is neither acknowledged nor served."""

import errno
import os
import shutil
import stat

import pytest
from tier_helpers import GEOMETRIES, identity, key, payload

from hicache.storage import file as file_module
from hicache.storage import page_format as fmt
from hicache.storage.file import FileTier

G = GEOMETRIES["mimo_kv"]


def test_the_scan_indexes_a_page_only_at_its_keys_own_path(tmp_path):
    tier = FileTier(identity(G), tmp_path, fsync=False)
    assert tier.set(key(7), payload(G, 7))
    tier.close()
    own = tier.path_of(key(7))
    name = own.name.removesuffix(".page")
    aliases = [
        own.parent.parent / "zz" / own.name,  # the right name in another folder
        own.parent.parent / "ff" / own.name,
        own.parent / (name.upper() + ".page"),  # hex that bytes.fromhex reads, but not path_of's
        own.parent / (name[:2] + " " + name[2:] + ".page"),
    ]
    for alias in aliases:
        alias.parent.mkdir(exist_ok=True)
        shutil.copy(own, alias)
    again = FileTier(identity(G), tmp_path, fsync=False)
    again.check_integrity()
    s = again.stats()
    assert (s.pages, s.bytes, s.corrupt) == (1, fmt.stored_size(identity(G), key(7)), len(aliases))
    assert bytes(again.get(key(7))) == payload(G, 7)
    assert again.delete(key(7))
    assert not list(again.root.rglob("*.page")) and again.stats().bytes == 0


def test_a_bad_page_rewritten_while_it_was_read_is_not_deleted(tmp_path, monkeypatch):
    tier = FileTier(identity(G), tmp_path, fsync=False)
    assert tier.set(key(1), payload(G, 1))
    path = tier.path_of(key(1))
    data = bytearray(path.read_bytes())
    data[-7] ^= 0x40  # bit rot in the payload: the checksum fails
    path.write_bytes(data)
    real = fmt.decode_page
    acknowledged = []

    def rewrite_then_decode(ident, k, blob):  # type: ignore[no-untyped-def]
        monkeypatch.setattr(fmt, "decode_page", real)
        acknowledged.append(tier.set(k, payload(G, 1)))  # a writer lands between the read and the delete
        return real(ident, k, blob)  # the read's old bytes still fail

    monkeypatch.setattr(fmt, "decode_page", rewrite_then_decode)
    assert tier.get(key(1)) is None and tier.stats().corrupt == 1
    assert acknowledged == [True]
    assert tier.contains(key(1)) and bytes(tier.get(key(1))) == payload(G, 1)
    tier.check_integrity()


def failing_fsync_of(folder):  # type: ignore[no-untyped-def]
    """os.fsync that fails with EIO for the folder `folder` only."""
    real, target = os.fsync, os.stat(folder)

    def fsync(fd: int) -> None:
        st = os.fstat(fd)
        if stat.S_ISDIR(st.st_mode) and (st.st_dev, st.st_ino) == (target.st_dev, target.st_ino):
            raise OSError(errno.EIO, "Input/output error (injected)")
        real(fd)

    return fsync


@pytest.mark.parametrize("mode", [True, "batch"], ids=["fsync", "batch"])
def test_a_page_whose_flush_failed_is_not_acknowledged_and_not_served(tmp_path, monkeypatch, mode):
    tier = FileTier(identity(G), tmp_path, fsync=mode)
    assert tier.set(key(0), payload(G, 0))  # acknowledged before the failures
    tier.path_of(key(1)).parent.mkdir()
    events: list[tuple[str, list[bytes]]] = []
    tier.add_watcher(lambda change, keys: events.append((change, keys)))
    if mode is True:  # only key 1's folder fails: key 2's page (another folder) is durable
        monkeypatch.setattr(os, "fsync", failing_fsync_of(tier.path_of(key(1)).parent))
        want = [False, True]
    else:  # the batch's one flush fails: nothing in it is durable
        monkeypatch.setattr(file_module, "_libc_syncfs", lambda fd: -1)
        want = [False, False]
    items = [(key(1), payload(G, 1)), (key(2), payload(G, 2))]
    assert tier.batch_set(items) == want
    for (k, data), ok in zip(items, want, strict=True):
        assert tier.contains(k) == ok and tier.path_of(k).exists() == ok
        got = tier.get(k)
        assert (bytes(got) if got is not None else None) == (data if ok else None)
    assert events[0] == ("stored", [key(1), key(2)])
    assert sorted(k for change, keys in events[1:] for k in keys if change == "removed") == [
        k for (k, _), ok in zip(items, want, strict=True) if not ok
    ]
    s = tier.stats()
    assert (s.writes, s.write_failures, s.errors) == (1 + sum(want), want.count(False), 1)
    assert bytes(tier.get(key(0))) == payload(G, 0)
    tier.check_integrity()


class Recorder:
    """A watcher as the sidecar's event hub is one: a bound method, made anew on each access."""

    def __init__(self) -> None:
        self.seen: list[str] = []

    def storage(self, change: str, keys: list[bytes]) -> None:
        self.seen.append(change)


def test_a_watcher_added_as_a_bound_method_is_removed_by_another_access_to_it(tmp_path):
    tier = FileTier(identity(G), tmp_path, fsync=False)
    recorder = Recorder()
    tier.add_watcher(recorder.storage)
    assert tier.set(key(0), payload(G, 0)) and recorder.seen == ["stored"]
    tier.remove_watcher(recorder.storage)  # not the same object as the one added
    assert tier.set(key(1), payload(G, 1)) and recorder.seen == ["stored"]
