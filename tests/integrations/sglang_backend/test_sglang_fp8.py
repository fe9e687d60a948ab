"""fp8 KV caches through the SGLang adapter: SGLang stores e4m3 and e5m2 alike as uint8, so
which one a pool holds comes from SGLang's --kv-cache-dtype (or the adapter's
kv_cache_dtype key), never from the storage dtype; unknown, the adapter refuses to start."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from sglang_env import require_sglang

require_sglang()

from sglang_env import (  # noqa: E402
    FIXTURES,
    create,
    fill,
    keys_for,
    mha_host_pool,
    model_dir,
    page_bytes,
    sidecar_dir,
    storage_config,
)
from sidecar_util import start_sidecar  # noqa: E402
from test_sglang_backend import alloc, assert_host_rows, pages_of, stop, wait_stored  # noqa: E402

from hicache.integrations.sglang.backend import sglang_kv_cache_dtype  # noqa: E402
from hicache.integrations.sglang.options import Options  # noqa: E402
from hicache.integrations.sglang.pool_views import fp8_setting, geometry_of  # noqa: E402


@pytest.fixture
def sockdir() -> Iterator[str]:
    yield from sidecar_dir()


def llama_fp8_pool() -> Any:
    return mha_host_pool(32, 8, 128, 128, layout="page_first", dtype="uint8")


def test_a_uint8_pool_takes_its_fp8_format_from_the_setting() -> None:
    pool = llama_fp8_pool()
    e4m3 = geometry_of(pool, kv_cache_dtype="fp8_e4m3")
    e5m2 = geometry_of(pool, kv_cache_dtype="fp8_e5m2")
    assert (e4m3.dtype, e5m2.dtype) == ("float8_e4m3fn", "float8_e5m2")
    assert e4m3.fingerprint != e5m2.fingerprint  # never one identity: a reload decodes in its own format
    assert geometry_of(pool, kv_cache_dtype="auto").dtype == "float8_e4m3fn"  # an FP8 checkpoint's cache
    with pytest.raises(ValueError, match=r"which fp8 it is .* set 'kv_cache_dtype'"):
        geometry_of(pool)
    with pytest.raises(ValueError, match=r"--kv-cache-dtype 'bf16'.*fp8_e4m3"):
        geometry_of(pool, kv_cache_dtype="bf16")
    bf16 = mha_host_pool(32, 8, 128, 128, layout="page_first")
    assert geometry_of(bf16, kv_cache_dtype="fp8_e5m2").dtype == "bfloat16"  # only uint8 pools ask


def test_the_key_and_sglangs_setting_must_agree() -> None:
    assert fp8_setting(None, "fp8_e5m2") == "fp8_e5m2"
    assert fp8_setting("fp8_e5m2", None) == "fp8_e5m2"
    assert fp8_setting("fp8_e4m3", "auto") == "fp8_e4m3"
    assert fp8_setting("fp8_e5m2", "bf16") == "fp8_e5m2"  # a bf16 engine has no uint8 pool to name
    with pytest.raises(ValueError, match=r"'fp8_e5m2' names another fp8 format than SGLang's --kv-cache-dtype 'auto'"):
        fp8_setting("fp8_e5m2", "auto")
    with pytest.raises(ValueError, match=r"'kv_cache_dtype' must be one of \['fp8_e4m3', 'fp8_e5m2'\], got 'e5m2'"):
        Options.parse({"target": "unix:///x", "kv_cache_dtype": "e5m2"})


def test_sglangs_published_setting_is_read(tmp_path: Path) -> None:
    assert sglang_kv_cache_dtype() is None  # nothing published in this process
    # SGLang's own ServerArgs, published as its scheduler does; in a child, as it stays published
    script = f"""
        import sys
        sys.path.insert(0, {str(Path(__file__).parent)!r})
        import torchvision_standin
        torchvision_standin.install()
        from sglang.srt import runtime_context
        from sglang.srt.server_args import ServerArgs
        from hicache.integrations.sglang.backend import sglang_kv_cache_dtype
        args = ServerArgs(model_path={model_dir(tmp_path, "llama_3_1_8b")!r}, kv_cache_dtype="fp8_e5m2", device="cpu")
        runtime_context.publish(args, role="scheduler")
        print("setting", sglang_kv_cache_dtype())
    """
    out = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(script)], capture_output=True, text=True, timeout=300, check=True
    )
    assert "setting fp8_e5m2" in out.stdout.splitlines()


def test_an_e5m2_engine_round_trips_and_an_e4m3_one_is_refused(tmp_path: Path, sockdir: str) -> None:
    proc, target = start_sidecar(
        sockdir, "--kv-cache-dtype", "fp8_e5m2", config=FIXTURES / "llama_3_1_8b.json", page_size=16
    )
    try:
        name = model_dir(tmp_path, "llama_3_1_8b")
        pool = llama_fp8_pool()
        with pytest.raises(ValueError, match="kv_cache_dtype"):  # format unknown: no start-up
            create(storage_config(name, target, layout="page_first"), pool)
        # an engine of the other fp8 format is refused by the sidecar, naming the dtype
        with pytest.raises(ValueError, match=r"dtype \(engine 'float8_e4m3fn', sidecar 'float8_e5m2'\)"):
            create(storage_config(name, target, layout="page_first", kv_cache_dtype="fp8_e4m3"), pool)
        backend = create(storage_config(name, target, layout="page_first", kv_cache_dtype="fp8_e5m2"), pool)
        try:
            assert backend.links["kv"].geometry.dtype == "float8_e5m2"
            assert backend.links["kv"].copy_path == "engine"  # SGLang's uint8 pool, copied by this process
            fill(pool, seed=3)
            keys = keys_for(list(range(2 * 16)))
            src = alloc(pool, 2)
            want = [page_bytes(pool, p) for p in pages_of(src)]
            assert backend.batch_set_v1(keys, src) == [True, True]
            assert_host_rows(backend, keys, pool, pages_of(src))
            wait_stored(backend, 2)
            dst = alloc(pool, 2)
            assert backend.batch_get_v1(keys, dst) == [True, True]
            assert [page_bytes(pool, p) for p in pages_of(dst)] == want
        finally:
            backend.close()
    finally:
        stop(proc)
