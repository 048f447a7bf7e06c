"""Jobs whose clips live in object storage (moto's S3 on loopback, started here): `batchjob validate` checks the
location before any work, and a 1,000-clip job with 5% of its requests faulted ends with every row exactly once,
resumes, keeps its fingerprint, and writes no credential anywhere.

The engine is the deterministic test engine (`conftest:DeterministicEngine`, through the pluggable engine
contract): the tiny MLX model would spend minutes of this 2-core machine on answers this test does not check.
"""
from __future__ import annotations

import json
import random
import re
import socket
from pathlib import Path

import pytest

moto = pytest.importorskip("moto", reason="needs moto[server] (pip install 'batchjob[test]')")

from batchjob.synthetic.s3_server import S3Server  # noqa: E402

BUCKET = "nightly"


@pytest.fixture(scope="module")
def s3(tmp_path_factory, seed):
    """S3 with a small synthetic dataset under s3://nightly/small/ and its manifest beside the test."""
    from batchjob.demo import build_synthetic_dataset

    root = tmp_path_factory.mktemp("remote-small")
    manifest, clips = build_synthetic_dataset(root, num_clips=6, seconds=(0.8, 2.0), seed=seed)
    with S3Server() as server:
        secret = f"secret-{random.Random(seed).randrange(10**9)}"
        env = {**server.environment(), "AWS_SECRET_ACCESS_KEY": secret}
        import boto3

        client = boto3.client("s3", endpoint_url=server.endpoint, aws_access_key_id="testing",
                              aws_secret_access_key=secret, region_name="us-east-1")
        client.create_bucket(Bucket=BUCKET)
        for clip in (root / "clips").iterdir():
            client.upload_file(str(clip), BUCKET, f"small/{clip.name}")
        yield server, client, env, manifest, clips


def validate(h, tmp_path, manifest, video_root, env, **runtime):
    cfg = h.write_config(tmp_path / "job.yaml", manifest, dataset={"video_root": video_root},
                         runtime=runtime or {})
    return h.run_cli("validate", str(cfg), env=h.cli_env(**env), timeout=60)


def test_validate_reaches_the_location_or_names_what_is_wrong(tmp_path, h, s3):
    server, _, env, manifest, _ = s3
    ok = validate(h, tmp_path, manifest, f"s3://{BUCKET}/small", env)
    assert ok.returncode == 0, ok.stderr
    wrong = validate(h, tmp_path, manifest, "s3://no-such-bucket/small", env)
    assert wrong.returncode == 2 and "s3://no-such-bucket/small" in wrong.stderr and "no such bucket" in wrong.stderr
    server.faults.always(f"/{BUCKET}", "denied")
    try:
        denied = validate(h, tmp_path, manifest, f"s3://{BUCKET}/small", env)
    finally:
        server.faults.__init__()
    assert denied.returncode == 2 and "access denied" in denied.stderr and "s3:GetObject" in denied.stderr
    assert f"s3://{BUCKET}/small" in denied.stderr, denied.stderr
    anonymous = {k: v for k, v in env.items() if not k.startswith("AWS_") or k == "AWS_ENDPOINT_URL"}
    no_keys = dict(anonymous, AWS_EC2_METADATA_DISABLED="true", AWS_SHARED_CREDENTIALS_FILE="/nonexistent",
                   AWS_CONFIG_FILE="/nonexistent", AWS_ACCESS_KEY_ID="", AWS_SECRET_ACCESS_KEY="")
    nocred = validate(h, tmp_path, manifest, f"s3://{BUCKET}/small", no_keys)
    assert nocred.returncode == 2 and "credentials" in nocred.stderr, nocred.stderr
    with socket.socket() as s:          # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    closed = validate(h, tmp_path, manifest, f"http://127.0.0.1:{port}/clips", env,
                      remote={"attempts": 2, "request_timeout_s": 2})
    assert closed.returncode == 2 and f"http://127.0.0.1:{port}/clips" in closed.stderr, closed.stderr
    secret = validate(h, tmp_path, manifest, "https://user:hunter2@example.invalid/clips", env)
    assert secret.returncode == 2 and "password" in secret.stderr and "hunter2" not in secret.stderr


def test_validate_makes_no_request_for_local_clips(tmp_path, h, s3):
    server, _, env, manifest, _ = s3
    server.log.reset()
    res = validate(h, tmp_path, manifest, str(manifest.parent / "clips"), env)
    assert res.returncode == 0 and not server.log.requests


