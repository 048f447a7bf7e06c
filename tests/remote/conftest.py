"""Loopback object servers for the remote-input tests: an HTTP server with Range support and moto's S3 server,
both counting body bytes at the server side and injecting faults (batchjob.synthetic.{http_server,s3_server}).

Clips are drawn fresh per session from a seed (BATCHJOB_TEST_SEED reproduces a run). The S3 server is reached
the way a user's job reaches S3: through the AWS SDK's environment variables (endpoint, dummy credentials).
"""
from __future__ import annotations

import os
import random
from pathlib import Path

import pytest

from batchjob.synthetic.clips import make_clip

SEED = int(os.environ.get("BATCHJOB_TEST_SEED", random.randrange(2**31)))
BUCKET = "clips"


@pytest.fixture(scope="session")
def seed() -> int:
    print(f"remote test seed: {SEED} (set BATCHJOB_TEST_SEED to reproduce)")
    return SEED


@pytest.fixture(scope="session")
def clip_dir(tmp_path_factory, seed) -> Path:
    """An MP4 with its moov at the end (as PyAV writes it), one with the moov first, a Matroska clip, and a
    long-GOP MP4 with a camera's bitrate (its keyframes are a small part of the file). Sizes and lengths vary
    with the seed."""
    rng = random.Random(seed)
    root = tmp_path_factory.mktemp("remote-clips")
    w = rng.choice([160, 192, 224])
    make_clip(root / "moov_end.mp4", seconds=rng.uniform(3, 6), fps=24, width=w, height=w * 3 // 4 // 2 * 2,
              gop_seconds=rng.choice([0.5, 1.0]), bframes=2, seed=rng.randrange(100))
    make_clip(root / "faststart.mp4", seconds=rng.uniform(3, 6), fps=24, width=w, height=w * 3 // 4 // 2 * 2,
              gop_seconds=1.0, bframes=2, faststart=True, seed=rng.randrange(100))
    make_clip(root / "cues.mkv", container="mkv", seconds=rng.uniform(2, 4), fps=24, width=160, height=120,
              gop_seconds=0.5, bframes=2, seed=rng.randrange(100))
    # a camera-like bitrate (sensor noise), 10 s GOPs: what the keyframe loader's byte target is about
    make_clip(root / "long_gop.mp4", seconds=60, fps=30, width=320, height=180, gop_seconds=10, bframes=2,
              pattern="noisy", seed=rng.randrange(100))
    (root / "empty.mp4").write_bytes(b"")
    (root / "not_video.mp4").write_bytes(bytes(rng.randrange(256) for _ in range(5000)))
    return root


@pytest.fixture(scope="session")
def http(clip_dir):
    from batchjob.synthetic.http_server import RangeHTTPServer

    with RangeHTTPServer(clip_dir) as server:
        yield server


@pytest.fixture(scope="session")
def s3_session(clip_dir):
    """moto's S3 with every clip of `clip_dir` under s3://clips/data/; the AWS variables point the SDK at it."""
    pytest.importorskip("moto", reason="the S3 tests need moto[server] (pip install 'batchjob[test]')")
    from batchjob.synthetic.s3_server import S3Server

    with S3Server() as server:
        saved = {k: os.environ.get(k) for k in server.environment()}
        os.environ.update(server.environment())
        import boto3

        client = boto3.client("s3", endpoint_url=server.endpoint)
        client.create_bucket(Bucket=BUCKET)
        for clip in clip_dir.iterdir():
            client.upload_file(str(clip), BUCKET, f"data/{clip.name}")
        server.log.reset()
        try:
            yield server
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v


@pytest.fixture
def s3(s3_session):
    """The session's S3 server with its counts and faults cleared for this test."""
    from batchjob.synthetic.faults import FaultInjector

    s3_session.log.reset()
    s3_session.faults.__init__(stall_s=FaultInjector().stall_s)
    yield s3_session
    s3_session.faults.__init__()


@pytest.fixture
def served(http):
    """The session's HTTP server with its counts and faults cleared for this test."""
    http.log.reset()
    http.faults.__init__()
    yield http
    http.faults.__init__()


@pytest.fixture(params=["http", "s3"])
def store(request):
    """One of the two servers as (base URL, server path of a clip name, server)."""
    if request.param == "http":
        server = request.getfixturevalue("served")
        return server.url, (lambda name: f"/{name}"), server
    server = request.getfixturevalue("s3")
    return f"s3://{BUCKET}/data", (lambda name: f"/{BUCKET}/data/{name}"), server
