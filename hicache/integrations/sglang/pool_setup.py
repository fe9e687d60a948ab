"""What the SGLang backend settles before it registers one host pool with the sidecar.

The pool's geometry (read from SGLang's host pool, cross-checked against the model config),
the identity it registers under (MLA ranks share one), which copy path it takes, and whether
MLA reader ranks can ever hit. Also what hicache reads of SGLang's runtime settings (its
--nnodes and --kv-cache-dtype). A setting that cannot work raises ValueError, so SGLang
fails to start.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig

from hicache.client import HiCacheClient
from hicache.geometry import KVGeometry, model_geometries
from hicache.hf_config import load_model_config
from hicache.integrations.sglang.link import PoolLink
from hicache.integrations.sglang.options import Options
from hicache.integrations.sglang.pool_views import fp8_setting, geometry_of, stage_geometry


def pool_geometry(cfg: HiCacheStorageConfig, opts: Options, name: str, group: str, host_pool: Any) -> KVGeometry:
    """The geometry of SGLang's host pool `name` (hicache KV group `group`). With the model
    config at hand: this PP stage's layer ids, and a ValueError where the pool differs."""
    mla = bool(cfg.is_mla_model)
    config = load_model_config(cfg.model_name, opts.model_config)
    kv_dtype = fp8_setting(opts.kv_cache_dtype, sglang_kv_cache_dtype())
    geometry = geometry_of(host_pool, kv_cache_dtype=kv_dtype)
    if config is not None:  # the model's layer ids for this group (this PP stage's), and a cross-check
        tp = 1 if mla else cfg.tp_size
        want = model_geometries(config, tp_size=tp, page_size=geometry.page_size, dtype=geometry.dtype)
        if group not in want:
            raise ValueError(f"SGLang host pool {name!r}: the model config has no {group!r} group")
        stage = stage_geometry(host_pool, want[group])
        geometry = geometry_of(host_pool, layer_ids=stage.layer_ids, kv_cache_dtype=kv_dtype)
        differ = stage.diff(geometry)
        if differ:
            mine, theirs = geometry.to_dict(), stage.to_dict()
            detail = ", ".join(f"{f} (SGLang {mine[f]!r}, model config {theirs[f]!r})" for f in differ)
            raise ValueError(f"SGLang host pool {name!r} does not match the model config: {detail}")
    return geometry


def pool_identity(cfg: HiCacheStorageConfig, namespace: str, model_id: str) -> dict[str, Any]:
    """The identity fields of the pool's registration (namespace, model_id, tp_rank, tp_size)."""
    mla = bool(cfg.is_mla_model)
    return {
        "namespace": namespace,
        "model_id": model_id + (mla_shard(cfg) if mla else ""),
        # MLA latents are the same on every TP rank of one CP shard: those read one identity
        "tp_rank": 0 if mla else cfg.tp_rank,
        "tp_size": 1 if mla else cfg.tp_size,
    }


def copy_path(opts: Options, target: str, host_pool: Any) -> tuple[bool, str]:
    """Whether the sidecar copies itself (it maps SGLang's memfds), and the copy path as the
    start-up log says it. Raises ValueError for copy 'direct' where it cannot be."""
    fds = getattr(getattr(host_pool, "allocator", None), "fds", None)
    can_direct = bool(fds) and target.startswith("unix://")
    if opts.copy == "direct" and not can_direct:
        raise ValueError(
            'copy \'direct\' needs SGLang\'s host pool in shared memory ("allocator": "shm" in the extra config) '
            f"and a sidecar on a Unix socket; target is {opts.target!r}"
        )
    direct = can_direct and opts.copy in ("auto", "direct")
    how = (
        "copy path 'sidecar' (it maps SGLang's memfds)"
        if direct
        else "copy path 'engine' (this process copies between SGLang's host pool and the sidecar's)"
    )
    return direct, how


def check_mla_readers(
    cfg: HiCacheStorageConfig,
    target: str,
    client: HiCacheClient,
    link: PoolLink,
    nodes: Callable[[], int],
    say: Callable[[str, str], None],
) -> None:
    """SGLang stores MLA pages from its writer ranks only (tp_rank == dcp_rank). On one
    node every rank registers the same identity with the same sidecar, so the ranks share
    its host cache and the readers hit the writer's pages in host memory. Across nodes
    (`nodes()` > 1) a rank on another node reads only what reached the storage tier;
    without one it never hits, and SGLang takes the smallest hit over its TP ranks.
    Raises ValueError then; warns (through `say`) when the write policy puts pages in
    storage late."""
    if getattr(cfg, "attn_cp_size", 1) > 1:
        say(
            "mla:attn_cp",
            f"MLA with attention context parallelism (size {cfg.attn_cp_size}): SGLang stores only rank 0's "
            "slice of each page, so the other CP ranks miss and prefixes do not hit from storage",
        )
    n_nodes = nodes()
    if cfg.tp_size <= getattr(cfg, "dcp_size", 1) or n_nodes == 1:
        return  # every rank is a writer, or every reader shares the writer's host cache
    stats = client.stats(pool=link.pool_id)[0]
    if stats.storage_backend == "none":
        raise ValueError(
            f"MLA with tp_size {cfg.tp_size} over {n_nodes} nodes needs a storage tier on the hicache sidecar at "
            f"{target} (SGLang stores only from rank 0; ranks on other nodes read from storage); "
            "it has storage backend 'none'"
        )
    if stats.write_policy not in ("write_through", ""):  # "": a sidecar too old to say
        say(
            "mla:write_policy",
            f"MLA with tp_size {cfg.tp_size} over {n_nodes} nodes: the hicache sidecar at {target} "
            f"runs --hicache-write-policy {stats.write_policy}, so pages reach its storage tier late (on "
            "eviction or reuse) and until then the ranks that read them from storage miss, and no prefix "
            "hits; start it with --hicache-write-policy write_through",
        )


def sglang_nodes() -> int:
    """SGLang's --nnodes as its server published it; 1 where nothing is published (SGLang's
    classes used outside its server) or SGLang moved it."""
    try:
        from sglang.srt.runtime_context import get_server_args

        return max(1, int(getattr(get_server_args(), "nnodes", 1) or 1))
    except Exception:
        return 1


def mla_shard(cfg: HiCacheStorageConfig) -> str:
    """The model identity's suffix for an MLA rank's slice of each page: under attention or
    decode context parallelism each CP rank holds a different part of every page, so its
    pages must not be read by another CP rank ("" without CP)."""
    out = ""
    if getattr(cfg, "attn_cp_size", 1) > 1:
        out += f"|cp{cfg.attn_cp_rank}of{cfg.attn_cp_size}"
    if getattr(cfg, "dcp_size", 1) > 1:
        out += f"|dcp{cfg.dcp_rank}of{cfg.dcp_size}|page{cfg.logical_page_size}"
    return out


def sglang_kv_cache_dtype() -> str | None:
    """SGLang's --kv-cache-dtype as its runtime settings hold it in the scheduler process
    (sglang.srt.runtime_context); None where they are not published."""
    try:
        from sglang.srt.runtime_context import get_model

        value = get_model().kv_cache_dtype
    except (ImportError, ValueError, AttributeError):
        return None
    return value if isinstance(value, str) else None
