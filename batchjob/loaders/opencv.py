"""`opencv`: the lossless baseline, frames placed uniformly over all frames as vLLM's default loader does.

It reads every frame up to the last one wanted (`grab`) and converts only the wanted ones (`retrieve`),
which is exact for any GOP structure. It exists for A/B comparisons and costs time proportional to clip
length. OpenCV applies rotation metadata itself, so its frames are upright like the PyAV loaders'.
In vLLM's registry it is `batchjob_opencv`: vLLM has its own `opencv`, which this must not replace.
"""

from __future__ import annotations

import os
import tempfile

import numpy as np

from batchjob.loaders.errors import CorruptVideo, InvalidArgument, UnsupportedMedia
from batchjob.loaders.media import (ClipFacts, Source, describe, ffmpeg_errors, open_video, stack_frames,
                                    visible_frame_count)
from batchjob.loaders.picks import uniform_targets
from batchjob.loaders.registry import VIDEO_LOADER_REGISTRY
from batchjob.loaders.request import FPS_OPTION, FrameRequest
from batchjob.loaders.vllm_bridge import register_with_vllm

NAME = "opencv"
VLLM_NAME = "batchjob_opencv"


def _cv2(label: str):
    try:
        import cv2
    except ImportError:
        raise InvalidArgument(label, "the opencv backend needs OpenCV: pip install 'batchjob[opencv]'") from None
    return cv2


def load_uniform_opencv(path: str, num_frames: int = 16, *, fps: float = -1, frame_recovery: bool = False,
                        label: str | None = None, **_ignored) -> tuple[np.ndarray, dict]:
    label = label or describe(path)
    request = FrameRequest.parse(label, NAME, num_frames, fps, frame_recovery)
    cv2 = _cv2(label)
    with ffmpeg_errors(label), open_video(path, label) as (_, stream):
        codec = stream.codec_context.name  # same refusals (missing, empty, text, still, audio) as PyAV's
        visible = visible_frame_count(stream)
    cap = cv2.VideoCapture(path, cv2.CAP_FFMPEG)
    try:
        if not cap.isOpened():
            raise UnsupportedMedia(label, "OpenCV cannot open it as video; try a PyAV backend")
        # OpenCV counts every sample, the ones an edit list hides too; it only shows the visible ones.
        total = visible if visible is not None else int(cap.get(cv2.CAP_PROP_FRAME_COUNT))
        clip_fps = float(cap.get(cv2.CAP_PROP_FPS))
        if total <= 0:
            raise CorruptVideo(label, "OpenCV reports no frames; the file is empty or damaged")
        facts = ClipFacts(total, clip_fps)
        targets = uniform_targets(total, request.count(total, facts.duration))
        wanted = set(targets)
        pictures: dict[int, np.ndarray] = {}
        grabbed = 0
        for index in range(targets[-1] + 1):  # bounded by the frame count the container states
            if not cap.grab():
                break
            grabbed += 1
            if index in wanted:
                ok, bgr = cap.retrieve()
                if not ok:
                    raise CorruptVideo(label, f"OpenCV could not convert frame {index}; the stream is damaged")
                pictures[index] = np.ascontiguousarray(bgr[..., ::-1])
    finally:
        cap.release()
    # The stated count can be an estimate (Matroska: duration x fps), so vLLM keeps the frames that exist
    # when it runs a little past the real end; so do we. A stream ending far short is a cut-off file.
    if grabbed == 0:
        raise UnsupportedMedia(label, f"OpenCV decoded no frame of this {codec} stream (its bundled FFmpeg "
                                      "may lack that decoder, e.g. AV1); use a PyAV backend")
    if grabbed <= targets[-1] and total - grabbed > max(2, total // 50):
        raise CorruptVideo(label, f"the stream ends after {grabbed} frames but the container states {total}; "
                                  "the file is truncated: re-download or re-encode it")
    indices = [t for t in targets if t in pictures]
    if not indices:
        raise CorruptVideo(label, "no frame could be read; the stream is damaged or truncated")
    frames = stack_frames([pictures[t] for t in indices], label)
    return frames, facts.metadata(NAME, indices)


@VIDEO_LOADER_REGISTRY.register(NAME)
class OpenCVLoader:
    """Exact frames placed uniformly over the clip, as vLLM's default loader: lossless baseline, cost grows
    with clip length."""

    options = {"fps": FPS_OPTION}

    @classmethod
    def load_bytes(cls, data: Source, *, num_frames: int = 16, **kwargs) -> tuple[np.ndarray, dict]:
        """OpenCV reads files, not buffers: spill the bytes to a temporary file first."""
        label = describe(data)
        if hasattr(data, "read"):
            data = data.read()
        if not isinstance(data, (bytes, bytearray, memoryview)):
            raise InvalidArgument(label, f"expected bytes, got {type(data).__name__}")
        with tempfile.NamedTemporaryFile(suffix=".video") as tmp:
            tmp.write(data)
            tmp.flush()
            return load_uniform_opencv(tmp.name, num_frames, label=label, **kwargs)

    @classmethod
    def load_path(cls, path: str | os.PathLike, *, num_frames: int = 16, **kwargs) -> tuple[np.ndarray, dict]:
        return load_uniform_opencv(os.fspath(path), num_frames, **kwargs)


register_with_vllm(VLLM_NAME, OpenCVLoader)
