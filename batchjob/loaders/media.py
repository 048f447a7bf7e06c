"""Opening a source with PyAV and turning decoded pictures into upright RGB arrays.

Every way FFmpeg can refuse a user's file is translated here into a `LoaderError` naming the file, so the
loaders above can stay about frame selection.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import os
from typing import Any, BinaryIO, Iterator, Union

import av
import numpy as np

from batchjob.loaders.errors import (CorruptVideo, InvalidArgument, LoaderError, UnsupportedMedia,
                                     VideoNotFound)

Source = Union[str, os.PathLike, bytes, bytearray, memoryview, BinaryIO]

# FFmpeg happily "opens" still images (image2, *_pipe demuxers) and text files (tty demuxer, ansi codec)
# as one-frame or rendered-text video; none of them is a clip. Judged by demuxer, not codec: PNG inside
# MOV is a real (screen-recording) video.
_STILL_FORMATS = {"image2", "tty"}
_TEXT_CODECS = {"ansi"}


def describe(source: Any) -> str:
    """A short name for error messages: the path, or what kind of in-memory input it was."""
    if isinstance(source, (str, os.PathLike)):
        return os.fspath(source)
    if isinstance(source, (bytes, bytearray, memoryview)):
        return f"<{len(source)} bytes of video>"
    if not hasattr(source, "read"):
        return f"<{type(source).__name__} {source!r:.40}>"
    label = getattr(source, "source_label", None)   # a remote clip's file object names its URL (range_file.py)
    if isinstance(label, str):
        return label
    name = getattr(source, "name", None)
    return f"<file object {name}>" if isinstance(name, str) else "<file object>"


@contextlib.contextmanager
def ffmpeg_errors(label: str) -> Iterator[None]:
    """Anything FFmpeg or the OS raises while reading becomes a CorruptVideo naming the source."""
    try:
        yield
    except LoaderError:
        raise
    except (av.FFmpegError, OSError, EOFError) as err:
        raise CorruptVideo(label, f"FFmpeg failed while reading it ({err}); the file is damaged or "
                                  f"truncated: re-download or re-encode it") from err


def _as_avopen_arg(source: Source, label: str) -> Any:
    if isinstance(source, (str, os.PathLike)):
        path = os.fspath(source)
        if not os.path.exists(path):
            hint = ("check the path, and that its disk or network share is mounted" if os.path.isabs(path) else
                    f"check the path (relative paths resolve against the working directory {os.getcwd()})")
            raise VideoNotFound(label, f"no such file; {hint}")
        if os.path.isdir(path):
            raise VideoNotFound(label, "is a directory, not a video file")
        if not os.access(path, os.R_OK):
            raise VideoNotFound(label, "file is not readable; check its permissions")
        if os.path.getsize(path) == 0:
            raise CorruptVideo(label, "file is empty (0 bytes); the download or copy did not finish")
        return path
    if isinstance(source, (bytes, bytearray, memoryview)):
        if len(source) == 0:
            raise CorruptVideo(label, "no bytes given; the video data is empty")
        return io.BytesIO(bytes(source))
    if hasattr(source, "read") and hasattr(source, "seek"):
        return source
    raise InvalidArgument(label, f"unsupported source type {type(source).__name__}; pass a path, bytes "
                                 "or a seekable binary file object")


def _looks_like_mp4(source: Source) -> bool:
    """An 'ftyp' box at byte 4 marks an MP4/MOV even when the rest of the file is gone."""
    try:
        if isinstance(source, (str, os.PathLike)):
            with open(source, "rb") as f:
                head = f.read(8)
        elif isinstance(source, (bytes, bytearray, memoryview)):
            head = bytes(source[:8])
        elif hasattr(source, "seek") and hasattr(source, "read"):
            where = source.tell()
            source.seek(0)
            head = source.read(8)
            source.seek(where)
        else:
            return False
    except (OSError, ValueError):   # includes LoaderError: a remote read that failed
        return False
    return head[4:8] == b"ftyp"


@contextlib.contextmanager
def open_video(source: Source, label: str) -> Iterator[tuple[av.container.InputContainer, av.video.stream.VideoStream]]:
    """Open `source` and its first video stream; refuse stills, text and audio-only media clearly."""
    arg = _as_avopen_arg(source, label)
    try:
        container = av.open(arg, mode="r", metadata_errors="replace")   # tags are not ours to refuse a clip over
    except av.FileNotFoundError as err:
        raise VideoNotFound(label, f"cannot open it ({err})") from err
    except (av.FFmpegError, OSError) as err:
        if _looks_like_mp4(source):
            raise CorruptVideo(label, f"an MP4 without a readable index (moov) ({err}); it was cut off "
                                      "before its end or damaged: re-download or re-encode it") from err
        raise UnsupportedMedia(label, f"FFmpeg cannot read it as media ({err}): not a video, an unknown "
                                      "container, or a file cut off before its index") from err
    try:
        fmt = container.format.name
        if not container.streams.video:
            kinds = sorted({s.type for s in container.streams}) or ["nothing"]
            raise UnsupportedMedia(label, f"no video stream (it holds {', '.join(kinds)}); pass a video file")
        stream = container.streams.video[0]
        # FFmpeg can probe a stream whose codec it has no decoder for: PyAV then gives it no codec context
        codec = stream.codec_context.name if stream.codec_context is not None else None
        if fmt in _STILL_FORMATS or fmt.endswith("_pipe") or codec in _TEXT_CODECS:
            raise UnsupportedMedia(label, f"this is a still image or text ({fmt}/{codec or 'no decoder'}), "
                                          "not a video clip")
        if codec is None:
            raise UnsupportedMedia(label, f"its video stream ({fmt}) is in a codec this FFmpeg cannot decode; "
                                          "re-encode it (H.264, HEVC, VP9 or AV1)")
        yield container, stream
    finally:
        container.close()


def prepare_keyframe_decoder(stream: av.video.stream.VideoStream) -> None:
    """Set up the decoder for keyframes decoded one at a time (call before the first decode).

    It fails on damage it detects instead of concealing it: a concealed picture is a wrong answer the
    pipeline cannot see, an error row is one it can. (Not for forward runs: from an H.264 open-GOP
    keyframe they meet pictures whose references precede it, which this mode rejects although a full
    decode shows them correctly; runs rely on the per-picture corruption flag in `to_upright_rgb`.)
    One thread: a lone intra picture gains nothing from threads, which would be started and drained per
    keyframe, and decode actors already run one clip per core.
    """
    stream.codec_context.options = {"err_detect": "explode"}
    stream.codec_context.thread_count = 1


def is_mp4_family(container: av.container.InputContainer) -> bool:
    """MP4/MOV carry a complete sample table (every sample, keyframe flags) before any frame is read."""
    return "mp4" in container.format.name.split(",")


def rotation_of(frame: av.VideoFrame) -> int:
    """Counter-clockwise quarter turns that make the picture upright (display matrix side data)."""
    try:
        degrees = frame.rotation
    except (AttributeError, ValueError):
        return 0
    return int(round((degrees or 0) / 90.0)) % 4


def to_upright_rgb(frame: av.VideoFrame, label: str = "video") -> np.ndarray:
    """uint8 RGB [H, W, 3], display rotation applied, as every loader must return it."""
    if frame.is_corrupt:
        raise CorruptVideo(label, f"the decoder flagged the picture at timestamp {frame.pts} as damaged; "
                                  "re-download or re-encode the file")
    rgb = frame.to_ndarray(format="rgb24")
    turns = rotation_of(frame)
    return np.ascontiguousarray(np.rot90(rgb, k=turns)) if turns else rgb


def stack_frames(frames: list[np.ndarray], label: str) -> np.ndarray:
    """One array for the clip; a clip whose pictures change size mid-stream is refused, not padded."""
    shapes = {f.shape for f in frames}
    if len(shapes) != 1:
        raise UnsupportedMedia(label, f"picture size changes inside the clip ({sorted(shapes)}); re-encode "
                                      "it at one resolution")
    return np.stack(frames)


def visible_frame_count(stream: av.video.stream.VideoStream) -> int | None:
    """Frames an MP4 edit list leaves visible, when it hides some (`ffmpeg -ss T -c copy` cuts); else None.

    The hidden samples sit at the start or the end of the sample table, so two lookups tell whether to count.
    """
    entries = stream.index_entries
    count = len(entries)
    if count == 0 or not (entries[0].is_discard or entries[count - 1].is_discard):
        return None
    return sum(1 for i in range(count) if not entries[i].is_discard)


def pts_seconds(stream: av.video.stream.VideoStream, pts: list[int]) -> list[float]:
    """Presentation times in seconds from the stream's start (metadata `frames_timestamps`): the real time
    of each returned frame, which Qwen3-VL prompts carry as text; for irregular keyframes it differs from
    `frames_indices / fps`."""
    start = stream.start_time if stream.start_time is not None else 0
    base = stream.time_base
    return [float((p - start) * base) for p in pts]


def nominal_fps(stream: av.video.stream.VideoStream) -> float:
    """Average frame rate as the container states it (the engine spaces temporal positions by it)."""
    rate = stream.average_rate or stream.guessed_rate or stream.base_rate
    return float(rate) if rate else 0.0


@dataclasses.dataclass(frozen=True)
class ClipFacts:
    """What metadata needs, whichever way the frames were found."""

    total_num_frames: int
    fps: float

    @property
    def duration(self) -> float:
        """Seconds, as vLLM computes it (frame count over nominal rate); what `fps` limits apply to."""
        return self.total_num_frames / self.fps if self.fps > 0 else 0.0

    def metadata(self, backend: str, indices: list[int], **extra: Any) -> dict[str, Any]:
        """vLLM's six keys (`vllm_bridge.VLLM_METADATA_KEYS`) plus the loader's own `extra` keys."""
        return {
            "total_num_frames": self.total_num_frames,
            "fps": self.fps,
            "duration": self.duration,
            "video_backend": backend,
            "frames_indices": list(indices),
            # vLLM's rule: only a clip returned whole may be resampled by the HF processor.
            "do_sample_frames": list(indices) == list(range(self.total_num_frames)),
            **extra,
        }
