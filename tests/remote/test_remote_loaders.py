"""Loaders reading clips by URL from real servers on loopback (HTTP with Range, moto's S3): the frames equal the
local file's, the bytes counted at the server equal what the loader reports, the keyframe loader fetches a small
part of a long clip, and OpenCV's copy is downloaded once."""
from __future__ import annotations

import time

import numpy as np
import pytest

from batchjob.loaders import RemoteOptions, load_video
from batchjob.loaders.download_cache import download_cache

LOADERS = ["pyav_keyframes", "pyav_adaptive", "opencv"]
CLIPS = ["moov_end.mp4", "faststart.mp4", "cues.mkv"]


@pytest.mark.parametrize("backend", LOADERS)
@pytest.mark.parametrize("name", CLIPS)
def test_frames_and_bytes_match(store, clip_dir, backend, name, seed):
    base, server_path, server = store
    num_frames = 3 + seed % 6
    local_frames, local_meta = load_video(str(clip_dir / name), backend=backend, num_frames=num_frames)
    download_cache(1 << 30).close()      # opencv: a fresh download, so the server counts the whole clip
    frames, meta = load_video(f"{base}/{name}", backend=backend, num_frames=num_frames)
    assert np.array_equal(frames, local_frames)
    assert meta["frames_indices"] == local_meta["frames_indices"]
    size = (clip_dir / name).stat().st_size
    assert meta["object_bytes"] == size and meta["fetch_retries"] == 0
    assert meta["fetched_bytes"] == server.log.bytes_sent[server_path(name)], "client and server disagree on bytes"
    assert meta["fetch_requests"] == server.log.requests[server_path(name)]
    if backend == "opencv":
        assert meta["fetched_bytes"] == size       # the whole file, once


def test_keyframe_loader_fetches_a_small_part_of_a_long_clip(store, clip_dir):
    """60 s, a keyframe every 10 s, moov at the end: the index, 6 keyframes and their read-ahead only, within
    the issue's 5% (stated for a 600 s clip, where the share is smaller still: scripts/bench_remote.py)."""
    base, server_path, server = store
    name = "long_gop.mp4"
    size = (clip_dir / name).stat().st_size
    frames, meta = load_video(f"{base}/{name}", backend="pyav_keyframes", num_frames=16)
    local, _ = load_video(str(clip_dir / name), backend="pyav_keyframes", num_frames=16)
    assert np.array_equal(frames, local)
    sent = server.log.bytes_sent[server_path(name)]
    assert sent == meta["fetched_bytes"] and sent <= 0.05 * size, f"{sent} of {size} bytes"


def test_opencv_downloads_once_into_a_bounded_cache(store, clip_dir):
    base, server_path, server = store
    cache = download_cache(1 << 30)
    cache.close()
    names = ["moov_end.mp4", "faststart.mp4"]
    for name in names + names:
        load_video(f"{base}/{name}", backend="opencv", num_frames=4)
    for name in names:
        size = (clip_dir / name).stat().st_size
        head = min(64 * 1024, size) if base.startswith("http") else 0   # opening over HTTP reads the first block
        assert server.log.bytes_sent[server_path(name)] == size + head, "the second load reused the copy"
    # bounded: with room for one clip only, the older copy goes; a clip larger than the bound is refused
    room = RemoteOptions(download_cache_bytes=max((clip_dir / n).stat().st_size for n in names) + 1)
    cache.close()
    for name in names:
        load_video(f"{base}/{name}", backend="opencv", num_frames=4, remote=room)
        assert len(list(download_cache(room.download_cache_bytes).folder.glob("*.video"))) == 1
    with pytest.raises(Exception, match="more than the download cache holds"):
        load_video(f"{base}/{names[0]}", backend="opencv", num_frames=4,
                   remote=RemoteOptions(download_cache_bytes=1000))


def test_reads_through_range_file_match_the_bytes(served, clip_dir, seed):
    """Random seeks and reads through the read-ahead cache return exactly the file's bytes; no fetch exceeds the
    read-ahead bound and the cache stays within its size."""
    import random

    from batchjob.loaders.range_file import RangeFile
    from batchjob.loaders.transport import RemoteObject

    data = (clip_dir / "long_gop.mp4").read_bytes()
    opts = RemoteOptions(read_ahead_bytes=4096, max_read_ahead_bytes=65536, cache_bytes=200_000)
    obj = RemoteObject(f"{served.url}/long_gop.mp4", opts)
    fetches = []
    real_fetch = obj.fetch
    obj.fetch = lambda a, b: fetches.append((a, b)) or real_fetch(a, b)
    f = RangeFile(obj)
    rng = random.Random(seed)
    for _ in range(300):
        if rng.random() < 0.3:
            f.seek(rng.randrange(len(data) + 10))
        n = rng.choice([1, 100, 4096, 32768, 100_000])
        pos = f.tell()
        assert f.read(n) == data[pos:pos + n]
        assert f._cached <= opts.cache_bytes
    assert all(b - a <= max(opts.max_read_ahead_bytes, 100_000) for a, b in fetches)
    assert f.seek(0, 2) == len(data) and f.read(10) == b""


def test_opencv_copy_folders_of_dead_processes_are_removed(tmp_path):
    import subprocess
    import sys

    from batchjob.loaders.download_cache import PREFIX, DownloadCache

    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    orphan = tmp_path / f"{PREFIX}{int(dead.stdout)}"
    orphan.mkdir()
    (orphan / "x.video").write_bytes(b"1234")
    cache = DownloadCache(10_000, tmp_path)
    assert not orphan.exists() and cache.folder.exists()
    cache.close()
    assert not cache.folder.exists()


def test_server_without_range_support_is_refused_clearly(clip_dir):
    from batchjob.loaders import RemoteReadError
    from batchjob.synthetic.http_server import RangeHTTPServer

    with RangeHTTPServer(clip_dir, ignore_range=True) as server:
        t0 = time.monotonic()
        with pytest.raises(RemoteReadError, match="no Range support") as err:
            load_video(f"{server.url}/moov_end.mp4", num_frames=4)
        assert server.url in str(err.value) and time.monotonic() - t0 < 5
        assert server.log.requests["/moov_end.mp4"] == 1, "not retried: the server cannot do better"


def test_file_urls_are_local_paths(clip_dir):
    frames, meta = load_video((clip_dir / "moov_end.mp4").as_uri(), num_frames=4)
    local, _ = load_video(str(clip_dir / "moov_end.mp4"), num_frames=4)
    assert np.array_equal(frames, local) and "fetched_bytes" not in meta


# not_video.mp4 is 5,000 fresh random bytes: FFmpeg knows no container in most draws ("cannot read it as media"),
# but about 0.4% probe as a subtitle stream ("no video stream") or a stream that fails to decode ("damaged")
@pytest.mark.parametrize("name, error", [("missing.mp4", "no such object"), ("empty.mp4", "empty|no bytes|damaged"),
                                         ("not_video.mp4", "as media|no video stream|damaged")])
def test_bad_remote_clips_fail_with_the_url(store, name, error):
    from batchjob.loaders import LoaderError

    base, _, _ = store
    with pytest.raises(LoaderError, match=error) as err:
        load_video(f"{base}/{name}", num_frames=4)
    assert str(err.value).startswith(f"{base}/{name}")
