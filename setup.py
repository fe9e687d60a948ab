"""Package discovery only; everything else is in pyproject.toml.

The folder server/ installs as the package `hicache_server` (a top-level module named
`server` in site-packages would be a bad neighbour), which pyproject's packages.find
cannot express.
"""

from setuptools import find_packages, setup

setup(
    packages=[*find_packages(include=["hicache", "hicache.*"]), "hicache_server"],
    package_dir={"hicache_server": "server"},
    package_data={"hicache.data": ["*.json"]},
)
