"""TransferEngine: page copies between a device pool and a host pool of one geometry."""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Literal

from hicache.pools.device import DeviceKVPool
from hicache.pools.host import HostKVPool
from hicache.transfer import cpu
from hicache.transfer.plan import PageList, TransferPlan, make_plan

Backend = Literal["auto", "torch", "triton"]


class TransferEngine:
    """Moves whole pages (every buffer of every, or the chosen, layers) between the pools.

    backend "auto" picks Triton kernels when the device pool is on CUDA and torch strided
    copies on CPU; "triton" on a CPU pool needs TRITON_INTERPRET=1 (tests).
    Raises ValueError if the pools' geometries differ or for an unknown backend.
    """

    def __init__(self, device_pool: DeviceKVPool, host_pool: HostKVPool, backend: Backend = "auto"):
        if device_pool.geometry != host_pool.geometry:
            diff = device_pool.geometry.diff(host_pool.geometry)
            raise ValueError(f"device and host pools have different geometries; fields differ: {diff}")
        if backend not in ("auto", "torch", "triton"):
            raise ValueError(f"backend must be 'auto', 'torch' or 'triton', got {backend!r}")
        if backend == "auto":
            backend = "triton" if device_pool.flat.is_cuda else "torch"
        if backend == "triton" and not device_pool.flat.is_cuda and os.environ.get("TRITON_INTERPRET") != "1":
            raise ValueError("backend 'triton' on a CPU pool needs TRITON_INTERPRET=1")
        self.device_pool = device_pool
        self.host_pool = host_pool
        self.geometry = device_pool.geometry
        self.backend: Backend = backend

    def offload_plan(self, device_pages: PageList, host_pages: PageList) -> TransferPlan:
        """Validate an offload. Raises ValueError for out-of-range, duplicate or mismatched lists."""
        return make_plan(
            device_pages,
            self.device_pool.num_pages,
            host_pages,
            self.host_pool.num_pages,
            self.geometry.layer_num,
            None,
            ("device_pages", "host_pages"),
        )

    def reload_plan(
        self, host_pages: PageList, device_pages: PageList, layers: Sequence[int] | None = None
    ) -> TransferPlan:
        """Validate a reload; `layers` are pool-local layer indices. Raises ValueError."""
        return make_plan(
            host_pages,
            self.host_pool.num_pages,
            device_pages,
            self.device_pool.num_pages,
            self.geometry.layer_num,
            layers,
            ("host_pages", "device_pages"),
        )

    def offload(self, device_pages: PageList, host_pages: PageList) -> int:
        """Copy every layer of device_pages[i] into host_pages[i]. Returns bytes moved."""
        plan = self.offload_plan(device_pages, host_pages)
        self._run(self.device_pool, self.host_pool, plan)
        return plan.num_pages * self.geometry.page_bytes

    def reload(self, host_pages: PageList, device_pages: PageList, layers: Sequence[int] | None = None) -> int:
        """Copy host_pages[i] into device_pages[i], all layers or the given pool-local ones.
        Returns bytes moved."""
        plan = self.reload_plan(host_pages, device_pages, layers)
        self._run(self.host_pool, self.device_pool, plan)
        return plan.num_pages * self.geometry.page_bytes_for(len(plan.layers))

    def _run(self, src: DeviceKVPool | HostKVPool, dst: DeviceKVPool | HostKVPool, plan: TransferPlan) -> None:
        if self.backend == "triton":
            from hicache.transfer.triton_kernels import copy_pages_triton

            copy_pages_triton(src, dst, plan)
        else:
            cpu.copy_pages(src, dst, plan)