@pytest.mark.ray
@pytest.mark.slow
def test_thousand_remote_clips_with_faults_every_row_once(tmp_path, h, s3, seed, isolated_network):
    server, client, env, small_manifest, clips = s3
    records = h.manifest_records(small_manifest)
    by_clip = {}
    for r in records:
        by_clip.setdefault(r["video"], r)
    names = sorted(by_clip)
    rows = []
    for i in range(1000):                          # 1,000 objects, each its own clip to the job
        src = names[i % len(names)]
        key = f"big/clip{i:04d}.mp4"
        client.upload_file(str(small_manifest.parent / "clips" / src), BUCKET, key)
        rows.append({**by_clip[src], "id": f"r{i:04d}", "video": f"clip{i:04d}.mp4"})
    manifest = tmp_path / "manifest.jsonl"
    manifest.write_text("".join(json.dumps(r) + "\n" for r in rows))
    server.log.reset()
    server.faults.__init__(rate=0.05, seed=seed, stall_s=1.5)
    runtime = {"decode_timeout_s": 30, "max_error_fraction": 0.05,
               "remote": {"attempts": 4, "request_timeout_s": 0.5}}
    cfg = h.write_config(tmp_path / "job.yaml", manifest, dataset={"video_root": f"s3://{BUCKET}/big"},
                         runtime=runtime)
    run_env = h.cli_env(**env)
    try:
        first = h.run_cli("run", str(cfg), "--limit", "300", env=run_env, timeout=600)
        assert first.returncode == 0, first.stderr[-3000:]
        full = h.run_cli("run", str(cfg), "--stats-json", str(tmp_path / "stats.json"), env=run_env, timeout=900)
    finally:
        faults = dict(server.log.total_faults())
        server.faults.__init__()
    assert full.returncode == 0, full.stderr[-3000:]
    assert "fetched per clip" in full.stdout and "MB median" in full.stdout, full.stdout   # the run summary
    out = h.read_rows(tmp_path / "out")
    assert sorted(r["row_id"] for r in out) == sorted(r["id"] for r in rows), "every row exactly once"
    assert sum(faults.values()) >= 50, faults    # 5% of about 2,000 requests (an opening and a read per clip)
    stats = json.loads((tmp_path / "stats.json").read_text())
    assert stats["skipped_rows"] == 300 and stats["done_rows"] == 700
    fetched = stats["fetched"]["pyav_keyframes"]
    assert fetched["clips"] == 700 - stats["error_rows"] and fetched["retries"] > 0 and fetched["mb_per_clip"] > 0
    for row in out:
        if row["error"]:   # only when a fault outlasted the retries: it names the URL and the cause
            assert f"s3://{BUCKET}/big/{row['video'].rsplit('/', 1)[-1]}" in row["error"], row["error"]
            assert re.search(r"attempt|budget|timed out", row["error"]), row["error"]
        else:
            assert row["pred_index"] == h.expected_choice(row["row_id"], len(row["options"]))
    assert sum(1 for r in out if r["error"]) <= 10
    print(f"1,000 remote clips, faults injected {faults}: {len(out)} rows once, "
          f"{sum(1 for r in out if r['error'])} error rows; second run: {stats['done_rows']} rows in "
          f"{stats['wall_s']:.1f} s, {fetched['retries']} retried requests, {fetched['mb_per_clip'] * 1000:.1f} kB "
          f"fetched per clip (median)")
    # resume: nothing left to do, nothing written twice
    again = h.run_cli("run", str(cfg), env=run_env, timeout=300)
    assert again.returncode == 0 and len(h.read_rows(tmp_path / "out")) == 1000
    # the fingerprint ignores where the clips live; no credential reaches the output
    from batchjob.config import load_config

    local = h.write_config(tmp_path / "local.yaml", manifest, dataset={"video_root": str(tmp_path)}, runtime=runtime)
    assert load_config(local).fingerprint() == load_config(cfg).fingerprint()
    secret = env["AWS_SECRET_ACCESS_KEY"]
    for path in Path(tmp_path / "out").rglob("*"):
        if path.is_file():
            assert secret.encode() not in path.read_bytes(), path
    assert secret not in (tmp_path / "stats.json").read_text()
