"""Every kind of bad input becomes a LoaderError naming the source and the reason, for every loader."""

from __future__ import annotations

import random
import signal

import av
import numpy as np
import pytest

from batchjob.loaders import (CorruptVideo, InvalidArgument, LoaderError, MissingTimestamps, UnsupportedMedia,
                              VideoNotFound, list_loaders, load_video)
from batchjob.synthetic.clips import make_clip

LOADERS = ["pyav_keyframes", "pyav_adaptive", "pyav_burst", "opencv"]


@pytest.fixture(autouse=True)
def no_hang():
    """A loader that hangs fails the test after 60 s instead of stalling the suite."""
    def expire(*_):
        raise TimeoutError("loader did not return within 60 s")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.alarm(60)
    yield
    signal.alarm(0)
    signal.signal(signal.SIGALRM, previous)


def _write(path, data: bytes) -> str:
    with open(path, "wb") as f:
        f.write(data)
    return str(path)


def _cut_in_half(src: str, dst) -> str:
    with open(src, "rb") as f:
        data = f.read()
    return _write(dst, data[: len(data) // 2])


def _corrupt_keyframes(src: str, dst) -> str:
    with av.open(src) as container:
        spans = [(p.pos, p.size) for p in container.demux(video=0) if p.size and p.is_keyframe][1:]
    data = bytearray(open(src, "rb").read())
    rng = np.random.default_rng(7)
    for pos, size in spans:
        data[pos + size // 4: pos + size] = rng.integers(0, 256, size - size // 4, dtype=np.uint8).tobytes()
    return _write(dst, bytes(data))


@pytest.fixture(scope="module")
def bad(tmp_path_factory):
    """name -> (path, expected LoaderError subclass). Built once per module."""
    d = tmp_path_factory.mktemp("bad")
    cases = {"missing": (str(d / "nope.mp4"), VideoNotFound),
             "directory": (str(d), VideoNotFound),
             "empty": (_write(d / "empty.mp4", b""), CorruptVideo),
             "text": (_write(d / "notes.txt", b"not a video\n" * 200), UnsupportedMedia),
             "text_as_mp4": (_write(d / "notes.mp4", b"not a video\n" * 200), UnsupportedMedia)}
    png = d / "still.png"
    av.VideoFrame.from_ndarray(np.zeros((48, 64, 3), np.uint8), format="rgb24").to_image().save(png)
    cases["image"] = (str(png), UnsupportedMedia)
    audio = str(d / "speech.m4a")
    with av.open(audio, "w") as out:
        stream = out.add_stream("aac", rate=16000)
        for i in range(8):
            frame = av.AudioFrame.from_ndarray(np.zeros((1, 1024), np.float32), format="fltp", layout="mono")
            frame.sample_rate, frame.pts = 16000, i * 1024
            out.mux(stream.encode(frame))
        out.mux(stream.encode(None))
    cases["audio_only"] = (audio, UnsupportedMedia)
    mp4 = make_clip(d / "ok.mp4", seconds=3, gop_seconds=0.5).path
    cases["truncated_mp4"] = (_cut_in_half(mp4, d / "cut.mp4"), CorruptVideo)
    faststart = make_clip(d / "fast.mp4", seconds=3, gop_seconds=0.5, faststart=True).path
    cases["truncated_faststart_mp4"] = (_cut_in_half(faststart, d / "cut_fast.mp4"), CorruptVideo)
    mkv = make_clip(d / "ok.mkv", container="mkv", seconds=3, gop_seconds=0.5).path
    cases["truncated_mkv"] = (_cut_in_half(mkv, d / "cut.mkv"), CorruptVideo)
    webm = make_clip(d / "ok.webm", codec="vp9", container="webm", seconds=3, gop_seconds=0.5).path
    cases["truncated_webm"] = (_cut_in_half(webm, d / "cut.webm"), CorruptVideo)
    # Bit rot: garbage over the slice data of every keyframe but the first (headers intact, so the
    # demuxer still calls them keyframes). H.264 detects it and the decoder refuses; HEVC and VP9 carry no
    # check that would notice, so they are not used here (see the report in opencv.py / media.py).
    cases["corrupt_middle"] = (_corrupt_keyframes(mp4, d / "corrupt.mp4"), CorruptVideo)
    cases["corrupt_middle_mkv"] = (_corrupt_keyframes(mkv, d / "corrupt.mkv"), CorruptVideo)
    raw = str(d / "raw.h264")  # an Annex B elementary stream: packets carry no timestamps at all
    with av.open(mp4) as src, av.open(raw, "w", format="h264") as out:
        stream = out.add_stream_from_template(src.streams.video[0])
        for packet in src.demux(video=0):
            if packet.size:
                packet.stream = stream
                out.mux(packet)
    cases["no_timestamps"] = (raw, MissingTimestamps)
    return cases


# OpenCV conceals decoder errors and reads raw streams its own way: those two cases differ for it only.
OPENCV_DIFFERS = {"corrupt_middle", "corrupt_middle_mkv", "no_timestamps"}


@pytest.mark.parametrize("loader", LOADERS)
@pytest.mark.parametrize("case", ["missing", "directory", "empty", "text", "text_as_mp4", "image", "audio_only",
                                  "truncated_mp4", "truncated_faststart_mp4", "truncated_mkv", "truncated_webm",
                                  "corrupt_middle", "corrupt_middle_mkv", "no_timestamps"])
def test_bad_file_raises_loader_error(bad, loader, case):
    path, kind = bad[case]
    if loader == "opencv" and case in OPENCV_DIFFERS:
        kind = LoaderError if case == "no_timestamps" else None
    if kind is None:
        pytest.skip("OpenCV conceals decode errors (as vLLM's OpenCV loader does); see opencv.py")
    for use_index in (True, False):
        with pytest.raises(kind) as info:
            load_video(path, backend=loader, num_frames=8, use_index=use_index)
        assert path in str(info.value) and info.value.reason
        assert info.value.source == path


@pytest.mark.parametrize("loader", LOADERS)
@pytest.mark.parametrize("case", ["empty", "text", "image", "truncated_mkv", "corrupt_middle"])
def test_bad_bytes_raise_loader_error(bad, loader, case):
    path, kind = bad[case]
    if loader == "opencv" and case == "corrupt_middle":
        pytest.skip("OpenCV conceals decode errors")
    with open(path, "rb") as f:
        data = f.read()
    with pytest.raises(kind) as info:
        load_video(data, backend=loader, num_frames=8)
    assert f"{len(data)} bytes" in str(info.value)


@pytest.mark.parametrize("loader", LOADERS)
def test_random_bytes_raise_loader_error(tmp_path, loader, rng):
    """Fresh random files of random sizes: each is refused with a LoaderError, never another exception (FFmpeg
    probes some as subtitles or audio whose tags are not UTF-8: PyAV raised UnicodeDecodeError on those). About
    1 in 40,000 is a decodable raw H.263 picture (random.Random(139514).randbytes(20000)): a well-formed clip
    is then a right answer too."""
    path = tmp_path / "random.mp4"
    for _ in range(40):
        seed = rng.randrange(2**32)
        blob = random.Random(seed).randbytes(rng.choice([64, 1000, 5000, 20000]))
        path.write_bytes(blob)
        for source in (str(path), blob):
            drawn = f"random.Random({seed}).randbytes({len(blob)})"
            try:
                frames, meta = load_video(source, backend=loader, num_frames=4)
            except LoaderError as err:
                assert err.reason, drawn
            except Exception as err:    # noqa: BLE001 (the point: nothing but a LoaderError)
                raise AssertionError(f"{type(err).__name__} from {drawn}: {err}") from err
            else:                        # FFmpeg found a stream in it: then it must be a well-formed clip
                assert frames.dtype == np.uint8 and frames.ndim == 4 and frames.shape[-1] == 3, (drawn, frames.shape)
                assert 1 <= len(frames) == len(meta["frames_indices"]) <= 4, (drawn, meta)


@pytest.mark.parametrize("loader", LOADERS)
def test_a_probed_stream_without_a_decoder_is_refused_clearly(tmp_path, loader):
    """FFmpeg probes these 64 random bytes as a JPEG XL picture, a format this FFmpeg has no decoder for: PyAV
    then gives the stream no codec context (an AttributeError reached the caller before). Drawn by the random
    test above; kept as a fixed case."""
    blob = random.Random(682400379).randbytes(64)
    path = tmp_path / "random.mp4"
    path.write_bytes(blob)
    for source in (str(path), blob):
        with pytest.raises(UnsupportedMedia) as info:
            load_video(source, backend=loader, num_frames=4)
        assert "not a video clip" in info.value.reason


def test_a_video_stream_in_a_codec_ffmpeg_cannot_decode(monkeypatch, tmp_path):
    """A video stream (not a still) whose codec has no decoder here: refused with the fix, the container closed."""
    from batchjob.loaders import media

    class Container:
        closed = False
        format = type("Format", (), {"name": "mpegts"})()
        streams = type("Streams", (), {"video": [type("Stream", (), {"codec_context": None})()]})()

        def close(self):
            Container.closed = True

    path = _write(tmp_path / "odd.ts", b"\x47" * 188)
    monkeypatch.setattr(media.av, "open", lambda *a, **k: Container())
    with pytest.raises(UnsupportedMedia) as info:
        with media.open_video(path, path):
            pass
    assert "cannot decode" in info.value.reason and "re-encode" in info.value.reason and Container.closed
    assert path in str(info.value)


@pytest.mark.parametrize("loader", LOADERS)
def test_tags_that_are_not_utf8_do_not_stop_a_clip(tmp_path, loader):
    """A clip whose container tags are Latin-1 (older muxers write them so) decodes exactly as the same packets
    tagged in UTF-8; before, PyAV's strict tag decoding raised UnicodeDecodeError at open."""
    src = make_clip(tmp_path / "src.mkv", container="mkv", seconds=1.5, gop_seconds=0.5).path
    latin = str(tmp_path / "latin.mkv")
    with av.open(src) as inp, av.open(latin, "w", metadata_encoding="latin-1") as out:
        out.metadata["title"] = "Caf\xe9 r\xe9sum\xe9"
        stream = out.add_stream_from_template(inp.streams.video[0])
        for packet in inp.demux(video=0):
            if packet.size:
                packet.stream = stream
                out.mux(packet)
    with pytest.raises(UnicodeDecodeError):     # the file really holds tags that are not UTF-8
        av.open(latin).close()
    want, want_meta = load_video(src, backend=loader, num_frames=4)
    got, meta = load_video(latin, backend=loader, num_frames=4)
    np.testing.assert_array_equal(got, want)
    assert meta["frames_indices"] == want_meta["frames_indices"]


@pytest.mark.parametrize("loader", LOADERS)
@pytest.mark.parametrize("num_frames", [0, -2, 2.5, "16", None, True])
def test_bad_num_frames(bad, tmp_path, loader, num_frames):
    path = make_clip(tmp_path / "c.mp4", seconds=0.5, width=64, height=48).path
    with pytest.raises(InvalidArgument, match="num_frames") as info:
        load_video(path, backend=loader, num_frames=num_frames)
    assert path in str(info.value)


@pytest.mark.parametrize("loader", LOADERS)
@pytest.mark.parametrize("kwargs, match", [({"fps": "2"}, "fps"), ({"fps": float("nan")}, "fps"),
                                           ({"frame_recovery": True}, "frame_recovery is not supported")])
def test_bad_vllm_kwargs(tmp_path, loader, kwargs, match):
    """vLLM's media kwargs are checked like num_frames; frame_recovery is refused as vLLM's decoders refuse it."""
    path = make_clip(tmp_path / "c.mp4", seconds=0.5, width=64, height=48).path
    with pytest.raises(InvalidArgument, match=match) as info:
        load_video(path, backend=loader, num_frames=4, **kwargs)
    assert path in str(info.value)
    if "frame_recovery" in kwargs:
        assert repr(loader) in str(info.value)


def test_loader_errors_are_value_errors():
    """`vllm serve` answers a ValueError from a loader with HTTP 400 (the client's bad media), not 500."""
    for kind in (VideoNotFound, UnsupportedMedia, CorruptVideo, MissingTimestamps, InvalidArgument):
        assert issubclass(kind, LoaderError) and issubclass(kind, ValueError)


def test_unknown_backend_lists_the_choices():
    with pytest.raises(InvalidArgument) as info:
        load_video("x.mp4", backend="decord")
    assert "decord" in str(info.value) and all(name in str(info.value) for name in list_loaders())


def test_bad_source_type():
    with pytest.raises(InvalidArgument, match="source type"):
        load_video(12345)


def test_errors_survive_pickling():
    """Ray ships a decode actor's exception to the driver by pickling it."""
    import pickle

    err = pickle.loads(pickle.dumps(CorruptVideo("/data/a.mp4", "truncated")))
    assert isinstance(err, CorruptVideo) and err.source == "/data/a.mp4" and str(err) == "/data/a.mp4: truncated"
