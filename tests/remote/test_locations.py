"""URLs versus paths in configs and manifests: joining, credentials refused, nothing secret echoed; failures
classified for retrying; the fetch statistics of a run."""
from __future__ import annotations

import asyncio
import errno
import json

import pytest

from batchjob.config import ConfigError, DatasetConfig, parse_config
from batchjob.datasets import DatasetError, load_rows
from batchjob.location import credentials_in, is_remote, is_url, join, local_path, redact, scheme
from batchjob.loaders.transport import classify
from batchjob.pipeline.stats import fetch_summary


@pytest.mark.parametrize("root, name, joined", [
    ("s3://bucket/clips", "a.mp4", "s3://bucket/clips/a.mp4"),
    ("s3://bucket/clips/", "sub/a.mp4", "s3://bucket/clips/sub/a.mp4"),
    ("https://host/x", "gs://other/b.mp4", "gs://other/b.mp4"),
    ("/data", "https://host/c.mp4", "https://host/c.mp4"),
    ("/data", "d.mp4", "/data/d.mp4"),
    ("/data", "/abs/e.mp4", "/abs/e.mp4"),
])
def test_join(root, name, joined):
    assert join(root, name) == joined


def test_urls_and_paths():
    assert scheme("S3://b/k") == "s3" and scheme("C:\\clips\\a.mp4") is None and scheme("/a/b") is None
    assert is_url("file:///a") and not is_remote("file:///a") and is_remote("az://c/k")
    assert local_path("file:///data/a%20b.mp4") == "/data/a b.mp4"
    assert redact("https://u:p@host:8/a.mp4?X-Amz-Signature=s#f") == "https://host:8/a.mp4"
    assert credentials_in("https://host/a.mp4?X-Amz-Signature=abc&x=1")
    assert credentials_in("https://u:pw@host/a.mp4") and not credentials_in("https://host/a.mp4?v=2")
    assert credentials_in("https://acct.blob.core.windows.net/c/a.mp4?sv=1&sig=zz")


def _config(tmp_path, video_root):
    raw = {"job": "j", "dataset": {"adapter": "manifest", "annotation": "m.jsonl", "video_root": video_root},
           "model": {"checkpoint": "ckpt"}, "output": {"directory": "out"}}
    return parse_config(raw, tmp_path / "job.yaml")


def test_config_keeps_urls_and_refuses_secrets(tmp_path):
    assert _config(tmp_path, "s3://b/p").dataset.video_root == "s3://b/p"
    assert _config(tmp_path, "file:///srv/clips").dataset.video_root == "/srv/clips"
    assert _config(tmp_path, "clips").dataset.video_root == str((tmp_path / "clips").resolve())
    for bad, why in [("https://u:topsecret@h/c", "password"), ("https://h/c?X-Amz-Signature=topsecret", "credentials"),
                     ("ftp://h/c", "unsupported URL scheme")]:
        with pytest.raises(ConfigError, match=why) as err:
            _config(tmp_path, bad)
        assert "topsecret" not in str(err.value)


def test_manifest_rows_under_a_url_root(tmp_path):
    manifest = tmp_path / "m.jsonl"
    recs = [{"id": "a", "video": "x/1.mp4", "question": "q", "options": ["a", "b"]},
            {"id": "b", "video": "https://cdn.example/2.mp4", "question": "q", "options": ["a", "b"]},
            {"id": "c", "video": "file:///srv/3.mp4", "question": "q", "options": ["a", "b"]}]
    manifest.write_text("".join(json.dumps(r) + "\n" for r in recs))
    rows = load_rows(DatasetConfig(adapter="manifest", annotation=str(manifest), video_root="gs://bkt/root"))
    assert [r.video for r in rows] == ["gs://bkt/root/x/1.mp4", "https://cdn.example/2.mp4", "/srv/3.mp4"]
    manifest.write_text(json.dumps({**recs[0], "video": "https://h/a.mp4?sig=abc"}) + "\n")
    with pytest.raises(DatasetError, match="credentials"):
        load_rows(DatasetConfig(adapter="manifest", annotation=str(manifest)))


class _Status(Exception):
    def __init__(self, status):
        super().__init__(f"status {status}")
        self.status = status


class NoCredentialsError(Exception):
    pass


@pytest.mark.parametrize("err, kind", [
    (FileNotFoundError("x"), "missing"), (_Status(404), "missing"), (PermissionError("x"), "denied"),
    (_Status(403), "denied"), (NoCredentialsError("x"), "denied"), (_Status(503), "transient"),
    (_Status(429), "transient"), (_Status(400), "fatal"), (asyncio.TimeoutError(), "transient"),
    (OSError(errno.EREMOTEIO, "InternalError"), "transient"), (ConnectionResetError(), "transient"),
])
def test_failures_are_classified_for_retrying(err, kind):
    assert classify(err, 1.0).kind == kind


def test_fetch_summary():
    assert fetch_summary([]) is None
    s = fetch_summary([(2_000_000, 100_000_000, 1), (1_000_000, 50_000_000, 0), (3_000_000, 0, 2)])
    assert s["clips"] == 3 and s["mb_per_clip"] == 2.0 and s["total_mb"] == 6.0 and s["retries"] == 3
    assert s["file_fraction"] == pytest.approx(0.02)
