"""House rules a reviewer would otherwise check by hand: every module stays small enough to
read in one sitting, and the package table in docs/architecture.md names only modules that
exist where it says."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MAX_LINES = 300  # split a module along a seam before it grows past this


def _modules() -> list[Path]:
    found = [*ROOT.joinpath("hicache").rglob("*.py"), *ROOT.joinpath("server").rglob("*.py")]
    return [p for p in found if "generated" not in p.parts]  # protoc's output is not ours to split


def test_every_module_is_at_most_300_lines() -> None:
    sizes = {str(p.relative_to(ROOT)): len(p.read_text().splitlines()) for p in _modules()}
    assert len(sizes) > 100, "the walk found the packages"
    assert {name: n for name, n in sizes.items() if n > MAX_LINES} == {}


def test_the_package_table_names_only_modules_that_exist_in_their_package() -> None:
    text = (ROOT / "docs" / "architecture.md").read_text()
    rows = [line for line in text.splitlines() if re.match(r"\| `(hicache|server)/", line)]
    assert len(rows) >= 10, "the package table is where docs/architecture.md had it"
    missing = []
    for row in rows:
        package = ROOT / re.match(r"\| `([^`]+)`", row).group(1)  # type: ignore[union-attr]
        if package.suffix == ".py":
            assert package.exists(), row
            continue
        for name in re.findall(r"`([a-z_0-9]+\.(?:py|c))`", row):
            where = package.glob(name) if package == ROOT / "hicache" else package.rglob(name)
            if not any(where):
                missing.append(f"{package.relative_to(ROOT)}/…/{name}")
    assert missing == []
