"""The CUDA kernel's code generation, checked without a GPU: compile to PTX for sm_90.

Triton's compiler (and its bundled ptxas) runs on any machine; only the launch needs a GPU.
This is what proves the "wide vectorised loads" of the kernel: 16-byte ld/st.global.v4.
"""

import re
from pathlib import Path

import pytest
import triton
from conftest import CONFIG_NAMES, load_config
from triton.runtime.jit import JITFunction

from hicache import DeviceKVPool, HostKVPool, KVGeometry
from hicache.pools import LAYOUTS
from hicache.transfer import triton_kernels
from hicache.transfer.triton_kernels import word_and_vec

try:
    import triton.backends
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    _NVIDIA = "nvidia" in triton.backends.backends
    _PTXAS = _NVIDIA and (Path(triton.backends.__file__).parent / "nvidia" / "bin" / "ptxas").exists()
except ImportError:  # older Triton without this compiler API
    _PTXAS = False

# Checked up front, so that a kernel that fails to compile fails the test instead of skipping it.
needs_cuda_compiler = pytest.mark.skipif(not _PTXAS, reason="this Triton build has no NVIDIA backend with ptxas")


def ptx_memory_ops(vec: int, word_type: str, row_words: int) -> set[str]:
    kernel = triton_kernels._copy_chunks_kernel
    fn = kernel if isinstance(kernel, JITFunction) else JITFunction(kernel.fn)  # plain kernel under TRITON_INTERPRET
    signature = {name: "i64" for name in fn.arg_names}
    signature.update(src_flat=word_type, dst_flat=word_type)
    signature.update({name: "*i64" for name in ("src_layer_offsets", "dst_layer_offsets", "src_pages", "dst_pages")})
    block = triton.next_power_of_2(row_words)
    constants = dict(ROWS=64, ROW_WORDS=row_words, ROW_BLOCK=max(1, 4096 // block), BLOCK=block, VEC=vec)
    signature.update({name: "constexpr" for name in constants})
    aligned = {(0,): [["tt.divisibility", 16]], (1,): [["tt.divisibility", 16]]}  # what a launch sees for torch memory
    compiled = triton.compile(
        ASTSource(fn=fn, signature=signature, constexprs=constants, attrs=aligned),
        target=GPUTarget("cuda", 90, 32),
    )
    return set(re.findall(r"(?:ld|st)\.global(?:\.v\d)?\.b\d+", compiled.asm["ptx"]))


@needs_cuda_compiler
def test_aligned_rows_compile_to_16_byte_vector_loads_and_stores():
    ops = ptx_memory_ops(vec=4, word_type="*i32", row_words=384)  # a 1536-byte K row of MiMo-V2-Flash
    assert "ld.global.v4.b32" in ops and "st.global.v4.b32" in ops
    assert not any(op.startswith("st.global") and op != "st.global.v4.b32" for op in ops)


@needs_cuda_compiler
def test_unaligned_rows_fall_back_to_scalar_words():
    ops = ptx_memory_ops(vec=1, word_type="*i16", row_words=5)
    assert "st.global.b16" in ops and not any(".v" in op for op in ops)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("name", CONFIG_NAMES)
def test_real_geometries_take_the_vector_path(name, layout):
    """Every fixture model's chunks, in every host layout, meet the 16-byte alignment (bf16 and fp8)."""
    for dtype in ("bfloat16", "float8_e4m3fn"):
        g = KVGeometry.from_hf_config(load_config(name), page_size=64, dtype=dtype)
        dev, host = DeviceKVPool(g, 2), HostKVPool(g, 2, layout)
        for b, buffer in enumerate(g.buffers):
            ds, hs = dev.layout.strides[b], host.layout.strides[b]
            whole = ds.chunk_contiguous and hs.chunk_contiguous
            width = g.chunk_bytes(buffer) if whole else buffer.row_bytes
            offsets = [s.offset(0, layer) for s in (ds, hs) for layer in range(g.layer_num)]
            strides = (ds.page_stride, hs.page_stride, ds.token_stride, hs.token_stride)
            assert word_and_vec(width, *strides, *offsets, 4096) == (4, 4), (name, layout, dtype, buffer)


def test_word_and_vec_picks_the_widest_fit():
    assert word_and_vec(32, 48, 16) == (4, 4)
    assert word_and_vec(24, 8) == (8, 1)
    assert word_and_vec(12, 4) == (4, 1)
    assert word_and_vec(6, 2) == (2, 1)
    assert word_and_vec(3, 16) == (1, 1)
