"""What a caller asks a loader for, read the way vLLM's uniform loader reads its media kwargs.

vLLM calls every loader as `load_bytes(data, num_frames=N, fps=F, max_duration=D, frame_recovery=R, ...)`.
Its uniform loader (`opencv`) returns `min(N, total)` frames (`N = -1`: every frame), and when `fps > 0` at
most `floor(duration * fps)` of them, never fewer than one; `max_duration` only matters to its dynamic
(GLM-style) sampler. The same rule here gives our loaders the same frame counts on the same clip.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from batchjob.loaders.errors import InvalidArgument
from batchjob.loaders.registry import LoaderOption

ALL_FRAMES = -1  # vLLM's num_frames meaning "every frame" (every keyframe for pyav_keyframes)
FPS_OPTION = LoaderOption(float, "at most this many frames per second of clip (<= 0: no limit), as vLLM counts")


@dataclasses.dataclass(frozen=True)
class FrameRequest:
    num_frames: int  # > 0, or ALL_FRAMES
    fps: float  # frames per second of clip at most; <= 0: no limit

    @classmethod
    def parse(cls, label: str, backend: str, num_frames: object, fps: object = -1,
              frame_recovery: object = False) -> "FrameRequest":
        """Validate the kwargs; `max_duration` is accepted by the loaders and ignored, as vLLM's uniform
        loader ignores it. `frame_recovery` is refused like vLLM refuses it for every decoder but OpenCV's."""
        if isinstance(num_frames, bool) or not isinstance(num_frames, (int, np.integer)) or (
                num_frames <= 0 and num_frames != ALL_FRAMES):
            raise InvalidArgument(label, f"num_frames must be a positive integer or -1 (all), got {num_frames!r}")
        if fps is None:
            fps = -1
        if isinstance(fps, bool) or not isinstance(fps, (int, float, np.integer, np.floating)) or math.isnan(fps):
            raise InvalidArgument(label, f"fps must be a number (<= 0: no limit), got {fps!r}")
        if frame_recovery:
            raise InvalidArgument(label, f"frame_recovery is not supported by the {backend!r} backend (vLLM "
                                         "supports it only for its own OpenCV decoder); leave it unset")
        return cls(int(num_frames), float(fps))

    def count(self, total_frames: int, duration: float, every: int | None = None) -> int:
        """How many frames to return from a clip of `total_frames` lasting `duration` seconds.

        `every` is what "all frames" means for the loader (default `total_frames`; the keyframe loader
        passes its keyframe count). Never more than the clip holds, never fewer than one.
        """
        every = total_frames if every is None else every
        count = every if self.num_frames == ALL_FRAMES else min(self.num_frames, total_frames)
        if self.fps > 0:
            count = min(count, math.floor(duration * self.fps))
        return max(1, count)
