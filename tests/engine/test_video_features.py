"""The per-clip vision feature cache: whole clips while in flight, then only the last partial block's rows."""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from batchjob.engine.families import video_rows
from batchjob.engine.video_features import VideoFeatureCache, tail_first_row


def _rows(span):
    """video_rows of a prompt whose video tokens fill `span` (Qwen2-VL layout)."""
    ids = np.zeros(span[1] + 5, np.int64)
    ids[span[0]:span[1]] = 7
    return video_rows(ids, 7)


def _release(cache, key, span, keep_tail):
    cache.release_clip(key, tail_first_row(_rows(span), span, cache.block_size), keep_tail=keep_tail)


def test_tail_first_row_counts_video_tokens_not_positions():
    # Qwen3-VL layout: timestamp text and vision_start/end tokens between the groups of 4 video tokens.
    ids = np.array([1, 1, 9, 9, 3, 7, 7, 7, 7, 4, 9, 9, 3, 7, 7, 7, 7, 4, 5, 5])
    rows = video_rows(ids, 7)
    assert rows.tolist() == [-1] * 5 + [0, 1, 2, 3] + [-1] * 4 + [4, 5, 6, 7] + [-1] * 3
    assert tail_first_row(rows, (5, 17), 8) == 7  # the last partial block starts at position 16: row 7
    assert tail_first_row(rows, (5, 17), 12) == 4  # ... at position 12, in the text between the groups


def test_keeps_whole_clip_then_tail_then_evicts_lru(rng):
    cache = VideoFeatureCache(block_size=16, max_tails=2)
    features = mx.array(rng.standard_normal((40, 8)).astype(np.float32))
    cache.put_clip("a", features)
    assert cache.get("a", 0, 40) is not None and cache.get("b", 0, 1) is None
    _release(cache, "a", (10, 50), keep_tail=True)  # video tokens at prompt positions 10..49
    # The last full block boundary inside the video is position 48 -> rows 38, 39 are kept.
    tail = cache.get("a", 38, 40)
    assert tail is not None and tail.first_row == 38
    np.testing.assert_array_equal(np.array(tail.slice(38, 40)), np.array(features[38:40]))
    assert cache.get("a", 37, 40) is None  # rows before the tail need the tower again
    for key in ("b", "c"):
        cache.put_clip(key, features)
        _release(cache, key, (10, 50), keep_tail=True)
    assert cache.get("a", 38, 40) is None  # least recently used tail evicted
    cache.put_clip("d", features)
    _release(cache, "d", (10, 50), keep_tail=False)
    assert cache.get("d", 38, 40) is None
    cache.put_clip("e", features[:6])
    _release(cache, "e", (10, 16), keep_tail=True)  # video ends on a block boundary: nothing to keep
    assert cache.get("e", 5, 6) is None


def test_a_kept_tail_holds_its_own_rows_not_the_clips_matrix(rng):
    """The tail is a copy on the device: once the clip's matrix has no other holder its memory is freed (a slice
    would keep the whole matrix alive for as long as the tail stays cached), and the tail's values are the rows'."""
    import gc

    gc.collect()
    base = mx.get_active_memory()
    cache = VideoFeatureCache(block_size=16)
    rows = int(rng.integers(2000, 4000))
    features = mx.array(rng.standard_normal((rows, 512)).astype(np.float32)).astype(mx.bfloat16)   # 2-4 MB
    mx.eval(features)
    want = np.array(features[-9:].astype(mx.float32))
    cache.put_clip("a", features)
    del features
    cache.release_clip("a", rows - 9, keep_tail=True)
    tail = cache.get("a", rows - 9, rows)
    assert tail is not None and tail.first_row == rows - 9
    np.testing.assert_array_equal(np.array(tail.slice(rows - 9, rows).astype(mx.float32)), want)
    gc.collect()
    held = mx.get_active_memory() - base
    assert held < 64 * 1024, held   # the tail's 9 rows (9 KB) and not the matrix (megabytes)
