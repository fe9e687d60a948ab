"""The Mooncake Store tier: pages in the Mooncake cluster a deployment already runs, shared by
every sidecar (and engine) on it.

Each page is one object, "hicache:<identity qualifier>:<key hex>", holding page_format's
header + key + payload, so a page of another geometry, model or namespace, or a damaged
one, is a miss (and removed). Over TCP a page in at most two pieces moves zero-copy: writes
send the header and the caller's payload as they are (batch_put_from_multi_buffers), reads
land the header in a small buffer and the payload straight in the destination's pieces
(batch_get_into_multi_buffers), verified there. Pages in more pieces (a layer_first host
page), and every page over RDMA, are staged: copied through registered buffers, a group at
a time while the group before moves (mooncake_staging).

Mooncake keeps an existing object on a put, so a damaged page stays until a read removes
it; a read leases the object, so removal is forced. When the master is gone, calls fail at
once for a backoff (mooncake_link); reads are misses, writes refused, health says why.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from hicache.storage import page_format as fmt
from hicache.storage.base import Payload, StorageTier, TierHealth, TierIdentity, TierStats, check_pieces
from hicache.storage.mooncake_link import (
    INVALID_PARAMS,
    NO_AVAILABLE_HANDLE,
    OBJECT_NOT_FOUND,
    RPC_FAIL,
    TRANSFER_FAIL,
    address,
    open_link,
    release,
)
from hicache.storage.mooncake_options import MooncakeOptions
from hicache.storage.mooncake_staging import DIRECT_MAX_PIECES, Stager

PiecesOf = Callable[[int], Sequence[memoryview]]


class MooncakeTier(StorageTier):
    """Pages of `identity` in the Mooncake Store cluster of `options` (a MooncakeOptions or
    an extra-config dict). Needs the mooncake package (ImportError otherwise). Raises
    ValueError for a bad option. Connects now when the master answers; an unreachable one
    makes the tier unhealthy (connecting later), not the constructor fail."""

    backend = "mooncake"
    forgets_on_its_own = True  # Mooncake evicts under pressure; a restarted master forgets all

    def __init__(
        self,
        identity: TierIdentity,
        options: MooncakeOptions | Mapping[str, Any],
        *,
        max_batch_bytes: int = 64 << 20,
        clock: Callable[[], float] = time.monotonic,
    ):
        super().__init__(identity)
        self.options = options if isinstance(options, MooncakeOptions) else MooncakeOptions.from_extra(options)
        self._link = open_link(self.options, clock)
        self.prefix = f"hicache:{identity.qualifier}:"
        self.direct = self.options.protocol == "tcp"  # zero-copy allowed; else staged (mooncake_staging)
        self._stager = Stager(self._link)
        self._per_batch = max(1, max_batch_bytes // fmt.stored_size(identity, b"k" * 32))
        self._closed = False

    def name(self, key: bytes) -> str:
        """The Mooncake key of page key `key`."""
        fmt.check_key(key)
        return self.prefix + key.hex()

    def health(self) -> TierHealth:
        if self._closed:
            return TierHealth(False, f"mooncake tier {self.options.master_server_address}: closed")
        return self._link.health()

    def _fill_stats(self, snap: TierStats) -> None:
        snap.nodes_down = [self.options.master_server_address] if not snap.healthy else []

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._stager.close()
            release(self._link)

    def _run(self, call: Callable[[Any], Any], n: int, what: str) -> list[int] | None:
        """A batch call's codes, or None (counted as an error) while the cluster is down."""
        if self._closed:
            raise ValueError("the mooncake tier is closed")
        codes = self._link.run(call)
        if codes is None or RPC_FAIL in codes:
            self._error(f"{n} {what}: {self._link.why}")
        return None if codes is None else list(codes)

    # ---- reads --------------------------------------------------------------------------------
    def contains(self, key: bytes) -> bool:
        return self.batch_contains([key])[0]

    def batch_contains(self, keys: Sequence[bytes]) -> list[bool]:
        names = [self.name(k) for k in keys]
        if not names:
            return []
        codes = self._run(lambda store: store.batch_is_exist(names), len(names), "lookups")
        return [False] * len(names) if codes is None else [code == 1 for code in codes]

    def get(self, key: bytes) -> memoryview | None:
        return self.batch_get([key])[0]

    def batch_get(self, keys: Sequence[bytes]) -> list[memoryview | None]:
        pages = [memoryview(bytearray(self.identity.page_bytes)) for _ in keys]
        found = self._read(keys, lambda i: [pages[i]])
        return [page if ok else None for page, ok in zip(pages, found, strict=True)]

    def batch_read_into(self, keys: Sequence[bytes], pieces_of: PiecesOf) -> int:
        """The longest stored prefix of `keys`, each page landing in pieces_of(i). Reads go a
        batch at a time and stop after the batch with the first miss; pages after the miss in
        that batch may have been written too."""
        n = 0
        for ok in self._read(keys, pieces_of, prefix=True):
            if not ok:
                break
            n += 1
        return n

    def _read(self, keys: Sequence[bytes], pieces_of: PiecesOf, prefix: bool = False) -> list[bool]:
        """Read every key into its pieces (with prefix, only up to the batch with the first
        miss); whether each arrived whole and verified."""
        found: list[bool] = []
        for start in range(0, len(keys), self._per_batch):
            chunk = keys[start : start + self._per_batch]
            found.extend(self._read_chunk(chunk, functools.partial(_shifted, pieces_of, start)))
            if prefix and not all(found):
                break
        return found

    def _read_chunk(self, keys: Sequence[bytes], pieces_of: PiecesOf) -> list[bool]:
        names = [self.name(k) for k in keys]
        pieces = [check_pieces(pieces_of(i), self.identity.page_bytes) for i in range(len(keys))]
        sizes = [fmt.stored_size(self.identity, k) for k in keys]
        if not self.direct or any(len(p) > DIRECT_MAX_PIECES for p in pieces):

            def finish(i: int, code: int | None, stored: memoryview) -> bool:
                return self._verify(keys[i], names[i], code, sizes[i], stored, pieces[i])

            return self._stager.get(names, sizes, self._run, finish)
        slots = [memoryview(bytearray(fmt.HEADER_BYTES + len(k))) for k in keys]  # each page's header + key
        ptrs = [[address(h), *map(address, p)] for h, p in zip(slots, pieces, strict=True)]
        lens = [[h.nbytes, *(v.nbytes for v in p)] for h, p in zip(slots, pieces, strict=True)]
        codes = self._run(lambda store: store.batch_get_into_multi_buffers(names, ptrs, lens), len(keys), "reads")
        answers: Sequence[int | None] = [None] * len(keys) if codes is None else codes
        return [self._verify(*row) for row in zip(keys, names, answers, sizes, slots, pieces, strict=True)]

    def _verify(
        self, key: bytes, name: str, code: int | None, size: int, got: memoryview, pieces: Sequence[memoryview]
    ) -> bool:
        """Whether a read that answered `code` (None: not sent, the cluster is down) delivered
        a page of ours: zero-copy, with its header + key in `got` and its payload in `pieces`;
        staged, with the whole stored page in `got`, then copied into `pieces`. A wrong or
        damaged page is removed and counted, and is a miss."""
        if code == size:
            try:
                if got.nbytes == size:  # staged: the whole page, verified as it is copied out
                    fmt.unstage_page(self.identity, key, got, pieces)
                else:
                    fmt.verify_page(self.identity, key, got, pieces)
            except fmt.PageError as e:
                if e.reason == "unreadable":  # valid for sidecars with the algorithm: leave it
                    self._error(str(e))
                    self._count(misses=1)
                else:
                    self._count(misses=1, **{e.reason: 1})
                    self._remove(key, name)
                return False
            self._count(hits=1, bytes_read=self.identity.page_bytes)
            return True
        self._count(misses=1)
        if code is None:
            return False
        if code in (INVALID_PARAMS, TRANSFER_FAIL) or code >= 0:  # maybe an object of another size
            stored = self._link.run(lambda store: store.get_size(name))
            if stored is not None and stored >= 0 and stored != size:
                self._count(corrupt=1)
                self._remove(key, name)
                return False
        if code != OBJECT_NOT_FOUND:
            self._error(f"mooncake read of {name}: code {code}")
        return False

    # ---- writes -------------------------------------------------------------------------------
    def set(self, key: bytes, data: Payload) -> bool:
        return self.batch_set([(key, data)])[0]

    def batch_set(self, items: Sequence[tuple[bytes, Payload]]) -> list[bool]:
        parts = [fmt.checked_parts(self.identity, key, data) for key, data in items]  # all, before any is sent
        ok: list[bool] = []
        for start in range(0, len(items), self._per_batch):
            end = start + self._per_batch
            ok.extend(self._write_chunk([key for key, _ in items[start:end]], parts[start:end]))
        n_ok = sum(ok)
        self._count(writes=n_ok, bytes_written=n_ok * self.identity.page_bytes, write_failures=len(ok) - n_ok)
        return ok

    def _write_chunk(self, keys: Sequence[bytes], parts: Sequence[Sequence[memoryview]]) -> list[bool]:
        names = [self.name(key) for key in keys]
        if not self.direct or any(len(page) > DIRECT_MAX_PIECES for page in parts):
            sizes = [fmt.stored_size(self.identity, key) for key in keys]

            def fill(i: int, dest: memoryview) -> None:
                fmt.stage_page(self.identity, keys[i], parts[i], dest)

            codes: list[int] | None = self._stager.put(names, sizes, fill, self._run)
        else:
            pages = [
                [memoryview(fmt.encode_header(self.identity, k, list(p))), *p] for k, p in zip(keys, parts, strict=True)
            ]
            ptrs = [[address(v) for v in page] for page in pages]
            lens = [[v.nbytes for v in page] for page in pages]
            codes = self._run(lambda store: store.batch_put_from_multi_buffers(names, ptrs, lens), len(keys), "writes")
        if codes is None:
            return [False] * len(keys)
        full = [code == NO_AVAILABLE_HANDLE for code in codes]
        self._count(no_space=sum(full))
        failed = [code for code in codes if code not in (0, NO_AVAILABLE_HANDLE, RPC_FAIL)]
        if failed:
            self._error(f"mooncake: {len(failed)} of {len(codes)} writes failed (code {failed[0]})")
        done = [code == 0 for code in codes]
        self._changed("stored", [key for key, good in zip(keys, done, strict=True) if good])
        return done

    def delete(self, key: bytes) -> bool:
        return self._remove(key, self.name(key))

    def _remove(self, key: bytes, name: str) -> bool:
        """Remove one object, even while a reader holds its lease."""
        if self._closed:
            raise ValueError("the mooncake tier is closed")
        code = self._link.run(lambda store: store.remove(name, True))
        if code == 0:
            self._count(deletes=1)
            self._changed("removed", [key])
            return True
        return False


def _shifted(pieces_of: PiecesOf, start: int, i: int) -> Sequence[memoryview]:
    return pieces_of(start + i)
