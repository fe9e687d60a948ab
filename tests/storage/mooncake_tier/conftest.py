"""The Mooncake tier's tests: a real mooncake_master and real Mooncake clients, all in a
network namespace of this test process that has only loopback (Mooncake's clients listen
on ports of their own). `make test` runs this folder in a pytest process of its own; a
missing mooncake package or master fails these tests, never skips them."""

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from hicache.demo.mooncake_local import LocalMooncakeMaster, enter_loopback_namespace, only_loopback
from hicache.storage import TierIdentity
from hicache.storage.mooncake import MooncakeTier
from hicache.storage.mooncake_link import close_links

MakeTier = Callable[..., MooncakeTier]


@pytest.fixture(scope="session", autouse=True)
def loopback_namespace() -> None:
    enter_loopback_namespace()
    assert only_loopback()


@pytest.fixture
def master(tmp_path: Path) -> Iterator[LocalMooncakeMaster]:
    """A master of this test's own (nothing stored by another test), which it may stop and restart."""
    with LocalMooncakeMaster(tmp_path) as m:
        yield m
        close_links(m.address)  # while the master is up: its tiers' client closes cleanly


@pytest.fixture
def mooncake(master: LocalMooncakeMaster) -> Iterator[MakeTier]:
    """Builds tiers on this test's master (extra options as keywords), closed afterwards."""
    built: list[MooncakeTier] = []

    def build(ident: TierIdentity, **options: object) -> MooncakeTier:
        tier = MooncakeTier(ident, master.extra_config(**options))
        built.append(tier)
        return tier

    yield build
    for tier in built:
        tier.close()
