"""The behaviour every storage tier shares (tests/storage/test_storage_tiers.py), on the
Mooncake tier: the same test functions, with `make` building Mooncake tiers."""

from collections.abc import Iterator

import pytest
from storage.test_storage_tiers import (  # noqa: F401 - collected here, with this module's `make`
    test_a_batch_of_large_pages_is_checked_whole_then_stored,
    test_a_page_given_as_pieces_is_stored_as_their_concatenation,
    test_batch_read_into_fills_the_pieces_in_order_and_stops_at_a_miss,
    test_geometry_model_namespace_isolation,
    test_set_get_exists_delete,
)

from hicache.storage import StorageTier, TierIdentity, make_tier


@pytest.fixture
def make(master) -> Iterator:
    tiers: list[StorageTier] = []

    def build(ident: TierIdentity) -> StorageTier:
        tier = make_tier("mooncake", master.extra_config(), ident)
        tiers.append(tier)
        return tier

    yield build
    for tier in tiers:
        tier.close()
