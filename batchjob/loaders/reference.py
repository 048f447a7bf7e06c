"""The straightforward keyframe algorithm, kept as the benchmark's baseline.

Demux every packet, collect keyframe timestamps, then for each pick seek and decode until the keyframe's
picture comes out (feeding whatever packets the decoder asks for). `pyav_keyframes` must return exactly
what this returns, faster. It lives in the package, not in the benchmark script, so tests can check that
the baseline the benchmark times is itself correct. It is not registered as a loader.
"""

from __future__ import annotations

from bisect import bisect_left

import numpy as np

from batchjob.loaders.errors import CorruptVideo, MissingTimestamps
from batchjob.loaders.media import (ClipFacts, Source, describe, ffmpeg_errors, nominal_fps, open_video,
                                    stack_frames, to_upright_rgb)
from batchjob.loaders.picks import keyframe_picks
from batchjob.loaders.sampling import check_num_frames


def load_keyframes_reference(source: Source, num_frames: int = 16) -> tuple[np.ndarray, dict]:
    label = describe(source)
    num_frames = check_num_frames(num_frames, label)
    with ffmpeg_errors(label), open_video(source, label) as (container, stream):
        all_pts, key_pts = [], []
        for packet in container.demux(stream):
            if packet.size == 0:
                continue
            if packet.pts is None:
                raise MissingTimestamps(label, "a packet has no timestamp")
            all_pts.append(packet.pts)
            if packet.is_keyframe:
                key_pts.append(packet.pts)
        if not key_pts:
            raise CorruptVideo(label, "no keyframes")
        all_pts.sort()
        picks = keyframe_picks(len(key_pts), num_frames)
        pictures = {}
        for p in sorted(set(picks)):
            container.seek(key_pts[p], stream=stream, backward=True)
            for frame in container.decode(stream):
                if frame.pts == key_pts[p]:
                    pictures[p] = to_upright_rgb(frame)
                    break
                if frame.pts is not None and frame.pts > key_pts[p]:
                    raise CorruptVideo(label, f"seek passed keyframe {p}")
            else:
                raise CorruptVideo(label, f"keyframe {p} not decoded")
        indices = [bisect_left(all_pts, key_pts[p]) for p in picks]
        facts = ClipFacts(len(all_pts), nominal_fps(stream))
        return stack_frames([pictures[p] for p in picks], label), facts.metadata("reference", indices)
