"""The demo: an example engine (a tiny model over real-geometry KV pools) driving a sidecar.

`hicache demo` runs it (hicache.demo.run); configs.py also serves `hicache geometry`.
"""

from hicache.demo.configs import load_config, model_geometries, print_geometry, truncate_layers

__all__ = ["load_config", "model_geometries", "print_geometry", "truncate_layers"]
