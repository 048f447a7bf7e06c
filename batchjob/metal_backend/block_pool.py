"""Physical KV blocks: allocation, reference counts and prefix sharing by content hash.

Every question about one clip starts with the same system prompt and the same video tokens. Hashing each
full block (its tokens, the media those tokens came from, and the previous block's hash) lets a later
question find the blocks an earlier one already computed and share them instead of recomputing the
vision-heavy prefix. Only blocks whose KV has been written (`mark_computed`) can be hit by hash, so a reader never
sees a block that another sequence is still filling. The one exception is asked for by name: a sequence computed
in the same forward pass as the sequence writing its prefix (`allocate(..., writer=, written=)`) may share the
blocks that pass writes, because every layer writes the pass's K/V before any of its attention reads it. Those
blocks are registered only when the writer's `mark_computed` says so; a pass that fails registers nothing.

Freed blocks go to one of two places: blocks holding no registered prefix go to a plain free list; blocks
that still hold a registered prefix go to an evictable list in least-recently-freed order. Allocation takes
plain free blocks first and evicts the oldest cached block only when it must.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict, deque
from dataclasses import dataclass
from typing import Hashable, Sequence

import numpy as np

MediaSpan = tuple[int, int, str]  # [start, end) token span whose content is the media item `media_id`


class PoolExhaustedError(RuntimeError):
    """The pool has too few free blocks for a sequence; the scheduler should wait or shrink the batch."""


@dataclass(frozen=True)
class SeqBlocks:
    """What `BlockPool.allocate` hands back: the block table and how many leading tokens are already in it."""

    block_table: list[int]
    num_cached_tokens: int


@dataclass
class _SeqState:
    block_table: list[int]
    block_hashes: list[bytes]  # hashes of the sequence's full blocks, in order
    num_registered: int  # leading blocks already registered (hits count as registered)
    num_tokens: int


@dataclass
class PoolStats:
    """Prefix-cache effectiveness, in tokens: `hit_tokens / query_tokens` is the hit rate."""

    query_tokens: int = 0
    hit_tokens: int = 0

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.query_tokens if self.query_tokens else 0.0


def media_hash_spans(
    token_ids: Sequence[int], placeholder_ids: int | Sequence[int], media_ids: Sequence[str]
) -> list[MediaSpan]:
    """Spans of media placeholder tokens, paired in order with the identity of the media they stand for.

    Why: video placeholder tokens carry the same id for every clip, so tokens alone cannot tell two clips
    apart. Each maximal run of placeholder tokens is one media item; the i-th run gets `media_ids[i]`.
    """
    placeholders = {placeholder_ids} if isinstance(placeholder_ids, int) else set(placeholder_ids)
    runs: list[tuple[int, int]] = []
    start = None
    for pos, tok in enumerate(token_ids):
        if tok in placeholders and start is None:
            start = pos
        elif tok not in placeholders and start is not None:
            runs.append((start, pos))
            start = None
    if start is not None:
        runs.append((start, len(token_ids)))
    if len(runs) != len(media_ids):
        raise ValueError(
            f"media_hash_spans: found {len(runs)} runs of placeholder tokens {sorted(placeholders)} but got "
            f"{len(media_ids)} media ids; pass one media id per video/image in the prompt, in prompt order"
        )
    return [(s, e, str(m)) for (s, e), m in zip(runs, media_ids)]


def hash_blocks(token_ids: Sequence[int], media: Sequence[MediaSpan], block_size: int,
                known: Sequence[bytes] = ()) -> list[bytes]:
    """Chain hashes of the full blocks of a prompt (a pure function, so tests can compare against it).

    Block i's hash covers its token ids, the ids of media spans overlapping it (with the overlap bounds, so
    a shifted span hashes differently) and block i-1's hash, so equal hashes mean equal whole prefixes.
    `known`: the hashes of the leading blocks, already computed for a prompt that agrees with this one that far
    (`shared_blocks`); the chain goes on from them.
    """
    hashes: list[bytes] = list(known)
    parent = hashes[-1] if hashes else b"batchjob-kv-v2"
    words = np.asarray(token_ids, dtype=np.int64)   # fixed-width bytes: no separator needed, no text built
    for i in range(len(hashes), len(words) // block_size):
        lo, hi = i * block_size, (i + 1) * block_size
        h = hashlib.sha256(parent)
        h.update(words[lo:hi].tobytes())
        for start, end, media_id in media:
            if start < hi and end > lo:
                h.update(f"|{max(start, lo) - lo}:{min(end, hi) - lo}:{media_id}".encode())
        parent = h.digest()
        hashes.append(parent)
    return hashes


def shared_blocks(words_a: np.ndarray, media_a: Sequence[MediaSpan], words_b: np.ndarray,
                  media_b: Sequence[MediaSpan], block_size: int) -> int:
    """How many leading full blocks two prompts hash alike: as far as their tokens agree and their media spans,
    clipped to that prefix, are the same. Why: a clip's questions share the video prefix, and hashing it once
    per clip instead of once per question saves most of the hashing."""
    n = min(len(words_a), len(words_b))
    differ = np.flatnonzero(words_a[:n] != words_b[:n])
    agree = int(differ[0]) if differ.size else n
    # Span pairs (in list order) must agree clipped to the prefix: both left out of it, or both in it alike.
    for a, b in zip(media_a, media_b):
        if a == b:
            continue
        if a[0] != b[0] or a[2] != b[2]:
            agree = min(agree, a[0], b[0])          # both must start past the prefix
        else:
            agree = min(agree, a[1], b[1])          # same start and media: alike up to the nearer end
    for extra in (*media_a[len(media_b):], *media_b[len(media_a):]):
        agree = min(agree, extra[0])
    return agree // block_size


def _check_media(media: Sequence[MediaSpan], num_tokens: int) -> None:
    for span in media:
        start, end, _ = span
        if not (0 <= start < end <= num_tokens):
            raise ValueError(
                f"media span {span} is outside the prompt of {num_tokens} tokens; spans are [start, end) "
                f"token positions with 0 <= start < end <= len(token_ids)"
            )


class BlockPool:
    """Fixed-size KV blocks shared by all sequences of one engine (host-side bookkeeping only)."""

    def __init__(self, num_blocks: int, block_size: int):
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"BlockPool needs num_blocks >= 1 and block_size >= 1, got {num_blocks}, {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._ref = [0] * num_blocks
        self._block_hash: list[bytes | None] = [None] * num_blocks
        self._by_hash: dict[bytes, int] = {}
        self._free: deque[int] = deque(range(num_blocks))
        self._evictable: OrderedDict[int, None] = OrderedDict()  # ref 0, still cached; oldest first
        self._seqs: dict[Hashable, _SeqState] = {}
        self._last_hashed: tuple[np.ndarray, tuple[MediaSpan, ...], list[bytes]] | None = None
        self.stats = PoolStats()

    # --- queries -------------------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        """Blocks an allocation may take: plain free ones plus cached ones it may evict."""
        return len(self._free) + len(self._evictable)

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def can_allocate(self, num_tokens: int) -> bool:
        """Conservative check (ignores prefix hits, which only lower the need)."""
        return self.blocks_needed(num_tokens) <= self.num_free_blocks

    def block_table(self, seq_id: Hashable) -> list[int]:
        return list(self._state(seq_id).block_table)

    def ref_count(self, block: int) -> int:
        return self._ref[block]

    def is_cached(self, block: int) -> bool:
        """True when the block holds a registered (committed, shareable) prefix."""
        return self._block_hash[block] is not None

    def cached_hash(self, block: int) -> bytes | None:
        """The prefix hash a cached block is registered under (None for private or free blocks)."""
        return self._block_hash[block]

    @property
    def seq_ids(self) -> list[Hashable]:
        return list(self._seqs)

    # --- mutations ------------------------------------------------------------------------------------
    def allocate(self, seq_id: Hashable, token_ids: Sequence[int], media: Sequence[MediaSpan] = (), *,
                 writer: Hashable | None = None, written: int = 0) -> SeqBlocks:
        """Give a new sequence its block table, reusing committed blocks of the longest matching prefix.

        At most `len(token_ids) - 1` tokens count as cached: the last token is always recomputed because its
        logits are the answer. `writer` (a sequence holding blocks) and `written`: past the committed hits, the
        prefix may go on through the writer's own blocks, as far as they match and lie within its first `written`
        tokens, which the caller guarantees are written in the forward pass this sequence joins (before any
        layer's attention reads them). Raises PoolExhaustedError without changing anything when blocks run short.
        """
        if seq_id in self._seqs:
            raise ValueError(f"sequence {seq_id!r} already holds blocks; free it before allocating it again")
        n = len(token_ids)
        if n == 0:
            raise ValueError(f"sequence {seq_id!r} has no tokens; a prompt needs at least one token")
        _check_media(media, n)
        words = np.array(token_ids, dtype=np.int64)   # a copy: kept below, whatever the caller does to its own
        known: list[bytes] = []
        if self._last_hashed is not None:   # the previous prompt (often the same clip's, another question)
            last_words, last_media, last_hashes = self._last_hashed
            known = last_hashes[:shared_blocks(last_words, last_media, words, media, self.block_size)]
        hashes = hash_blocks(words, media, self.block_size, known)
        self._last_hashed = (words, tuple(media), hashes)
        hits: list[int] = []
        for h in hashes[: (n - 1) // self.block_size]:
            block = self._by_hash.get(h)
            if block is None:
                break
            hits.append(block)
        if writer is not None:
            state = self._state(writer)
            limit = min((n - 1) // self.block_size, written // self.block_size, len(state.block_hashes))
            for i in range(len(hits), limit):
                if hashes[i] != state.block_hashes[i]:
                    break
                hits.append(state.block_table[i])
        need = self.blocks_needed(n) - len(hits)
        available = self.num_free_blocks - sum(1 for b in hits if self._ref[b] == 0)
        if need > available:
            raise PoolExhaustedError(
                f"KV pool exhausted: sequence {seq_id!r} ({n} tokens) needs {need} new blocks of "
                f"{self.block_size} tokens, {available} are free; wait for running sequences to finish, lower "
                f"the batch token budget, or raise the memory budget"
            )
        for b in hits:
            if self._ref[b] == 0:
                del self._evictable[b]
            self._ref[b] += 1
        fresh = [self._take_block() for _ in range(need)]
        self._seqs[seq_id] = _SeqState(hits + fresh, hashes, len(hits), n)
        cached = len(hits) * self.block_size
        self.stats.query_tokens += n
        self.stats.hit_tokens += cached
        return SeqBlocks(block_table=hits + fresh, num_cached_tokens=cached)

    def mark_computed(self, seq_id: Hashable, num_computed_tokens: int) -> None:
        """Record that KV for tokens [0, n) is written, making the full blocks in that range shareable."""
        state = self._state(seq_id)
        if not 0 <= num_computed_tokens <= state.num_tokens:
            raise ValueError(
                f"mark_computed({seq_id!r}, {num_computed_tokens}): must be between 0 and the sequence's "
                f"{state.num_tokens} tokens"
            )
        full = num_computed_tokens // self.block_size
        for i in range(state.num_registered, full):
            block, h = state.block_table[i], state.block_hashes[i]
            # Another sequence may have committed the same content first; keep that one as the shared copy
            # and leave this block private (it is freed normally).
            if h not in self._by_hash:
                self._by_hash[h] = block
                self._block_hash[block] = h
        state.num_registered = max(state.num_registered, full)

    def free(self, seq_id: Hashable) -> None:
        """Release a sequence's blocks; cached ones stay findable until evicted, LRU first."""
        state = self._seqs.pop(seq_id, None)
        if state is None:
            raise KeyError(f"sequence {seq_id!r} holds no blocks (never allocated or already freed)")
        # Tail blocks first: they are the least likely to be shared, so they should be evicted first.
        for block in reversed(state.block_table):
            self._ref[block] -= 1
            if self._ref[block] == 0:
                if self._block_hash[block] is not None:
                    self._evictable[block] = None
                else:
                    self._free.append(block)

    def _take_block(self) -> int:
        if self._free:
            block = self._free.popleft()
        else:
            block, _ = self._evictable.popitem(last=False)
            del self._by_hash[self._block_hash[block]]
            self._block_hash[block] = None
        self._ref[block] = 1
        return block

    def _state(self, seq_id: Hashable) -> _SeqState:
        try:
            return self._seqs[seq_id]
        except KeyError:
            raise KeyError(f"sequence {seq_id!r} holds no blocks (never allocated or already freed)") from None
