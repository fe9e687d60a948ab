"""Package discovery and the optional C extension; everything else is in pyproject.toml.

The folder server/ installs as the package `hicache_server` (a top-level module named
`server` in site-packages would be a bad neighbour), which pyproject's packages.find
cannot express.
"""

from setuptools import Extension, find_packages, setup

# The CPU transfer path's batched copy (hicache/transfer/native.py). optional: without a C
# compiler the install still succeeds and the engine falls back to torch copies.
native = Extension(
    "hicache.transfer._native",
    ["hicache/transfer/_native.c", "hicache/transfer/_native_plan.c", "hicache/transfer/_native_queue.c", "hicache/transfer/_native_crew.c"],
    depends=["hicache/transfer/_native.h"],
    extra_compile_args=["-O2"],
    optional=True,
)

# XXH3-64 of a stored page over its pieces without the GIL (hicache/storage/page_format.py);
# optional too: without it, python-xxhash computes the same value holding the GIL.
xxh3 = Extension("hicache.storage._xxh3", ["hicache/storage/_xxh3.c"], extra_compile_args=["-O3"], optional=True)

# The size of an open file without letting go of the GIL (hicache/memory/buffer.py: the damage
# check before every copy); optional: without it, os.fstat, which lets go of the GIL.
fdsize = Extension("hicache.memory._fdsize", ["hicache/memory/_fdsize.c"], extra_compile_args=["-O2"], optional=True)

setup(
    packages=[*find_packages(include=["hicache", "hicache.*"]), "hicache_server"],
    package_dir={"hicache_server": "server"},
    package_data={"hicache": ["py.typed"], "hicache.data": ["*.json"]},
    ext_modules=[native, xxh3, fdsize],
)
