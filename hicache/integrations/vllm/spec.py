"""HiCacheOffloadingSpec: the class vLLM's OffloadingSpecFactory loads from
kv_connector_extra_config {"spec_name": "HiCacheOffloadingSpec",
"spec_module_path": "hicache.integrations.vllm", "target": ...} (HiCacheConnector sets
the first two itself).

vLLM builds one in the scheduler process (get_manager) and one per worker rank
(get_worker). The geometry of each KV-cache group comes from vLLM's own KVCacheSpec of the
group's layers when the worker runs inside vLLM (an MLA latent's split into kv_lora_rank +
qk_rope_head_dim from the HF config), else from the model's HF config; either way it must
give exactly the bytes per block that vLLM allocated.
"""

from __future__ import annotations

import logging
from typing import Any

from vllm.v1.kv_cache_interface import MLAAttentionSpec
from vllm.v1.kv_offload.base import CanonicalKVCaches, OffloadingManager, OffloadingSpec, OffloadingWorker
from vllm.v1.kv_offload.config import OffloadingConfig

from hicache.client import HiCacheClient
from hicache.geometry import KVGeometry
from hicache.hf_config import load_model_config
from hicache.integrations.vllm import compat
from hicache.integrations.vllm.geometry import (
    check_page_bytes,
    geometry_from_hf,
    geometry_from_spec,
    layer_ids_of,
    sliding_in_model,
)
from hicache.integrations.vllm.manager import HiCacheOffloadingManager
from hicache.integrations.vllm.options import Options
from hicache.integrations.vllm.worker import HiCacheOffloadingWorker

log = logging.getLogger("hicache.integrations.vllm")


class HiCacheOffloadingSpec(OffloadingSpec):  # type: ignore[misc]
    def __init__(self, config: OffloadingConfig):
        super().__init__(config)
        self.options = Options.parse(self.extra_config)
        self.model_id = self.options.model_id or config.model.name
        if not self.model_id:
            raise ValueError("vLLM gave no model name: set 'model_id' in kv_connector_extra_config")
        self._manager: HiCacheOffloadingManager | None = None
        self._worker: HiCacheOffloadingWorker | None = None

    def get_manager(self) -> OffloadingManager:
        if self._manager is None:
            client = HiCacheClient(self.options.target, token=self.options.token, timeout=self.options.timeout_s)
            self._manager = HiCacheOffloadingManager(self.options, self.config, client)
        return self._manager

    def get_worker(self, kv_caches: CanonicalKVCaches) -> OffloadingWorker:
        if self._worker is None:
            self._worker = HiCacheOffloadingWorker(
                self.options, self.config, kv_caches, self.geometries(kv_caches), self.model_id
            )
        return self._worker

    def geometries(self, kv_caches: CanonicalKVCaches) -> list[tuple[KVGeometry, int, str]]:
        """Each group's KVGeometry, checked against vLLM's bytes per block; the bytes of a
        layer's page where vLLM packs the layers of a block into one region (else 0); and the
        group's hicache name ("swa" for a sliding-window group, else "full"). Raises
        ValueError."""
        cfg = self.config
        if len(kv_caches.group_data_refs) != len(cfg.groups):
            raise ValueError(
                f"vLLM gave {len(kv_caches.group_data_refs)} KV-cache groups, its config {len(cfg.groups)}"
            )
        hf: dict[str, Any] | None = None

        def model_config() -> dict[str, Any]:
            nonlocal hf
            hf = hf if hf is not None else _hf_config(cfg, self.options)
            return hf

        out: list[tuple[KVGeometry, int, str]] = []
        for g, (group, refs) in enumerate(zip(cfg.groups, kv_caches.group_data_refs, strict=True)):
            live = _live_spec(group.layer_names)
            ids = layer_ids_of(group.layer_names)
            sliding = compat.group_is_sliding(group, live)
            if sliding is None:  # vLLM 0.32 outside a worker: the model config says
                sliding = sliding_in_model(model_config(), ids)
            if live is not None and not isinstance(live, MLAAttentionSpec):
                geometry = geometry_from_spec(live, len(group.layer_names), ids)
            else:  # the HF config gives the geometry, or an MLA latent's split (vLLM's spec has none)
                geometry = (
                    geometry_from_spec(live, len(group.layer_names), ids, model_config())
                    if live is not None
                    else geometry_from_hf(
                        model_config(),
                        sliding=sliding,
                        layer_names=group.layer_names,
                        tp_size=cfg.parallel.tp_size,
                        page_size=group.tokens_per_block,
                        dtype=cfg.model.dtype,
                    )
                )
            packed = check_page_bytes(geometry, [r.page_size_bytes for r in refs], g)
            out.append((geometry, geometry.page_bytes_for(1) if packed else 0, "swa" if sliding else "full"))
        return out


def _hf_config(cfg: OffloadingConfig, options: Options) -> dict[str, Any]:
    """The model's HF config: options.model_config, <model>/config.json, or vLLM's hf_config."""
    found = load_model_config(cfg.model.name, options.model_config)
    if found is not None:
        return found
    from vllm.config import get_current_vllm_config_or_none

    current = get_current_vllm_config_or_none()
    if current is not None and current.model_config is not None:
        return dict(current.model_config.hf_config.to_dict())
    raise ValueError(
        f"no model config for {cfg.model.name!r}: set 'model_config' (a config.json) in kv_connector_extra_config"
    )


def _live_spec(layer_names: tuple[str, ...]) -> Any:
    """vLLM's own KVCacheSpec of the layers, when this runs inside a vLLM worker whose
    attention layers are built; None elsewhere."""
    try:
        from vllm.config import get_current_vllm_config_or_none, get_layers_from_vllm_config
        from vllm.model_executor.layers.attention_layer_base import AttentionLayerBase
    except ImportError:
        return None
    current = get_current_vllm_config_or_none()
    if current is None:
        return None
    layers = get_layers_from_vllm_config(current, AttentionLayerBase, layer_names)  # type: ignore[type-abstract]
    if len(layers) != len(layer_names):
        return None
    specs = [layers[n].get_kv_cache_spec(current) for n in layer_names]
    if len({repr(s) for s in specs}) != 1:  # a dataclass repr names the class and every field
        raise ValueError(f"the layers of one vLLM KV-cache group have different KV specs: {sorted(map(repr, specs))}")
    return specs[0]
