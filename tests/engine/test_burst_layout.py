"""The demo model's training clips laid out as pyav_burst lays them out (`trainer.burst_layout`).

The idealised decode order is checked against its documented rule spelled out here, and the layouts against
the frames `pyav_burst` returns from a real encoded clip with the same keyframes.
"""

from __future__ import annotations

import random

import numpy as np

from batchjob.loaders import load_video
from batchjob.synthetic.clips import make_clip
from batchjob.synthetic.trainer import SECONDS, burst_layout, closed_gop_decode_order, sample_clip


def test_closed_gop_decode_order_on_random_layouts(rng):
    rng = random.Random(int(rng.integers(2**32)))
    for _ in range(200):
        total = rng.randint(1, 300)
        keys = sorted({0} | {rng.randrange(total) for _ in range(rng.randint(0, 6))})
        bframes = rng.choice([0, 1, 2, 3])
        order = closed_gop_decode_order(keys, total, bframes)
        assert sorted(order) == list(range(total))
        for k in keys:
            assert order.index(k) == k                # closed GOPs: each one's pictures contiguous
        for j, i in enumerate(order):                 # a B-frame comes after the reference that closes its run
            if i not in keys:
                end = next((k for k in keys if k > i), total)
                ref = min(end - 1, i + bframes - (i - 1 - max(k for k in keys if k <= i)) % (bframes + 1))
                assert order.index(ref) <= j
        if bframes == 0:
            assert order == list(range(total))


def test_burst_layouts_are_what_pyav_burst_returns(tmp_path, rng):
    """On a real 60-frame clip with 2 B-frames and fixed GOPs, pyav_burst's default and capped frames are, to
    within one frame, among the layouts training draws for a clip of that length (x264 places its B-frames
    adaptively: a GOP's reference can come a frame earlier than the idealised order has it)."""
    rng = random.Random(int(rng.integers(2**32)))
    info = make_clip(tmp_path / "c.mp4", seconds=6, fps=10, gop_seconds=rng.choice([2.0, 3.0]), bframes=2,
                     width=64, height=48, seed=rng.randrange(1000))
    drawn = np.array(sorted({tuple(burst_layout(np.random.default_rng(seed), 60, 8)) for seed in range(3000)}))
    for kwargs in ({}, {"burst_pictures": 2}):
        _, meta = load_video(info.path, backend="pyav_burst", num_frames=8, **kwargs)
        assert meta["burst_mode"] == "bursts"
        apart = np.abs(drawn - np.array(meta["frames_indices"]))
        nearest = apart[np.argmin(apart.sum(axis=1))]
        assert nearest.max() <= 1 and nearest.sum() <= 2, (kwargs, meta["frames_indices"], nearest)


def test_burst_clips_tell_true_times(rng):
    for _ in range(20):
        scene, frames, meta = sample_clip(rng, 8, bursts=True)
        indices = meta["frames_indices"]
        assert frames.shape[0] == 8 and indices == sorted(indices) and indices[-1] < meta["total_num_frames"]
        assert SECONDS[0] - 1e-6 <= meta["duration"] <= SECONDS[1] + 1e-6
        np.testing.assert_allclose(meta["frames_timestamps"], np.array(indices) / meta["fps"])
