"""Vision-tower outputs kept per clip, so the tower runs once per clip rather than once per question.

While a clip's requests are in flight the whole feature matrix is kept (chunked prefill and questions
admitted later in the same call read from it). When the clip's last request finishes only a tail is kept:
the rows of the video's last, partial KV block. A later question about the clip hits the prefix cache up to
a block boundary, so those rows are the only video rows it recomputes; with the tail at hand it needs no
vision run at all. If the prefix blocks were evicted meanwhile, the tail does not cover the rows needed
and the tower simply runs again.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import mlx.core as mx
import numpy as np


@dataclass(frozen=True)
class FeatureRows:
    """Rows `[first_row, first_row + len(rows))` of one clip's features (row i = video token i)."""

    first_row: int
    rows: mx.array

    def covers(self, lo: int, hi: int) -> bool:
        return self.first_row <= lo and hi <= self.first_row + self.rows.shape[0]

    def slice(self, lo: int, hi: int) -> mx.array:
        return self.rows[lo - self.first_row:hi - self.first_row]


def tail_first_row(video_rows: np.ndarray, video_span: tuple[int, int], block_size: int) -> int:
    """First feature row of the video's last partial KV block: video tokens before that block's start."""
    boundary = video_span[1] // block_size * block_size
    return int((np.asarray(video_rows[:boundary]) >= 0).sum())


class VideoFeatureCache:
    def __init__(self, block_size: int, max_tails: int = 1024):
        self.block_size = block_size
        self.max_tails = max_tails
        self._clips: dict[str, FeatureRows] = {}  # clips with requests in flight
        self._tails: OrderedDict[str, FeatureRows] = OrderedDict()  # finished clips, LRU

    def get(self, key: str, lo: int, hi: int) -> FeatureRows | None:
        """Features covering video rows [lo, hi) of clip `key`, or None when the tower must run."""
        for found in (self._clips.get(key), self._tails.get(key)):
            if found is not None and found.covers(lo, hi):
                if key in self._tails:
                    self._tails.move_to_end(key)
                return found
        return None

    def holds(self, key: str) -> bool:
        """Whether anything of clip `key` is kept (its features while in flight, or its tail)."""
        return key in self._clips or key in self._tails

    def put_clip(self, key: str, features: mx.array) -> FeatureRows:
        self._clips[key] = FeatureRows(0, features)
        return self._clips[key]

    def release_clip(self, key: str, first_row: int, keep_tail: bool) -> None:
        """The clip's requests are done: drop its features, keeping rows from `first_row` on (the video rows
        of the last, partial KV block: see `tail_first_row`)."""
        full = self._clips.pop(key, None)
        if full is None or not keep_tail:
            return
        first = max(0, first_row)
        if first < full.rows.shape[0]:
            # A copy of its own on the device: a slice would keep the whole matrix alive. `mx.contiguous` copies a
            # slice of a much larger buffer (MLX shares the buffer only when it is about the slice's size), and the
            # copy is started, not waited for (a round trip through the host cost a sync per clip); the matrix is
            # freed once the copy has run.
            tail = mx.contiguous(full.rows[first:])
            mx.async_eval(tail)
            self._tails[key] = FeatureRows(first, tail)
            self._tails.move_to_end(key)
            while len(self._tails) > self.max_tails:
                self._tails.popitem(last=False)
