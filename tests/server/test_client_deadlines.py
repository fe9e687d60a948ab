"""One deadline per call: retries on UNAVAILABLE share the call's timeout instead of taking
it again each; close() unregisters every pool within one short budget (CLOSE_S)."""

from __future__ import annotations

from typing import Any

import grpc
import pytest
from sidecar_util import filled_device, mimo_geometries

from hicache.client import HiCacheClient, HiCacheRpcError
from hicache.client.client import CLOSE_S
from hicache.client.connection import Connection
from hicache.sidecar.config import ServiceConfig
from server import ServerConfig, create_server


class _Down(grpc.RpcError):
    def code(self) -> grpc.StatusCode:
        return grpc.StatusCode.UNAVAILABLE

    def details(self) -> str:
        return "down"


def test_retries_share_the_calls_one_deadline():
    conn = Connection("unix:///nonexistent/hc.sock", None, timeout=0.5, retries=4, tls=None)
    given: list[float] = []

    def down(request: Any, *, timeout: float, **kwargs: Any) -> Any:
        given.append(timeout)
        raise _Down()

    with pytest.raises(HiCacheRpcError) as exc:
        conn.call(down, "req")
    assert exc.value.code.name in ("UNAVAILABLE", "DEADLINE_EXCEEDED")
    assert given[0] <= 0.5 and all(b < a for a, b in zip(given, given[1:], strict=False))  # what is left, each time
    conn.close()


def test_close_unregisters_every_pool_within_one_short_budget(tmp_path):
    config = ServerConfig(socket=str(tmp_path / "hc.sock"), service=ServiceConfig(expected=mimo_geometries()))
    srv, address = create_server(config)
    devs = [filled_device(4, seed=i) for i in range(3)]
    client = HiCacheClient(address, timeout=60)
    try:
        for dev in devs:
            client.register(dev, model_id="mimo@test")
        real = client._stub.UnregisterPool
        given: list[float] = []

        def unregister(request: Any, *, timeout: float, **kwargs: Any) -> Any:
            given.append(timeout)
            return real(request, timeout=timeout, **kwargs)

        client._stub.UnregisterPool = unregister
        client.close()
        assert len(given) == 3 and given[0] <= CLOSE_S < 60  # not the client's 60 s per pool
        assert all(b < a for a, b in zip(given, given[1:], strict=False))  # one budget for all
        assert srv.service.pool_ids == []
    finally:
        srv.stop(0)
        for dev in devs:
            dev.close()
