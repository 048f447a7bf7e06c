"""The per-clip vision feature cache: whole clips while in flight, then only the last partial block's rows."""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from batchjob.engine.video_features import VideoFeatureCache


def test_keeps_whole_clip_then_tail_then_evicts_lru(rng):
    cache = VideoFeatureCache(block_size=16, max_tails=2)
    features = mx.array(rng.standard_normal((40, 8)).astype(np.float32))
    cache.put_clip("a", features)
    assert cache.get("a", 0, 40) is not None and cache.get("b", 0, 1) is None
    cache.release_clip("a", video_span=(10, 50), keep_tail=True)  # video tokens at prompt positions 10..49
    # The last full block boundary inside the video is position 48 -> rows 38, 39 are kept.
    tail = cache.get("a", 38, 40)
    assert tail is not None and tail.first_row == 38
    np.testing.assert_array_equal(np.array(tail.slice(38, 40)), np.array(features[38:40]))
    assert cache.get("a", 37, 40) is None  # rows before the tail need the tower again
    for key in ("b", "c"):
        cache.put_clip(key, features)
        cache.release_clip(key, (10, 50), keep_tail=True)
    assert cache.get("a", 38, 40) is None  # least recently used tail evicted
    cache.put_clip("d", features)
    cache.release_clip("d", (10, 50), keep_tail=False)
    assert cache.get("d", 38, 40) is None
    cache.put_clip("e", features[:6])
    cache.release_clip("e", (10, 16), keep_tail=True)  # video ends on a block boundary: nothing to keep
    assert cache.get("e", 5, 6) is None
