"""proto/README.md states the wire contract for clients in other languages; its key test
vectors and metadata names are the ones the code uses."""

from __future__ import annotations

import re
from pathlib import Path

from hicache.api import ADMIN_TOKEN, POOL_SECRET
from hicache.keys import page_keys

CONTRACT = (Path(__file__).resolve().parents[2] / "proto" / "README.md").read_text()


def test_the_key_test_vectors_are_what_page_keys_computes() -> None:
    rows = re.findall(r'^\| `"([^"]*)"` \| `([0-9a-f]{64})` \| `([0-9a-f]{64})` \|$', CONTRACT, re.M)
    assert len(rows) == 2, rows
    for namespace, first, second in rows:
        keys = page_keys([1, 2, 3, 4, 5, 6, 7, 8], 4, namespace)
        assert [k.hex() for k in keys] == [first, second], namespace
        assert page_keys([5, 6, 7, 8], 4, namespace, parent=keys[0]) == keys[1:]  # a continuation


def test_the_metadata_names_are_the_ones_client_and_server_share() -> None:
    for name in (POOL_SECRET, ADMIN_TOKEN, "authorization"):
        assert f"| `{name}` |" in CONTRACT


def test_every_rpc_has_its_own_messages_and_every_field_and_enum_value_is_documented() -> None:
    proto = (Path(__file__).resolve().parents[2] / "proto" / "hicache" / "v1" / "hicache.proto").read_text()
    lines = proto.splitlines()
    rpcs = re.findall(r"rpc (\w+)\((\w+)\) returns \((?:stream )?(\w+)\)", proto)
    assert len(rpcs) == 15
    for name, request, response in rpcs:
        assert request == f"{name}Request", name
        assert response in (f"{name}Response", "WatchEvent", "EventBatch"), name
    undocumented = []
    for i, line in enumerate(lines):
        field = re.match(r"\s+(?:repeated )?[\w.]+ \w+ = \d+;|\s+[A-Z_]+ = \d+;", line)
        if field and "//" not in line and not lines[i - 1].strip().startswith("//"):
            undocumented.append(line.strip())
    assert undocumented == []
    for i, line in enumerate(lines):  # enums start at an UNSPECIFIED zero, as buf's lint asks
        if re.match(r"\s*enum \w+ \{", line):
            assert re.match(r"\s+[A-Z_]+_UNSPECIFIED = 0;", lines[i + 1]), lines[i + 1]
    assert "package hicache.v1;" in proto  # a versioned package
    for i, line in enumerate(lines):  # every rpc is documented too
        if line.strip().startswith("rpc "):
            assert lines[i - 1].strip().startswith("//"), line
