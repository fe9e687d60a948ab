"""A layer-wise reload that fails in the sidecar (copy_layers) publishes FAILED only once the
copy it started has ended: a copy still running would publish its layers over FAILED, and the
caller frees the pages it still reads."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import load_config
from helpers import fill_random

from hicache.geometry import KVGeometry
from hicache.pools import DeviceKVPool, HostKVPool
from hicache.sidecar.operations import Operation, copy_layers
from hicache.transfer import TransferEngine, native
from hicache.transfer.progress import FAILED, ProgressWords

pytestmark = pytest.mark.skipif(not native.available(), reason="the C extension is not built")


class FailingOperation(Operation):
    """Raises on the first layer it is told about, while the copy has most layers to go."""

    def layer_done(self, layer: int, layers_done: int) -> None:
        raise RuntimeError("watcher gone")


def test_failed_is_published_after_the_running_copy_ends_and_stays() -> None:
    g = KVGeometry.from_hf_config(load_config("mimo_v2_flash"), page_size=64)
    dev, host = DeviceKVPool(g, 32), HostKVPool(g, 32)
    fill_random(host, 4)
    pages = list(range(32))  # 47 MB: queued, and long enough to still run when layer 0 is in
    with TransferEngine(dev, host, "native", copy_threads=2) as engine:
        words = ProgressWords.private(engine.threads)
        op = FailingOperation("op", g.layer_num)
        handle = engine.reload_async(pages, pages, progress=words)
        with pytest.raises(RuntimeError, match="watcher gone"):
            copy_layers(engine, op, pages, pages, per_layer=True, progress=words, started=handle)
        assert handle.done(), "copy_layers returned while its copy still ran"
        assert np.all(words.array == FAILED), f"FAILED was overwritten: {words.array.tolist()}"
        assert op.finished
