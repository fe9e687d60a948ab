import pytest
from tier_helpers import GEOMETRIES, GEOMETRY_NAMES, identity, key, payload

from hicache.geometry import KVGeometry
from hicache.storage import PageError
from hicache.storage import page_format as fmt


@pytest.mark.parametrize("name", GEOMETRY_NAMES)
@pytest.mark.parametrize("algorithm", [fmt.XXH3_64, fmt.CRC32])
def test_roundtrip_and_every_flipped_byte_region_is_corrupt(name, algorithm):
    g = GEOMETRIES[name]
    ident, data = identity(g), payload(g, 1)
    blob = fmt.encode_header(ident, key(1), data, algorithm) + data
    assert len(blob) == fmt.stored_size(ident, key(1))
    assert bytes(fmt.decode_page(ident, key(1), blob)) == data
    # one byte in each region: magic, version, algorithm, key length, fingerprint, model,
    # namespace, payload length, checksum, key, first and last payload byte
    for pos in (0, 4, 6, 7, 8, 16, 24, 32, 40, 48, 48 + 32, len(blob) - 1):
        bad = bytearray(blob)
        bad[pos] ^= 0x01
        with pytest.raises(PageError) as err:
            fmt.decode_page(ident, key(1), bytes(bad))
        assert err.value.reason == "corrupt", pos
    for cut in (0, 10, fmt.HEADER_BYTES, len(blob) - 1):
        with pytest.raises(PageError, match="corrupt"):
            fmt.decode_page(ident, key(1), blob[:cut])


def test_foreign_geometry_model_namespace_key():
    g = GEOMETRIES["mimo_kv"]
    data = payload(g, 2)
    blob = fmt.encode_page(identity(g), key(1), data)
    other_g = KVGeometry(**dict(g.to_dict(), layer_ids=[1, 2]))  # same size, other layers
    assert other_g.page_bytes == g.page_bytes and other_g.fingerprint != g.fingerprint
    others = [identity(g, namespace="tenant-b"), identity(g, model="test-model@rev2"), identity(other_g)]
    for other in others:
        with pytest.raises(PageError) as err:
            fmt.decode_page(other, key(1), blob)
        assert err.value.reason == "foreign"
    with pytest.raises(PageError, match="foreign page: key"):
        fmt.decode_page(identity(g), key(2), blob)


def test_caller_mistakes_raise_value_error():
    g = GEOMETRIES["deepseek_mla"]
    ident = identity(g)
    with pytest.raises(ValueError, match=f"must be {g.page_bytes} bytes"):
        fmt.encode_page(ident, key(1), b"123")
    with pytest.raises(ValueError, match="1..64 bytes"):
        fmt.encode_page(ident, b"", payload(g, 0))
    with pytest.raises(ValueError, match="1..64 bytes"):
        fmt.encode_page(ident, b"x" * 65, payload(g, 0))
    with pytest.raises(ValueError, match="model_id"):
        identity(g, model="")


def test_a_page_verified_in_pieces_is_checked_over_every_piece():
    g = GEOMETRIES["mimo_kv"]
    ident = identity(g)
    blob = bytearray(fmt.encode_page(ident, key(1), payload(g, 1)))
    head_len = fmt.HEADER_BYTES + len(key(1))
    head, body = memoryview(blob)[:head_len], memoryview(blob)[head_len:]
    pieces = [body[:10], body[10:10], body[10:5000], body[5000:]]
    fmt.verify_page(ident, key(1), head, pieces)
    blob[head_len + 4999] ^= 1  # a flipped byte inside the third piece
    with pytest.raises(fmt.PageError, match="checksum mismatch"):
        fmt.verify_page(ident, key(1), head, pieces)
    blob[head_len + 4999] ^= 1
    with pytest.raises(fmt.PageError, match="bytes, header says"):
        fmt.verify_page(ident, key(1), head, pieces[:-1])
    with pytest.raises(fmt.PageError, match="foreign page: key"):
        fmt.verify_page(ident, key(2), head, pieces)
    with pytest.raises(fmt.PageError, match="shorter than the 48-byte header"):
        fmt.verify_page(ident, key(1), head[:20], pieces)


@pytest.mark.parametrize("fused", [True, False], ids=["copy_xxh3", "python"])
def test_a_staged_page_is_the_stored_page_and_unstages_into_pieces(monkeypatch, fused):
    """stage_page writes exactly encode_page's bytes from a page's pieces, hashing as it
    copies (the C copy_xxh3) or not; unstage_page verifies while it copies into pieces, and
    refuses a damaged or foreign page as decode_page does."""
    if not fused:
        monkeypatch.setattr(fmt, "_copy_xxh3", None)
    elif fmt._copy_xxh3 is None:
        pytest.fail("the C extension hicache.storage._xxh3 is not built")
    g = GEOMETRIES["mimo_kv"]
    ident, data = identity(g), payload(g, 3)
    pieces = [memoryview(data)[a:b] for a, b in ((0, 7), (7, 1000), (1000, g.page_bytes))]
    staged = bytearray(fmt.stored_size(ident, key(3)))
    fmt.stage_page(ident, key(3), fmt.checked_parts(ident, key(3), pieces), memoryview(staged))
    assert bytes(staged) == fmt.encode_page(ident, key(3), data)
    out = bytearray(g.page_bytes + 5)
    into = [memoryview(out)[:100], memoryview(out)[105:]]  # a 5-byte gap the copy must skip
    fmt.unstage_page(ident, key(3), memoryview(staged), into)
    assert out[:100] + out[105:] == data and out[100:105] == bytes(5)
    damaged = bytearray(staged)
    damaged[-1] ^= 1
    with pytest.raises(PageError, match="corrupt"):
        fmt.unstage_page(ident, key(3), memoryview(damaged), into)
    with pytest.raises(PageError, match="foreign"):
        fmt.unstage_page(identity(g, "other"), key(3), memoryview(staged), into)
    with pytest.raises(ValueError, match=f"must be {g.page_bytes} bytes"):
        fmt.checked_parts(ident, key(3), pieces[:2])


def test_a_page_of_240_bytes_or_less_stages_and_unstages() -> None:
    """Below the C hash's 240-byte floor, stage_page takes python-xxhash's checksum."""
    g = KVGeometry(layer_num=1, head_num=1, head_dim=8, v_head_dim=8, page_size=1)
    ident, data = identity(g), payload(g, 5)
    assert fmt.stored_size(ident, key(5)) <= 240
    staged = bytearray(fmt.stored_size(ident, key(5)))
    fmt.stage_page(ident, key(5), fmt.checked_parts(ident, key(5), data), memoryview(staged))
    assert bytes(staged) == fmt.encode_page(ident, key(5), data)
    out = bytearray(g.page_bytes)
    fmt.unstage_page(ident, key(5), memoryview(staged), [memoryview(out)])
    assert out == data
