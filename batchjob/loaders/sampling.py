"""The decode loops the PyAV loaders share: keyframe picks, and exact frames reached from keyframes."""

from __future__ import annotations

import numpy as np

from batchjob.loaders.decode import decode_run, read_keyframe
from batchjob.loaders.errors import CorruptVideo, InvalidArgument
from batchjob.loaders.keyframes import KeyframeListing
from batchjob.loaders.media import prepare_keyframe_decoder
from batchjob.loaders.picks import fill_targets, gop_of, keyframe_picks


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


def exact_frames(container, stream, listing: KeyframeListing, num_frames: int, max_decoded_frames: int,
                 label: str) -> tuple[list[np.ndarray], list[int], int, list[int]]:
    """Uniformly placed exact frames, each decoded forward from the keyframe before it (`fill_targets`)."""
    kf_indices = [k.index for k in listing.keyframes]
    targets = fill_targets(kf_indices, listing.total_num_frames, num_frames, max_decoded_frames)
    return frames_at(container, stream, listing, targets, label)


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
