"""`pyav_adaptive`: keyframes where they cover the clip, exact uniform frames where they do not.

Keyframe-only sampling fails on clips with few keyframes: a clip with one keyframe at frame 0 returns the
first instant sixteen times (a published run lost 36 accuracy points on motion questions that way). When
a clip has fewer keyframes than frames asked for, this loader places the frames uniformly over the clip
(as vLLM's default loader does) and decodes each one exactly, forward from the keyframe before it.

Decode budget: `max_decoded_frames` (default 1024 pictures per clip) caps the forward decoding. That is
about what vLLM's OpenCV loader spends on a 30 s 30 fps clip.
A plan that would need more pulls every frame toward its keyframe by one common factor, so the frames stay
in order and spread, their indices stay true, and the cost stays bounded however long the GOPs are.

How many frames: as vLLM's uniform loader counts them (see request.py); `num_frames=-1` is every frame.
A packet the decoder refuses is skipped: the clip fails only if a frame it returns is missing or damaged.
"""

from __future__ import annotations

import os

import numpy as np

from batchjob.loaders.errors import InvalidArgument
from batchjob.loaders.keyframes import USE_INDEX_OPTION
from batchjob.loaders.media import Source, describe
from batchjob.loaders.picks import fill_targets
from batchjob.loaders.registry import VIDEO_LOADER_REGISTRY, LoaderOption
from batchjob.loaders.request import FPS_OPTION, FrameRequest
from batchjob.loaders.sampling import keyframes_or_exact
from batchjob.loaders.vllm_bridge import register_with_vllm

NAME = "pyav_adaptive"
DEFAULT_MAX_DECODED_FRAMES = 1024


def load_adaptive(source: Source, num_frames: int = 16, *, fps: float = -1, frame_recovery: bool = False,
                  max_decoded_frames: int = DEFAULT_MAX_DECODED_FRAMES, use_index: bool = True,
                  **_ignored) -> tuple[np.ndarray, dict]:
    label = describe(source)
    request = FrameRequest.parse(label, NAME, num_frames, fps, frame_recovery)
    if isinstance(max_decoded_frames, bool) or not isinstance(max_decoded_frames, int) or max_decoded_frames < 1:
        raise InvalidArgument(label, f"max_decoded_frames must be a positive integer, got {max_decoded_frames!r}")
    return keyframes_or_exact(source, label, NAME, request, use_index=use_index, mode_key="adaptive_mode",
                              fill_mode="fill", targets=lambda listing, n: fill_targets(
                                  [k.index for k in listing.keyframes], listing.total_num_frames, n,
                                  max_decoded_frames))


@VIDEO_LOADER_REGISTRY.register(NAME)
class PyAVAdaptiveLoader:
    """Keyframes when the clip has enough, else exact uniform frames decoded forward from the keyframe
    before each (bounded by max_decoded_frames)."""

    options = {"fps": FPS_OPTION,
               "max_decoded_frames": LoaderOption(int, "the most pictures decoded per clip to reach exact frames",
                                                  minimum=1),
               "use_index": USE_INDEX_OPTION}

    reads_file_objects = True   # URLs arrive as seekable range-reading files (batchjob.loaders.remote)

    @classmethod
    def load_bytes(cls, data: bytes, *, num_frames: int = 16, **kwargs) -> tuple[np.ndarray, dict]:
        return load_adaptive(data, num_frames, **kwargs)

    @classmethod
    def load_path(cls, path: str | os.PathLike, *, num_frames: int = 16, **kwargs) -> tuple[np.ndarray, dict]:
        return load_adaptive(os.fspath(path), num_frames, **kwargs)


register_with_vllm(NAME, PyAVAdaptiveLoader)
