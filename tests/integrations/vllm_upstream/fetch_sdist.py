"""Download one sdist from PyPI's simple index (PEP 503), checked against a pinned SHA-256.

    python fetch_sdist.py vllm 0.33.0 SHA256 DEST.tar.gz

`pip download --no-binary :all: vllm==0.33.0` fetches the same file, then prepares its
metadata, which runs vLLM's build (torch 2.14 with CUDA, cmake, ...) and fails here; only the
tests inside the archive are needed, so the archive is fetched as pip would find it
($PIP_INDEX_URL, default https://pypi.org/simple) and nothing is built. DEST is written only
once the hash matches, so an existing DEST is a complete download (make reuses it).
"""

from __future__ import annotations

import hashlib
import html.parser
import os
import sys
import tempfile
import urllib.parse
import urllib.request


class _Links(html.parser.HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.hrefs: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        href = dict(attrs).get("href")
        if tag == "a" and href:
            self.hrefs.append(href)


def sdist_url(name: str, version: str, index: str) -> str:
    """The URL of `name`-`version`.tar.gz on the index page of `name`. Raises LookupError."""
    page = f"{index.rstrip('/')}/{name}/"
    with urllib.request.urlopen(page, timeout=60) as r:
        links = _Links()
        links.feed(r.read().decode())
    filename = f"{name}-{version}.tar.gz"
    for href in links.hrefs:
        url = urllib.parse.urljoin(page, href)
        if urllib.parse.urlsplit(url).path.endswith("/" + filename):
            return url.split("#")[0]
    raise LookupError(f"{filename} is not on {page}")


def fetch(name: str, version: str, sha256: str, dest: str) -> None:
    """Download the sdist to `dest`. Raises ValueError on a hash mismatch."""
    url = sdist_url(name, version, os.environ.get("PIP_INDEX_URL", "https://pypi.org/simple"))
    folder = os.path.dirname(os.path.abspath(dest))
    os.makedirs(folder, exist_ok=True)
    digest = hashlib.sha256()
    with tempfile.NamedTemporaryFile(dir=folder, suffix=".part", delete=False) as out:
        try:
            with urllib.request.urlopen(url, timeout=300) as r:
                while chunk := r.read(1 << 20):
                    digest.update(chunk)
                    out.write(chunk)
            if digest.hexdigest() != sha256:
                raise ValueError(f"{url}: sha256 {digest.hexdigest()}, expected {sha256}")
        except BaseException:
            os.unlink(out.name)
            raise
    os.replace(out.name, dest)
    print(f"fetched {url} -> {dest}")


if __name__ == "__main__":
    if len(sys.argv) != 5:
        sys.exit(f"usage: {sys.argv[0]} NAME VERSION SHA256 DEST")
    fetch(*sys.argv[1:])
