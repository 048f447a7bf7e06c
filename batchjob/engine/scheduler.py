"""Which tokens go into the next forward pass (host-side bookkeeping only, no MLX).

nano-vllm's shape: a waiting queue, a running list, a token budget per step, chunked prefill. Prefill-only
makes it simpler: a sequence leaves as soon as its last prompt token is computed.

Per-clip sharing: the first request of a clip (its *leader*) computes the shared prefix (system prompt +
video); the clip's other requests (its *followers*) compute only their own question over the leader's blocks.
A follower joins the very pass in which the leader's writes reach past the end of the video: each layer of a
pass writes all its K/V before its attention reads any, so the follower reads blocks written moments before
(`BlockPool.allocate`'s `writer`). Until that pass it waits; later it finds the committed blocks by hash.
Why the same pass: a pass of followers alone is a few hundred tokens, too little work for a GPU to hide the
host's building of its layers, and it costs one more schedule, metadata and sync. Requests of other clips are
not held back meanwhile.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from batchjob.metal_backend import BlockPool, PoolExhaustedError, SeqSlice


@dataclass
class Sequence:
    """One request in flight: its prompt, its M-RoPE positions, and how far its prefill has got."""

    index: int  # position in the caller's request list
    seq_id: str
    media_key: str  # identity of the video content (media_id, or unique per request when sharing is off)
    token_ids: np.ndarray  # int64 [L]
    positions: np.ndarray  # int64 [3, L]
    video_span: tuple[int, int]  # [start, end) of the video placeholder tokens
    option_token_ids: list[int]
    share_prefix: bool = True  # False: hash the whole prompt with the (unique) media key, so nothing is shared
    grid_thw: tuple[int, int, int] = (0, 0, 0)
    # int32 [L]: the clip's feature row of each video token, -1 for text (Qwen3-VL interleaves timestamps)
    video_rows: np.ndarray | None = None
    num_computed: int = 0
    num_cached: int = 0
    block_table: list[int] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def remaining(self) -> int:
        return self.num_tokens - self.num_computed

    def rows_between(self, lo: int, hi: int) -> tuple[int, int]:
        """[first, end) feature rows of the video tokens among prompt tokens [lo, hi) (empty: first == end)."""
        rows = self.video_rows[lo:hi]
        rows = rows[rows >= 0]
        return (int(rows[0]), int(rows[-1]) + 1) if len(rows) else (0, 0)

    @property
    def prefix_done(self) -> bool:
        return self.num_computed >= self.video_span[1]


@dataclass(frozen=True)
class ScheduledSlice:
    seq: Sequence
    num_new: int  # tokens [seq.num_computed, seq.num_computed + num_new) are computed in this step

    @property
    def is_last_chunk(self) -> bool:
        return self.seq.num_computed + self.num_new == self.seq.num_tokens

    def attention_slice(self) -> SeqSlice:
        return SeqSlice(self.seq.block_table, self.seq.num_computed, self.num_new)


class _Wait(Exception):
    """A follower whose leader has not written its video's blocks, even by the end of the pass being scheduled."""


class Scheduler:
    def __init__(self, pool: BlockPool, max_num_batched_tokens: int):
        self.pool = pool
        self.budget = max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        # media_key -> the clip's first admitted sequence, which computes its shared prefix; kept for the
        # scheduler's life (one classify call): once `prefix_done`, the clip's followers are unblocked
        self._leaders: dict[str, Sequence] = {}

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def has_leader(self, media_key: str) -> bool:
        """Whether a sequence of this clip was admitted in this call (it computes, or computed, the shared prefix)."""
        return media_key in self._leaders

    def _writer(self, seq: Sequence, taken: dict[str, int]) -> tuple[Sequence | None, int]:
        """(the leader whose blocks `seq` reads in this pass, how many of its tokens are written by the pass's end),
        or (None, 0) when `seq` leads or its leader finished the prefix in an earlier pass. Raises `_Wait` while
        the leader's writes, this pass included, stop short of the video's end."""
        leader = self._leaders.get(seq.media_key)
        if leader is None or leader is seq or leader.prefix_done:
            return None, 0
        written = leader.num_computed + taken.get(leader.seq_id, 0)
        if written < leader.video_span[1]:
            raise _Wait
        return leader, written

    def schedule(self, refill: Callable[[], bool] | None = None) -> list[ScheduledSlice]:
        """Running sequences continue first (oldest first), then waiting ones are admitted in order. When the waiting
        ones run out before the budget does, `refill` (if given) adds more and says whether any may follow: the
        caller's prompts are built ahead on an estimate of their new tokens, which a cached prefix makes short."""
        budget = self.budget
        batch: list[ScheduledSlice] = []
        taken: dict[str, int] = {}   # new tokens of each sequence in this pass
        for seq in self.running:
            if budget == 0:
                break
            take = min(seq.remaining, budget)
            batch.append(ScheduledSlice(seq, take))
            taken[seq.seq_id] = take
            budget -= take
        skipped: deque[Sequence] = deque()
        while budget > 0:
            if not self.waiting:
                if refill is None or not refill():
                    break
                continue
            seq = self.waiting.popleft()
            try:
                writer, written = self._writer(seq, taken)
            except _Wait:
                skipped.append(seq)
                continue
            span = seq.video_span if seq.share_prefix else (0, seq.num_tokens)
            media = [(span[0], span[1], seq.media_key)]
            try:
                alloc = self.pool.allocate(seq.seq_id, seq.token_ids, media,
                                           writer=writer.seq_id if writer else None, written=written)
            except PoolExhaustedError:
                if not self.running and not batch:
                    raise  # nothing will ever free blocks: the pool cannot hold this request at all
                skipped.append(seq)
                break
            seq.block_table, seq.num_cached = alloc.block_table, alloc.num_cached_tokens
            seq.num_computed = alloc.num_cached_tokens
            self.running.append(seq)
            self._leaders.setdefault(seq.media_key, seq)
            take = min(seq.remaining, budget)
            batch.append(ScheduledSlice(seq, take))
            taken[seq.seq_id] = take
            budget -= take
        self.waiting.extendleft(reversed(skipped))
        return batch

    def finish_step(self, batch: list[ScheduledSlice]) -> list[Sequence]:
        """Advance the scheduled sequences, commit their KV blocks, free and return the finished ones."""
        finished = []
        for item in batch:
            seq = item.seq
            seq.num_computed += item.num_new
            self.pool.mark_computed(seq.seq_id, seq.num_computed)
            if seq.remaining == 0:
                finished.append(seq)
        for seq in finished:
            self.running.remove(seq)
            self.pool.free(seq.seq_id)
        return finished

    def abort_all(self) -> None:
        """Free every allocated sequence (after an exception) so the pool stays consistent for the next call."""
        for seq in self.running:
            self.pool.free(seq.seq_id)
        self.running.clear()
        self.waiting.clear()
        self._leaders.clear()
