"""`pyav_keyframes`: decode only keyframes, spread evenly over the clip's keyframe list.

A keyframe decodes on its own, so a 16-frame sample of a 10-minute clip costs 16 picture decodes plus
finding the keyframes, which the MP4 sample table answers without reading the file (see keyframes.py).

How many frames (see request.py): `num_frames`, capped at the clip's frame count and, when `fps > 0`, at
`floor(duration * fps)`, as vLLM's uniform loader counts them; `num_frames=-1` means every keyframe once.
A request for more frames than the clip has keyframes (but not more than it has frames) repeats keyframes,
balanced, so callers that need a fixed frame count get it.
Importing this module registers the loader with batchjob's registry and, when vLLM is installed, with
vLLM's, so `media_io_kwargs={"video": {"video_backend": "pyav_keyframes"}}` works in a user's vLLM code.
"""

from __future__ import annotations

import os

import numpy as np

from batchjob.loaders.keyframes import USE_INDEX_OPTION, list_keyframes
from batchjob.loaders.media import (ClipFacts, Source, describe, ffmpeg_errors, nominal_fps, open_video, pts_seconds,
                                   stack_frames)
from batchjob.loaders.registry import VIDEO_LOADER_REGISTRY
from batchjob.loaders.request import FPS_OPTION, FrameRequest
from batchjob.loaders.sampling import keyframe_frames, require_keyframes
from batchjob.loaders.vllm_bridge import register_with_vllm

NAME = "pyav_keyframes"


def load_keyframes(source: Source, num_frames: int = 16, *, fps: float = -1, frame_recovery: bool = False,
                   use_index: bool = True, **_ignored) -> tuple[np.ndarray, dict]:
    """Frames `[T, H, W, 3]` and vLLM-style metadata; `use_index=False` forces the demux sweep."""
    label = describe(source)
    request = FrameRequest.parse(label, NAME, num_frames, fps, frame_recovery)
    with ffmpeg_errors(label), open_video(source, label) as (container, stream):
        listing = list_keyframes(container, stream, label, allow_index=use_index)
        require_keyframes(listing, label)
        facts = ClipFacts(listing.total_num_frames, nominal_fps(stream))
        count = request.count(facts.total_num_frames, facts.duration, every=len(listing.keyframes))
        frames, indices, pts = keyframe_frames(container, stream, listing, count, label)
        return stack_frames(frames, label), facts.metadata(NAME, indices, keyframe_source=listing.source,
                                                            num_keyframes=len(listing.keyframes),
                                                            frames_timestamps=pts_seconds(stream, pts))


@VIDEO_LOADER_REGISTRY.register(NAME)
class PyAVKeyframeLoader:
    """Keyframes only, spread evenly over the clip's keyframes (repeated, balanced, when too few): cost
    independent of clip length."""

    options = {"fps": FPS_OPTION,
               "use_index": USE_INDEX_OPTION}

    reads_file_objects = True   # URLs arrive as seekable range-reading files (batchjob.loaders.remote)

    @classmethod
    def load_bytes(cls, data: bytes, *, num_frames: int = 16, **kwargs) -> tuple[np.ndarray, dict]:
        return load_keyframes(data, num_frames, **kwargs)

    @classmethod
    def load_path(cls, path: str | os.PathLike, *, num_frames: int = 16, **kwargs) -> tuple[np.ndarray, dict]:
        return load_keyframes(os.fspath(path), num_frames, **kwargs)


register_with_vllm(NAME, PyAVKeyframeLoader)
