"""The committed hicache/rpc/generated/ is exactly what scripts/gen_proto.py generates from proto/,
and the service's values survive the trip through its messages."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_generated_code_is_up_to_date(tmp_path: Path) -> None:
    spec = importlib.util.spec_from_file_location("gen_proto", ROOT / "scripts" / "gen_proto.py")
    assert spec is not None and spec.loader is not None
    gen = importlib.util.module_from_spec(spec)
    sys.modules["gen_proto"] = gen
    spec.loader.exec_module(gen)
    written = gen.generate(tmp_path)
    committed = ROOT / "hicache" / "rpc" / "generated"
    assert sorted(p.name for p in written) == sorted(p.name for p in committed.glob("*.py*"))
    for path in written:
        assert path.read_text() == (committed / path.name).read_text(), (
            f"hicache/rpc/generated/{path.name} is stale: run python scripts/gen_proto.py"
        )


def test_every_geometry_field_is_on_the_wire() -> None:
    from hicache.geometry import KVGeometry
    from hicache.rpc.generated import hicache_pb2 as pb

    fields = set(pb.Geometry.DESCRIPTOR.fields_by_name)
    assert set(KVGeometry(layer_num=1, head_num=1, head_dim=8, v_head_dim=8).to_dict()) == fields


def test_geometry_and_memory_round_trip_through_messages() -> None:
    from hicache.geometry import KVGeometry
    from hicache.memory import MemoryHandle
    from hicache.rpc import convert

    mla = KVGeometry(attention="mla", layer_num=3, head_num=1, kv_lora_rank=512, qk_rope_head_dim=64, dtype="fp8")
    mha = KVGeometry(layer_num=2, head_num=4, head_dim=192, v_head_dim=128, page_size=16, layer_ids=(0, 5))
    for g in (mla, mha):
        assert convert.geometry_from_pb(convert.geometry_to_pb(g)) == g
    h = MemoryHandle("cuda_ipc", 4096, ipc_handle=b"\x01" * 64, offset=512)
    assert convert.memory_from_pb(convert.memory_to_pb(h, cuda_device=1)) == h


def test_stats_and_event_batches_round_trip_through_messages() -> None:
    from hicache.api import EventBatch, EventKind, EventPool, KVEvent, PoolStats, Tier, TierStats
    from hicache.rpc import convert

    stats = PoolStats(
        "pool-1", "full", "ns", "m@1", 8, 16, 3, 1, 4096,
        (TierStats(Tier.HOST, 3, 12288, 5, 1, 65536), TierStats(Tier.STORAGE, 0, 0, 2, 4, 0)),
        100, 1.5, 200, 2.5, 0, "redis", False, 7, "native", ("127.0.0.1:7001", "127.0.0.1:7004"),
    )  # fmt: skip
    assert convert.stats_from_pb(convert.stats_to_pb(stats)) == stats
    pool = EventPool("pool-1", "ns", "m@1", "swa", 1, 2)
    batch = EventBatch(
        5,
        (
            KVEvent(EventKind.POOL_REGISTERED, pool),
            KVEvent(EventKind.STORED, pool, Tier.HOST, (b"a", b"b")),
            KVEvent(EventKind.REMOVED, pool, Tier.STORAGE, (b"c",)),
            KVEvent(EventKind.POOL_UNREGISTERED, pool),
        ),
        3,
        1796353200.5,
    )
    msg = convert.event_batch_to_pb(batch)
    assert msg.events[0].tier == 0  # pool events name no tier on the wire
    assert convert.event_batch_from_pb(msg) == batch
    msg.events.add(kind=99)  # a kind of a newer sidecar is skipped, not guessed
    assert convert.event_batch_from_pb(msg) == batch


def test_unknown_enum_values_read_as_a_miss() -> None:
    from hicache.api import KeyStatus, Tier
    from hicache.rpc import convert
    from hicache.rpc.generated import hicache_pb2 as pb

    # a newer sidecar's value (99) or UNSPECIFIED (0) must not lose a successful call's answer
    loaded = pb.KEY_STATUS_LOADED
    assert convert.statuses_from_pb([loaded, 99, 0]) == (KeyStatus.LOADED, KeyStatus.NOT_FOUND, KeyStatus.NOT_FOUND)
    assert convert.UNKNOWN_STATUS is KeyStatus.NOT_FOUND
    assert convert.tier_from_pb(4) is Tier.NONE and convert.tier_from_pb(0) is Tier.NONE
    lookup = convert.lookup_from_pb(pb.LookupResponse(prefix_length=1, tiers=[pb.TIER_HOST, 4]))
    assert lookup.tiers == (Tier.HOST, Tier.NONE)
    for status in KeyStatus:  # every known value still round-trips
        assert convert.statuses_from_pb(convert.statuses_to_pb([status])) == (status,)
    for tier in Tier:
        assert convert.tier_from_pb(convert.tier_to_pb(tier)) is tier
