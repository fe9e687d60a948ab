"""Validated page lists, coalesced into runs: what every copy path executes."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property, lru_cache
from typing import Any

import numpy as np

PageList = Sequence[int] | np.ndarray | Any  # also accepts a 1-D integer torch tensor
SMALL_LIST = 64  # page lists up to this long are checked in plain Python


_INT64 = np.dtype(np.int64)


def small_int_pages(name: str, pages: PageList, limit: int) -> list[int] | None:
    """`pages` as a list when it is a list or tuple of at most SMALL_LIST plain ints, checked
    (each in [0, limit), unique; ValueError) in Python, as a sidecar call's pages come: no
    numpy conversion and type checks. None for anything else (as_pages checks it)."""
    if type(pages) not in (list, tuple) or not 0 < len(pages) <= SMALL_LIST:
        return None
    values = list(pages)
    if not all(type(v) is int for v in values):
        return None
    _check_small(name, values, limit)
    return values


def as_pages(name: str, pages: PageList, limit: int) -> np.ndarray:
    """`pages` as a contiguous 1-D int64 array, each in [0, limit) and unique. Raises ValueError."""
    if (values := small_int_pages(name, pages, limit)) is not None:
        return np.array(values, dtype=np.int64)
    if (
        type(pages) is np.ndarray
        and pages.dtype == _INT64
        and pages.ndim == 1
        and pages.size
        and pages.flags.c_contiguous
    ):
        arr = pages  # the common case, without the generic checks' few microseconds
        if arr.size == 1:  # one page: no set, no min or max
            if not 0 <= int(arr[0]) < limit:
                raise _out_of_range(name, int(arr[0]), limit)
            return arr
    else:
        if hasattr(pages, "detach"):  # a torch tensor
            pages = pages.detach().cpu().numpy()
        arr = np.asarray(pages)
        if arr.ndim != 1:
            raise ValueError(f"{name} must be a 1-D list of page indices, got shape {arr.shape}")
        if arr.size == 0:
            return np.zeros(0, dtype=np.int64)
        if arr.dtype == np.bool_ or not np.issubdtype(arr.dtype, np.integer):
            raise _not_integers(name, pages, arr.dtype, limit)
        if arr.dtype.kind == "u":  # a proto's uint64: 2**63 and up would wrap negative in int64
            _check_below(name, arr, limit)
        arr = np.ascontiguousarray(arr, dtype=np.int64)
    if arr.size <= SMALL_LIST:  # a few pages: plain Python is faster than numpy's sort
        _check_small(name, arr.tolist(), limit)
        return arr
    bad = arr[(arr < 0) | (arr >= limit)]
    if bad.size:
        raise _out_of_range(name, int(bad[0]), limit)
    uniq, counts = np.unique(arr, return_counts=True)
    if uniq.size != arr.size:
        raise ValueError(f"{name} has duplicate page {int(uniq[counts > 1][0])}")
    return arr


def _check_small(name: str, values: list[int], limit: int) -> None:
    """Raises ValueError naming the first page of `values` out of [0, limit), or repeated."""
    if min(values) < 0 or max(values) >= limit:
        raise _out_of_range(name, next(v for v in values if not 0 <= v < limit), limit)
    if len(set(values)) != len(values):
        seen: set[int] = set()
        first = next(v for v in values if v in seen or seen.add(v))  # type: ignore[func-returns-value]
        raise ValueError(f"{name} has duplicate page {first}")


def _check_below(name: str, arr: np.ndarray, limit: int) -> None:
    """Raises ValueError naming the first page of unsigned `arr` that is >= limit, as sent."""
    bad = arr[arr >= limit]
    if bad.size:
        raise _out_of_range(name, int(bad[0]), limit)


def _out_of_range(name: str, page: int, limit: int) -> ValueError:
    return ValueError(f"{name} has page {page} out of range [0, {limit})")


def _not_integers(name: str, pages: PageList, dtype: np.dtype, limit: int) -> ValueError:
    """The error for pages numpy holds in no integer dtype. Python ints past int64 make a
    float or object array (a uint64 of 2**63 or more beside a smaller page): the first page
    out of range is named, as sent."""
    if isinstance(pages, Sequence) and all(type(p) is int for p in pages):
        first = next(p for p in pages if not 0 <= p < limit)
        return _out_of_range(name, first, limit)
    return ValueError(f"{name} must hold integers, got dtype {dtype}")


@dataclass(frozen=True)
class TransferPlan:
    """src_pages[i] is copied to dst_pages[i] for the layers in `layer_runs`.

    runs: (src_start, dst_start, count) of page runs adjacent on both sides (computed when
    first read: the native path does not need them).
    layer_runs: (first, count) of consecutive pool-local layers.
    """

    src_pages: np.ndarray
    dst_pages: np.ndarray
    layers: tuple[int, ...]
    layer_runs: tuple[tuple[int, int], ...]

    @property
    def num_pages(self) -> int:
        return int(self.src_pages.size)

    @cached_property
    def runs(self) -> tuple[tuple[int, int, int], ...]:
        order = np.argsort(self.src_pages, kind="stable")
        s, d = self.src_pages[order], self.dst_pages[order]
        if not s.size:
            return ()
        breaks = np.flatnonzero((np.diff(s) != 1) | (np.diff(d) != 1)) + 1
        starts = np.concatenate(([0], breaks))
        ends = np.concatenate((breaks, [s.size]))
        return tuple(zip(s[starts].tolist(), d[starts].tolist(), (ends - starts).tolist(), strict=True))


def make_plan(
    src_pages: PageList,
    src_limit: int,
    dst_pages: PageList,
    dst_limit: int,
    layer_num: int,
    layers: Sequence[int] | None = None,
    names: tuple[str, str] = ("src_pages", "dst_pages"),
) -> TransferPlan:
    """Validate both page lists and the layer list, then coalesce. Raises ValueError."""
    src = as_pages(names[0], src_pages, src_limit)
    dst = as_pages(names[1], dst_pages, dst_limit)
    if src.size != dst.size:
        raise ValueError(f"{names[0]} has {src.size} pages but {names[1]} has {dst.size}")
    if layers is None:
        layer_list, runs = _all_layers(layer_num)
    else:
        layer_list = _as_layers(layers, layer_num)
        runs = _layer_runs(layer_list)
    return TransferPlan(src, dst, layer_list, runs)


@lru_cache(maxsize=16)
def _all_layers(layer_num: int) -> tuple[tuple[int, ...], tuple[tuple[int, int], ...]]:
    """Every layer and its one run, made once per layer count (most transfers ask for all)."""
    return tuple(range(layer_num)), ((0, layer_num),)


def _as_layers(layers: Sequence[int], layer_num: int) -> tuple[int, ...]:
    out = []
    for layer in layers:
        if isinstance(layer, bool) or not isinstance(layer, (int, np.integer)) or not 0 <= layer < layer_num:
            raise ValueError(f"layer {layer!r} out of range [0, {layer_num})")
        out.append(int(layer))
    if len(set(out)) != len(out):
        raise ValueError(f"layers has duplicates: {out}")
    return tuple(sorted(out))


def _layer_runs(layers: tuple[int, ...]) -> tuple[tuple[int, int], ...]:
    runs: list[tuple[int, int]] = []
    for layer in layers:
        if runs and runs[-1][0] + runs[-1][1] == layer:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1)
        else:
            runs.append((layer, 1))
    return tuple(runs)
