"""The decode loops the PyAV loaders share: keyframe picks, and exact frames reached from keyframes."""

from __future__ import annotations

from typing import Callable

import numpy as np

from batchjob.loaders.decode import decode_run, read_keyframe
from batchjob.loaders.errors import CorruptVideo, InvalidArgument
from batchjob.loaders.keyframes import KeyframeListing, from_sweep, list_keyframes
from batchjob.loaders.media import (ClipFacts, Source, ffmpeg_errors, nominal_fps, open_video, prepare_keyframe_decoder,
                                    pts_seconds, stack_frames)
from batchjob.loaders.picks import gop_of, keyframe_picks
from batchjob.loaders.request import FrameRequest


def check_num_frames(num_frames: object, label: str) -> int:
    if isinstance(num_frames, bool) or not isinstance(num_frames, (int, np.integer)) or num_frames <= 0:
        raise InvalidArgument(label, f"num_frames must be a positive integer, got {num_frames!r}")
    return int(num_frames)


def require_keyframes(listing: KeyframeListing, label: str) -> None:
    if listing.total_num_frames == 0:
        raise CorruptVideo(label, "the video stream holds no packets; the file is empty or truncated")
    if not listing.keyframes:
        raise CorruptVideo(label, "the video stream has no keyframe, so no frame can be decoded on its own")


def keyframe_frames(container, stream, listing: KeyframeListing, num_frames: int,
                    label: str) -> tuple[list[np.ndarray], list[int], list[int]]:
    """Decode each picked keyframe once, in file order; return frames, indices and PTS in pick order."""
    picks = keyframe_picks(len(listing.keyframes), num_frames)
    prepare_keyframe_decoder(stream)
    decoded = {p: read_keyframe(container, stream, listing.keyframes[p], label) for p in sorted(set(picks))}
    return [decoded[p][0] for p in picks], [decoded[p][2] for p in picks], [decoded[p][1] for p in picks]


def keyframes_or_exact(source: Source, label: str, name: str, request: FrameRequest, *, use_index: bool,
                       targets: Callable[[KeyframeListing, int], list[int]], mode_key: str, fill_mode: str,
                       fill_extra: dict | None = None, one_thread: bool = False) -> tuple[np.ndarray, dict]:
    """A clip's keyframes when it has at least as many as frames asked (`mode_key`: "keyframes"); else the exact
    frames `targets(sweep listing, frames asked)` names (presentation indices), each decoded forward from the
    keyframe before it (`mode_key`: `fill_mode`, plus `fill_extra`). The body of the loaders that differ only in
    where those frames are (pyav_adaptive, pyav_burst). `one_thread`: decode the runs on one thread (short runs
    lose more to a thread pool's start-up and hand-offs than they gain)."""
    with ffmpeg_errors(label), open_video(source, label) as (container, stream):
        listing = list_keyframes(container, stream, label, allow_index=use_index)
        require_keyframes(listing, label)
        facts = ClipFacts(listing.total_num_frames, nominal_fps(stream))
        num_frames = request.count(facts.total_num_frames, facts.duration)
        if len(listing.keyframes) >= num_frames:
            frames, indices, pts = keyframe_frames(container, stream, listing, num_frames, label)
            extra = {mode_key: "keyframes", "decoded_frames": len(set(indices))}
        else:
            if listing.sorted_pts is None:  # the sample table has no presentation times: sweep once
                listing = from_sweep(container, stream, label)
                require_keyframes(listing, label)
            if one_thread:
                stream.codec_context.thread_count = 1
            wanted = targets(listing, num_frames)
            frames, indices, decoded, pts = frames_at(container, stream, listing, wanted, label)
            extra = {mode_key: fill_mode, **(fill_extra or {}), "decoded_frames": decoded}
        return stack_frames(frames, label), facts.metadata(name, indices, keyframe_source=listing.source,
                                                            num_keyframes=len(listing.keyframes),
                                                            frames_timestamps=pts_seconds(stream, pts), **extra)


def frames_at(container, stream, listing: KeyframeListing, targets: list[int],
              label: str) -> tuple[list[np.ndarray], list[int], int, list[int]]:
    """The frames at presentation indices `targets` (any order, repeats allowed), each decoded forward from
    the keyframe before it; targets sharing a keyframe share one run.

    Needs a sweep listing (every frame's PTS), since the sample table only gives decode timestamps.
    Returns frames, indices, how many pictures were decoded, and the frames' PTS.
    """
    assert listing.sorted_pts is not None, "exact frames need the sweep's presentation timestamps"
    kf_indices = [k.index for k in listing.keyframes]
    runs: dict[int, list[int]] = {}
    for t in targets:
        runs.setdefault(gop_of(kf_indices, t), []).append(t)
    pictures: dict[int, np.ndarray] = {}
    total_decoded = 0
    for position in sorted(runs):
        wanted = {listing.sorted_pts[t] for t in runs[position]}
        span = max(runs[position]) - kf_indices[position] + 1
        found, decoded = decode_run(container, stream, listing.keyframes[position], wanted, label, span)
        pictures.update(found)
        total_decoded += decoded
    return ([pictures[listing.sorted_pts[t]] for t in targets], list(targets), total_decoded,
            [listing.sorted_pts[t] for t in targets])
