"""The cuMemcpyBatchAsync binding, against a stand-in driver library compiled here.

The stand-in has the driver's C signatures (the CUDA 13 form without a failure index, and
the 12.8 form with one), checks the attributes it is given and copies host memory, so the
argument marshalling and the pieces of real pools are checked byte for byte without a GPU.
tests/gpu checks the real driver on the GPU machine.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import load_config
from helpers import fill_random, same_page

from hicache import DeviceKVPool, HostKVPool, KVGeometry, TransferEngine
from hicache.transfer import cuda_batch
from hicache.transfer.cuda import memcpy_pieces

STREAM = 0x5EED
FAKE_DRIVER = r"""
#include <stddef.h>
#include <string.h>
typedef struct { int type; int id; } Loc;
typedef struct { int order; Loc src; Loc dst; unsigned flags; } Attrs;
static size_t copies;
size_t copies_done(void) { return copies; }
int cuDriverGetVersion(int *v) { *v = VERSION; return 0; }
int cuGetErrorString(int code, const char **s) { *s = code == 1 ? "invalid value" : "other"; return 0; }
static int run(unsigned long long *d, unsigned long long *s, size_t *n, size_t count, Attrs *a,
               size_t *idx, size_t na, size_t *fail, void *stream) {
  if (na != 1 || idx[0] != 0 || a[0].order != 1 || a[0].flags != 1 || stream != (void *)0x5EED) {
    if (fail) *fail = 0;
    return 1;
  }
  for (size_t i = 0; i < count; i++) memcpy((void *)d[i], (void *)s[i], n[i]);
  copies += count;
  return 0;
}
#ifdef FAIL_INDEX
int cuMemcpyBatchAsync(unsigned long long *d, unsigned long long *s, size_t *n, size_t count, Attrs *a,
                       size_t *idx, size_t na, size_t *fail, void *stream) {
  return run(d, s, n, count, a, idx, na, fail, stream);
}
#elif !defined(NONE)
int cuMemcpyBatchAsync_v2(unsigned long long *d, unsigned long long *s, size_t *n, size_t count, Attrs *a,
                          size_t *idx, size_t na, void *stream) {
  return run(d, s, n, count, a, idx, na, NULL, stream);
}
#endif
"""


def fake_driver(tmp_path: Path, *flags: str, version: int = 13000) -> str:
    src = tmp_path / "fake_cuda.c"
    src.write_text(FAKE_DRIVER)
    lib = tmp_path / f"libfakecuda{'_'.join(flags)}{version}.so"
    cmd = ["cc", "-shared", "-fPIC", "-O1", f"-DVERSION={version}", *(f"-D{f}" for f in flags), str(src)]
    subprocess.run([*cmd, "-o", str(lib)], check=True)
    return str(lib)


@pytest.mark.parametrize("flags", [(), ("FAIL_INDEX",)], ids=["cuda13", "cuda12.8"])
def test_a_batch_copies_every_piece_with_stream_ordered_attributes(tmp_path: Path, flags: tuple[str, ...]) -> None:
    batch = cuda_batch.load(fake_driver(tmp_path, *flags))
    assert isinstance(batch, cuda_batch.BatchCopy) and batch.has_fail_index == bool(flags)
    src = np.arange(1000, dtype=np.uint8)
    dst = np.zeros(1000, dtype=np.uint8)
    base_s, base_d = src.ctypes.data, dst.ctypes.data
    batch(np.array([base_d + 500, base_d]), np.array([base_s, base_s + 900]), np.array([300, 100]), STREAM)
    assert dst[500:800].tolist() == src[:300].tolist() and dst[:100].tolist() == src[900:].tolist()
    assert int(dst[100:500].sum()) == 0 and int(dst[800:].sum()) == 0
    batch(np.array([], dtype=np.uint64), np.array([], dtype=np.uint64), np.array([], dtype=np.uint64), STREAM)


@pytest.mark.parametrize("flags", [(), ("FAIL_INDEX",)], ids=["cuda13", "cuda12.8"])
def test_a_refused_batch_raises_the_drivers_error(tmp_path: Path, flags: tuple[str, ...]) -> None:
    batch = cuda_batch.load(fake_driver(tmp_path, *flags))
    assert isinstance(batch, cuda_batch.BatchCopy)
    buf = np.zeros(8, dtype=np.uint8)
    ptr = np.array([buf.ctypes.data])
    where = " at copy 0" if flags else ""
    with pytest.raises(RuntimeError, match=f"of 1 copies failed{where}: CUresult 1 \\(invalid value\\)"):
        batch(ptr, ptr, np.array([8]), 0)  # the legacy default stream
    with pytest.raises(ValueError, match="differ in length: 1, 2, 1"):
        batch(ptr, np.array([1, 2]), np.array([8]), STREAM)


def test_a_driver_without_the_batch_call_gives_a_reason(tmp_path: Path) -> None:
    assert cuda_batch.load(fake_driver(tmp_path, version=12040)) == (
        "the CUDA driver (12040) is older than 12080, the first with cuMemcpyBatchAsync"
    )
    assert cuda_batch.load(fake_driver(tmp_path, "NONE")) == "the CUDA driver (13000) exports no cuMemcpyBatchAsync"
    reason = cuda_batch.load(str(tmp_path / "libmissing.so"))
    assert isinstance(reason, str) and reason.startswith(f"no CUDA driver library ({tmp_path}/libmissing.so:")


@pytest.mark.parametrize("layout", ["layer_first", "page_first_direct"])
def test_the_pieces_of_a_transfer_through_a_batch_move_its_pages(tmp_path: Path, layout: str) -> None:
    """memcpy_pieces as the CUDA copier hands them to the driver: pool base + offsets,
    one batch per layer row; the stand-in's memcpy moves exactly the plan's pages."""
    batch = cuda_batch.load(fake_driver(tmp_path))
    assert isinstance(batch, cuda_batch.BatchCopy)
    g = KVGeometry.from_hf_config(load_config("mimo_v2_flash"), page_size=4)
    dev, host, back = DeviceKVPool(g, 8), HostKVPool(g, 8, layout), DeviceKVPool(g, 8)
    fill_random(dev, 7)
    engine = TransferEngine(dev, host)
    plan = engine.offload_plan([0, 1, 2, 6, 4], [3, 4, 5, 0, 7])
    pieces = memcpy_pieces(dev, host, plan, plan.layers)
    assert pieces is not None
    s_off, d_off, nbytes = pieces
    pieces_per_buffer = 3 if layout == "layer_first" else 5  # page runs merge only where both sides are page-major
    assert s_off.shape == d_off.shape == nbytes.shape == (g.layer_num, pieces_per_buffer * len(g.buffers))
    for row in range(g.layer_num):  # per layer, as a layer-wise transfer queues them
        batch(d_off[row] + host.flat.data_ptr(), s_off[row] + dev.flat.data_ptr(), nbytes[row], STREAM)
    for d, h in zip(plan.src_pages, plan.dst_pages, strict=True):
        assert same_page(dev, int(d), host, int(h))
    rplan = engine.reload_plan([3, 7], [2, 5], layers=[1, 3])
    r = memcpy_pieces(host, back, rplan, rplan.layers)
    assert r is not None and r[0].shape[0] == 2
    batch(r[1].ravel() + back.flat.data_ptr(), r[0].ravel() + host.flat.data_ptr(), r[2].ravel(), STREAM)
    assert same_page(dev, 0, back, 2, layers=[1, 3]) and same_page(dev, 4, back, 5, layers=[1, 3])
    assert int(torch.count_nonzero(back.k_buffer(0))) == 0
