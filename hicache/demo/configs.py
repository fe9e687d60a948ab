"""Model configs for the demo and `hicache geometry`: load an HF config.json, list its KV
groups, and cut a model down to its first N layers (same per-layer geometry, less memory)."""

from __future__ import annotations

import argparse
import copy
import json
from importlib import resources
from typing import Any

from hicache.geometry import model_geometries

# Per-layer lists in an HF config that must be cut when the layer count is.
_PER_LAYER_KEYS = ("hybrid_layer_pattern", "layer_types")


def load_config(path: str | None) -> dict[str, Any]:
    """An HF config.json as a dict; the bundled MiMo-V2-Flash config when path is None.
    Raises OSError for a missing file, ValueError for invalid JSON."""
    if path is None:
        return json.loads(resources.files("hicache.data").joinpath("mimo_v2_flash.json").read_text())
    with open(path) as f:
        try:
            return json.load(f)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path} is not valid JSON: {exc}") from None


def truncate_layers(config: dict[str, Any], layers: int) -> dict[str, Any]:
    """A copy of `config` with only its first `layers` layers (per-layer lists cut too).

    Raises ValueError if layers is not in [1, num_hidden_layers].
    """
    cfg = copy.deepcopy(config)
    inner = cfg.get("text_config", cfg)
    total = inner.get("num_hidden_layers")
    if (
        isinstance(layers, bool)
        or not isinstance(layers, int)
        or not isinstance(total, int)
        or not 1 <= layers <= total
    ):
        raise ValueError(f"layers must be an int in [1, num_hidden_layers={total}], got {layers!r}")
    inner["num_hidden_layers"] = layers
    for key in _PER_LAYER_KEYS:
        if isinstance(inner.get(key), list):
            inner[key] = inner[key][:layers]
    return cfg


def print_geometry(args: argparse.Namespace) -> int:
    """`hicache geometry CONFIG.json`: one line per KV group."""
    config = load_config(args.config)
    for group, g in model_geometries(config, tp_size=args.tp_size, page_size=args.page_size, dtype=args.dtype).items():
        print(
            f"[{group}] {g.attention} layers={g.layer_num} heads={g.head_num} head_dim={g.head_dim} "
            f"v_head_dim={g.v_head_dim} dtype={g.dtype} k_row_bytes={g.k_row_bytes} "
            f"v_row_bytes={g.v_row_bytes} token_bytes={g.token_bytes} page_bytes={g.page_bytes} "
            f"fingerprint={g.fingerprint}"
        )
    return 0
