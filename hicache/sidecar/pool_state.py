"""What a registered pool holds (its identity, the mapped device pool, its share of a host
cache, the copiers, counters, operations and pins), and the checks each of its calls makes
before changing anything: keys, device pages, the device mapping, and in flight until close.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence

from hicache.cache.index import HostIndex
from hicache.memory.cuda_events import OpenedIpcEvents
from hicache.pools import DeviceKVPool, HostKVPool
from hicache.sidecar.checks import check_keys, check_pages
from hicache.sidecar.errors import StateError
from hicache.sidecar.events import PoolEvents
from hicache.sidecar.grants import CopyGrants
from hicache.sidecar.layer_events import LayerEvents
from hicache.sidecar.operations import (
    OperationTable,
    PrefetchTable,
)
from hicache.sidecar.pool_stats import Counters
from hicache.sidecar.progress_block import ProgressBlock
from hicache.sidecar.registration import PoolIdentity
from hicache.sidecar.shared_cache import SharedHostCache
from hicache.transfer import TransferEngine
from hicache.transfer.engine import Backend


class PoolState:
    """The state RegisteredPool's calls share; see RegisteredPool for what its lock guards."""

    def __init__(
        self,
        identity: PoolIdentity,
        device: DeviceKVPool | None,
        shared: SharedHostCache,
        *,
        max_batch: int,
        finished_ops_kept: int,
        io_backend: Backend = "auto",
        clock: Callable[[], float] = time.monotonic,
        events: PoolEvents | None = None,
        offload_events: OpenedIpcEvents | None = None,
        layerwise_inline_bytes: int = 0,
        device_pages: int = 0,
        grant_ttl_s: float = 30.0,
        window: HostKVPool | None = None,
        max_pin_share: float = 1.0,
    ):
        """`shared`: the host cache it joins (hicache.sidecar.shared_cache); StateError if that
        is closing. `events`: where the pool publishes KV events (registered now, unregistered
        at close, and every change of what its host index and storage tier hold). `offload_events`: the
        engine's interprocess CUDA events, opened (an OpenedIpcEvents, closed with the pool),
        that offloads wait for on the GPU. `layerwise_inline_bytes`: a layer-wise reload of
        fewer bytes is copied before the answer (CPU pools). device None: the engine's memory
        is not mapped (copy path "engine": the engine copies through grants, see grants.py);
        device_pages then says how many pages it has. `window`: the copy window of its
        BeginCopy offloads (owned and closed with the pool; None: it takes none)."""
        self.identity = identity
        self.device = device
        self.shared = shared
        cache = self.cache = shared.cache
        self.host: HostKVPool = shared.host
        self.engine = TransferEngine(device, self.host, io_backend) if device is not None else None
        self.geometry = cache.geometry
        self.device_pages = device.num_pages if device is not None else device_pages
        self.copy_path = "sidecar" if device is not None else "engine"
        self.grants = CopyGrants(cache, grant_ttl_s, clock, window)
        self.max_pin_share = max_pin_share  # of its host cache's pages, pinned by this pool
        self.max_batch = max_batch
        self.counters = Counters()
        self.lock = threading.Lock()
        self._pins: Counter[bytes] = Counter()  # this member's pins (guarded by _pin_lock)
        self._pin_lock = threading.Lock()  # one pin or unpin of this pool at a time
        self.closed = False
        self._busy = 0  # calls and layer-wise workers in flight; close() waits for 0
        self._idle = threading.Condition(self.lock)
        self._released = threading.Event()  # set once close() has released everything
        self._ops = OperationTable(finished_ops_kept)
        self._prefetches = PrefetchTable(finished_ops_kept)
        self._clock = clock
        # where layer-wise reloads publish their layers for the engine (the native CPU path)
        self.progress = ProgressBlock() if self.engine is not None and self.engine.backend == "native" else None
        # CUDA pools: the layer events layer-wise reloads record for the engine's stream
        self.layer_events: LayerEvents | None = None
        if device is not None and device.flat.is_cuda:
            self.layer_events = LayerEvents(self.geometry.layer_num, device.flat.device.index or 0)
        self.offload_events = offload_events
        self.layerwise_inline_bytes = layerwise_inline_bytes
        self.events = events
        if not shared.join(identity.pool_id, self.geometry.pool_bytes(self.device_pages), events):
            self._close_copiers()
            raise StateError(f"host cache {shared.cache_id} closed while pool {identity.pool_id} joined it")

    @property
    def _copier(self) -> TransferEngine:
        assert self.engine is not None  # check_device refused a pool without a mapping
        return self.engine

    @property
    def index(self) -> HostIndex:
        return self.cache.index

    # ---- validation (no state changes) --------------------------------------------------
    @contextlib.contextmanager
    def _in_flight(self) -> Iterator[None]:
        """Count the call as in flight (close() waits for it); StateError once closed."""
        with self.lock:
            if self.closed:
                raise StateError(f"pool {self.identity.pool_id} is closed")
            self._busy += 1
        try:
            yield
        finally:
            self._done_one()

    def _done_one(self) -> None:
        with self.lock:
            self._busy -= 1
            self._idle.notify_all()

    def check_keys(self, keys: Sequence[bytes], *, unique: bool = False) -> list[bytes]:
        return check_keys(keys, self.identity.key_bytes, self.identity.key_hash, self.max_batch, unique=unique)

    def check_pages(self, device_pages: Sequence[int], n: int) -> list[int]:
        return check_pages(device_pages, n, self.device_pages)

    def check_device(self) -> None:
        """Raises StateError when the engine changed its memory under the sidecar (a shared file
        shrunk below the mapped size): copying would fault the whole sidecar (SIGBUS). Only
        this pool's calls fail; the engine must register again. Call it in flight (_in_flight):
        once the pool is closed, the fds it checks are closed too. A pool whose engine copies
        itself has no mapping: ValueError, since the sidecar has nothing to copy with."""
        if self.device is None:
            raise ValueError(
                f"pool {self.identity.pool_id} copies in the engine (copy_path 'engine'): "
                "the engine copies through BeginCopy/EndCopy, not Offload/Reload"
            )
        problem = self.device.memory.damage()
        if problem:
            raise StateError(f"pool {self.identity.pool_id}: {problem}; register the pool again")

    def _close_copiers(self) -> None:
        with contextlib.ExitStack() as steps:
            for part in (self.engine, self.progress, self.layer_events):
                if part is not None:
                    steps.callback(part.close)
