"""Which frames to return: pure functions over indices, testable without any video.

Three placements exist. Keyframe picks spread the budget evenly over the clip's keyframe list, repeating
keyframes (balanced: counts at most one apart) when there are fewer keyframes than frames asked for.
Uniform targets spread the budget over all frames the way vLLM's default loader does (`linspace(...,
dtype=int)`, i.e. truncation), so A/B comparisons against that loader line up frame for frame. Burst
targets are keyframe picks whose repeats become the frames right after the keyframe (`burst_targets`).
"""

from __future__ import annotations

from bisect import bisect_right
from typing import Iterator

import numpy as np


def keyframe_picks(num_keyframes: int, num_frames: int) -> list[int]:
    """Positions in the keyframe list, in order.

    At most as many frames as keyframes: `round(linspace(0, n_kf - 1, num_frames))`, distinct keyframes
    spanning the clip from the first to the last. More frames than keyframes: every keyframe, repeated so
    that the counts differ by at most one (3 keyframes for 16 frames: 5/6/5). Frame i is the keyframe whose
    equal share of the frame slots holds the centre of slot i, so the extra repeats are spread evenly.
    """
    if num_keyframes <= 0 or num_frames <= 0:
        raise ValueError(f"need keyframes and frames, got {num_keyframes} keyframes, {num_frames} frames")
    if num_frames <= num_keyframes:
        return [int(p) for p in np.round(np.linspace(0, num_keyframes - 1, num_frames))]
    return [(2 * i + 1) * num_keyframes // (2 * num_frames) for i in range(num_frames)]


def uniform_targets(total_frames: int, num_frames: int) -> list[int]:
    """Frame indices vLLM's OpenCV loader picks: `linspace(0, total - 1, num_frames, dtype=int)`."""
    if total_frames <= 0 or num_frames <= 0:
        raise ValueError(f"need frames, got total {total_frames}, asked {num_frames}")
    if num_frames >= total_frames:
        return list(range(total_frames))  # lossless loaders never invent frames (vLLM does the same)
    return [int(i) for i in np.linspace(0, total_frames - 1, num_frames, dtype=int)]


def gop_of(keyframe_indices: list[int], target: int) -> int:
    """Position of the keyframe a decode must start from to reach `target` (the last one at or before it)."""
    return max(0, bisect_right(keyframe_indices, target) - 1)


def snap_to_keyframes(targets: list[int], keyframe_indices: list[int], total_frames: int) -> list[int]:
    """Move each target onto a keyframe lying less than half a spacing (rounded down) away from it.

    Such a keyframe is closer to the target's uniform position than any neighbouring target is, so the
    sample stays uniform to within half a step, yet costs one picture instead of a forward run. A clip
    with keyframes every 2 s asked for 16 frames over 30 s then decodes mostly keyframes; a clip with
    one keyframe is unaffected past frame 0.
    """
    if len(targets) < 2:
        return list(targets)
    reach = ((total_frames - 1) // (len(targets) - 1)) / 2
    snapped = []
    for t in targets:
        i = bisect_right(keyframe_indices, t)
        near = [k for k in keyframe_indices[max(0, i - 1):i + 1] if abs(k - t) < reach]
        snapped.append(min(near, key=lambda k: (abs(k - t), k)) if near else t)
    return snapped


def fill_targets(keyframe_indices: list[int], total_frames: int, num_frames: int,
                 max_decoded_frames: int) -> list[int]:
    """Uniform targets, pulled back toward their keyframes when reaching them all costs too much.

    Reaching target t costs decoding every frame from its keyframe up to t; targets sharing a keyframe
    share one forward run, so the cost of a plan is the sum over runs of (furthest offset + 1). When that
    exceeds `max_decoded_frames`, every offset is scaled by the same factor, which keeps the frames in
    order and spread within each run, and the plan then fits the budget. A target before the first
    keyframe (an undecodable lead-in) moves to that keyframe. Targets next to a keyframe snap to it first
    (`snap_to_keyframes`).
    """
    if not keyframe_indices:
        raise ValueError("a clip without keyframes cannot be decoded")
    uniform = [max(t, keyframe_indices[0]) for t in uniform_targets(total_frames, num_frames)]
    targets = snap_to_keyframes(uniform, keyframe_indices, total_frames)
    runs: dict[int, int] = {}
    for t in targets:
        kf = keyframe_indices[gop_of(keyframe_indices, t)]
        runs[kf] = max(runs.get(kf, 0), t - kf)
    cost = sum(offset + 1 for offset in runs.values())
    if cost <= max_decoded_frames:
        return targets
    spare = max(0, max_decoded_frames - len(runs))
    scale = spare / max(1, sum(runs.values()))
    pulled = []
    for t in targets:
        kf = keyframe_indices[gop_of(keyframe_indices, t)]
        pulled.append(kf + int((t - kf) * scale))
    return pulled


def keyframe_runs(keyframe_indices: list[int], total_frames: int, num_frames: int) -> Iterator[tuple[int, int, int]]:
    """For each keyframe `keyframe_picks` uses, in order: (its position in the list, how many frames it is picked
    for, the first frame after its GOP: the next keyframe or the clip's end). The burst rules differ only in
    which frames of that GOP replace the repeats."""
    picks = keyframe_picks(len(keyframe_indices), num_frames)
    for p in sorted(set(picks)):
        end = keyframe_indices[p + 1] if p + 1 < len(keyframe_indices) else total_frames
        yield p, picks.count(p), end


def burst_targets(keyframe_indices: list[int], total_frames: int, num_frames: int, step: int) -> list[int]:
    """The keyframe picks, with every repeat of a keyframe replaced by the frame `step` after the one before it.

    As many frames as the clip has: every frame. Otherwise the layout is `keyframe_picks`' (enough keyframes:
    one picture each), so the frames keep the keyframes' spread over the clip and the same pairing into
    temporal patches; where a keyframe would be shown `m` times, the frames are `k, k + s, ..., k + (m - 1) s`
    instead (`s = step`, or less where the next keyframe or the clip's end comes sooner; a GOP shorter than
    its share repeats its last frame). Reaching them costs `(m - 1) * s + 1` pictures per keyframe, however
    long the GOP.

    Why: Qwen-VL models fold consecutive frames two by two into one temporal patch. A repeated keyframe makes
    a patch of two identical pictures, which shows no motion; a keyframe and the frame a few after it show
    the motion at that instant, as two uniformly spaced frames show it.
    """
    if not keyframe_indices or total_frames <= 0 or num_frames <= 0:
        raise ValueError(f"need keyframes and frames, got {len(keyframe_indices)} keyframes, "
                         f"{total_frames} frames in the clip, {num_frames} asked")
    if isinstance(step, bool) or not isinstance(step, (int, np.integer)) or step < 1:
        raise ValueError(f"step must be a positive integer, got {step!r}")
    if num_frames >= total_frames:
        return list(range(total_frames))  # every frame once, as the uniform loaders return it
    out = []
    for p, m, end in keyframe_runs(keyframe_indices, total_frames, num_frames):
        anchor = keyframe_indices[p]
        room = end - anchor
        s = min(step, max(1, (room - 1) // max(1, m - 1)))
        out.extend(anchor + min(j * s, room - 1) for j in range(m))
    return out


def decode_order_bursts(keyframe_indices: list[int], keyframe_positions: list[int], decode_order: list[int],
                        num_frames: int, most: int | None = None) -> list[int]:
    """The keyframe picks, with the repeats of a keyframe replaced by the pictures decoded right after it.

    `decode_order[j]` is the presentation index of the j-th picture in decode order, `keyframe_positions[i]`
    where keyframe i sits in it. Where a keyframe would be shown `m` times, the frames are the keyframe and the
    first `m - 1` pictures after it in decode order that are shown after it and before the next keyframe, in
    presentation order (a GOP with fewer repeats its last frame). Reaching them costs `m` pictures, the fewest
    any `m` distinct frames of that GOP cost: with two B-frames the first picture decoded after a keyframe is
    the one shown three frames later, reached with two decodes where the frame two after it takes four.
    `most` caps the pictures per keyframe (the last one repeats): the cost stays `most` per keyframe on clips
    with few keyframes, where each keyframe's burst would otherwise grow toward `num_frames`.
    """
    if most is not None and (isinstance(most, bool) or not isinstance(most, (int, np.integer)) or most < 1):
        raise ValueError(f"most must be a positive integer (pictures per keyframe) or None, got {most!r}")
    total = len(decode_order)
    if not keyframe_indices or len(keyframe_positions) != len(keyframe_indices) or total <= 0 or num_frames <= 0:
        raise ValueError(f"need keyframes (with their decode positions) and frames, got {len(keyframe_indices)} "
                         f"keyframes, {len(keyframe_positions)} positions, {total} frames in the clip, "
                         f"{num_frames} asked")
    if num_frames >= total:
        return list(range(total))  # every frame once, as the uniform loaders return it
    out = []
    for p, m, end in keyframe_runs(keyframe_indices, total, num_frames):
        wanted = m if most is None else min(m, most)
        anchor = keyframe_indices[p]
        stop = keyframe_positions[p + 1] if p + 1 < len(keyframe_positions) else total
        chosen = [anchor]
        for j in range(max(0, keyframe_positions[p]), stop):
            if len(chosen) == wanted:
                break
            if anchor < decode_order[j] < end:   # leading pictures (shown before the keyframe) are not its own
                chosen.append(decode_order[j])
        chosen.sort()
        out.extend(chosen + [chosen[-1]] * (m - len(chosen)))
    return out
