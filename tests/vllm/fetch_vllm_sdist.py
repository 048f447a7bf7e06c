"""Download vLLM's source package (its tests are not in the wheel) from the package index, hash-checked.

`pip download --no-binary :all: vllm` would build the package's metadata first, which needs vLLM's whole
build toolchain (CUDA torch, setuptools-rust, cmake); this reads the index's simple API the way pip does
and checks the file against the sha256 the index publishes. Usage: fetch_vllm_sdist.py VERSION DEST
"""

from __future__ import annotations

import hashlib
import os
import re
import sys
import urllib.parse
import urllib.request


def main(version: str, dest: str) -> None:
    index = os.environ.get("PIP_INDEX_URL", "https://pypi.org/simple").rstrip("/")
    page_url = f"{index}/vllm/"
    with urllib.request.urlopen(page_url, timeout=60) as response:
        page = response.read().decode()
    name = re.escape(f"vllm-{version}.tar.gz")
    match = re.search(rf'href="([^"#]*/{name})#sha256=([0-9a-f]{{64}})"', page)
    if match is None:
        sys.exit(f"fetch_vllm_sdist: {page_url} lists no vllm-{version}.tar.gz with a sha256")
    url, sha256 = urllib.parse.urljoin(page_url, match.group(1)), match.group(2)
    with urllib.request.urlopen(url, timeout=600) as response:
        data = response.read()
    if hashlib.sha256(data).hexdigest() != sha256:
        sys.exit(f"fetch_vllm_sdist: {url} does not match the index's sha256 {sha256}")
    os.makedirs(os.path.dirname(os.path.abspath(dest)), exist_ok=True)
    with open(dest + ".part", "wb") as f:
        f.write(data)
    os.replace(dest + ".part", dest)


if __name__ == "__main__":
    main(*sys.argv[1:3])
