"""Frame placement rules, checked on random inputs without any video."""

from __future__ import annotations

from collections import Counter

import numpy as np
from hypothesis import given, settings, strategies as st

from batchjob.loaders.picks import fill_targets, gop_of, keyframe_picks, snap_to_keyframes, uniform_targets


@given(st.integers(1, 400), st.integers(1, 200))
def test_keyframe_picks_follow_the_rule(n_kf, num_frames):
    picks = keyframe_picks(n_kf, num_frames)
    assert len(picks) == num_frames
    assert picks == sorted(picks) and picks[0] == 0 and 0 <= picks[-1] <= n_kf - 1
    if num_frames > 1:
        assert picks[-1] == n_kf - 1
    if num_frames <= n_kf:
        assert len(set(picks)) == num_frames          # distinct keyframes ...
        for i, p in enumerate(picks):                  # ... each the nearest to its evenly spaced point
            exact = i * (n_kf - 1) / (num_frames - 1) if num_frames > 1 else 0.0
            assert abs(p - exact) <= 0.5
    else:  # repeats, never gaps: every keyframe is used, and balanced, as README and docstring promise
        counts = Counter(picks)
        assert set(counts) == set(range(n_kf))
        assert max(counts.values()) - min(counts.values()) <= 1, sorted(counts.items())


def test_repeats_are_balanced_on_the_issue_cases():
    """The counts issue 22 found (4/8/4, 2/4/4/4/2, 6/11.../6) against counts worked out by hand."""
    for n_kf, num_frames, want in ((3, 16, [5, 6, 5]), (5, 16, [3, 3, 4, 3, 3]), (10, 100, [10] * 10),
                                   (4, 6, [1, 2, 1, 2]), (3, 4, [1, 2, 1])):
        counts = Counter(keyframe_picks(n_kf, num_frames))
        assert [counts[k] for k in range(n_kf)] == want, (n_kf, num_frames)


@given(st.integers(1, 100), st.integers(0, 3))
def test_two_keyframes_are_balanced(half, odd):
    counts = Counter(keyframe_picks(2, 2 * half + (odd % 2)))
    assert abs(counts[0] - counts[1]) <= odd % 2 and counts[0] + counts[1] == 2 * half + odd % 2


@given(st.integers(1, 20000), st.integers(1, 300))
def test_uniform_targets_match_vllm(total, num_frames):
    targets = uniform_targets(total, num_frames)
    if num_frames >= total:
        assert targets == list(range(total))
    else:
        assert targets == np.linspace(0, total - 1, num_frames).astype(int).tolist()
        assert targets[0] == 0 and (num_frames == 1 or targets[-1] == total - 1)


@st.composite
def clip_layout(draw):
    total = draw(st.integers(1, 5000))
    inner = draw(st.lists(st.integers(1, max(1, total - 1)), max_size=30, unique=True))
    first = draw(st.sampled_from([0, 0, 0, min(3, total - 1)]))  # sometimes an undecodable lead-in
    keyframes = sorted({first, *[k for k in inner if k > first]})
    return keyframes, total, draw(st.integers(1, 64)), draw(st.integers(1, 4000))


def _cost(keyframes, targets):
    runs = {}
    for t in targets:
        kf = keyframes[gop_of(keyframes, t)]
        runs[kf] = max(runs.get(kf, 0), t - kf)
    return sum(offset + 1 for offset in runs.values())


@settings(max_examples=300)
@given(clip_layout())
def test_fill_targets_respect_budget_and_order(layout):
    keyframes, total, num_frames, budget = layout
    targets = fill_targets(keyframes, total, num_frames, budget)
    uniform = [max(t, keyframes[0]) for t in uniform_targets(total, num_frames)]
    snapped = snap_to_keyframes(uniform, keyframes, total)
    if len(uniform) > 1:  # snapping moves a frame less than half a spacing, onto a keyframe
        reach = ((total - 1) // (len(uniform) - 1)) / 2
        assert all(s == u or (s in keyframes and abs(s - u) < reach) for s, u in zip(snapped, uniform))
    uniform = snapped
    assert len(targets) == len(uniform)
    assert targets == sorted(targets)
    assert all(keyframes[0] <= t < total for t in targets)
    if _cost(keyframes, uniform) <= budget:
        assert targets == uniform  # affordable: exactly the uniform frames
    else:
        runs = len({gop_of(keyframes, t) for t in uniform})
        assert _cost(keyframes, targets) <= max(budget, runs)
        # each frame only moves back toward its own keyframe, never into another GOP
        for t, u in zip(targets, uniform):
            assert gop_of(keyframes, t) == gop_of(keyframes, u) and t <= u
