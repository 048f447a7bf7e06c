"""A content hash of a model checkpoint, so history shows when "the same path" held a new build.

Reading tens of GB every night would cost minutes, so each file's digest is cached by (path, size,
mtime_ns) in a JSON file beside the history; a file rewritten in place gets a new mtime and is read again.
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

from batchjob.pipeline.output import atomic_write_bytes

CHUNK = 1 << 20


def _file_digest(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        while chunk := fh.read(CHUNK):
            h.update(chunk)
    return h.hexdigest()


def checkpoint_hash(checkpoint: str | Path, cache: Path | None = None) -> str | None:
    """sha256 over every file of a checkpoint directory (names and contents); None when it is not a directory."""
    root = Path(checkpoint)
    if not root.is_dir():
        return None
    known: dict[str, list] = {}
    if cache is not None and cache.is_file():
        try:
            known = json.loads(cache.read_text())
        except (OSError, ValueError):
            known = {}
    total = hashlib.sha256()
    changed = False
    for path in sorted(p for p in root.rglob("*") if p.is_file() and not p.name.startswith(".")):
        st = path.stat()
        key = str(path.resolve())
        hit = known.get(key)
        if hit and hit[0] == st.st_size and hit[1] == st.st_mtime_ns:
            digest = hit[2]
        else:
            digest = _file_digest(path)
            known[key] = [st.st_size, st.st_mtime_ns, digest]
            changed = True
        total.update(f"{path.relative_to(root).as_posix()}\0{digest}\n".encode())
    if cache is not None and changed:
        cache.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_bytes(cache, json.dumps(known).encode())
    return total.hexdigest()[:16]
