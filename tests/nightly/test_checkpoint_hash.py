"""The model's content hash: follows the bytes, not the path, and reuses cached digests of unchanged files."""
from __future__ import annotations

import hashlib
import json
import os

from batchjob.nightly.checkpoint_hash import checkpoint_hash


def test_hash_follows_content_and_uses_the_cache(tmp_path, rng):
    a, b = tmp_path / "a", tmp_path / "b"
    for d in (a, b):
        (d / "sub").mkdir(parents=True)
    files = {"config.json": b'{"x": 1}', "model.safetensors": rng.randbytes(3 << 20), "sub/t.json": b"{}"}
    for name, data in files.items():
        (a / name).write_bytes(data)
        (b / name).write_bytes(data)
    cache = tmp_path / "cache.json"
    h = checkpoint_hash(a, cache)
    assert h == checkpoint_hash(b) and len(h) == 16, "same bytes, another path: same hash"
    # independent reference: sha256 over (relative name, sha256 of the file) in name order
    ref = hashlib.sha256()
    for name in sorted(files):
        ref.update(f"{name}\0{hashlib.sha256(files[name]).hexdigest()}\n".encode())
    assert h == ref.hexdigest()[:16]
    weights = files["model.safetensors"]   # its last byte flipped (a drawn last byte may already be 0)
    (b / "model.safetensors").write_bytes(weights[:-1] + bytes([weights[-1] ^ 0xFF]))
    assert checkpoint_hash(b) != h, "one changed byte changes the hash"
    assert checkpoint_hash(tmp_path / "missing") is None

    # a cached digest is trusted while size and mtime match (no re-read); a rewrite is read again
    known = json.loads(cache.read_text())
    key = str((a / "model.safetensors").resolve())
    known[key][2] = "0" * 64
    cache.write_text(json.dumps(known))
    assert checkpoint_hash(a, cache) != h
    st = (a / "model.safetensors").stat()
    os.utime(a / "model.safetensors", ns=(st.st_atime_ns, st.st_mtime_ns + 1))
    assert checkpoint_hash(a, cache) == h
