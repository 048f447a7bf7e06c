"""Block pool: property tests over random allocate/compute/free sequences, plus the prefix-hit rules."""

from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

import numpy as np

from batchjob.metal_backend import BlockPool, PoolExhaustedError, hash_blocks, media_hash_spans
from batchjob.metal_backend.block_pool import shared_blocks

BS = 4
# A tiny alphabet of prompts so that prefixes collide often: shared system prompt, two clips, two questions.
PREFIXES = [[1, 2, 3, 4, 5, 6, 7, 8], [1, 2, 3, 4, 9, 9, 9, 9], [9, 9, 9, 9, 9, 9, 9, 9]]
MEDIA_IDS = ["clipA", "clipB"]


@st.composite
def prompts(draw):
    base = list(draw(st.sampled_from(PREFIXES)))
    tail = draw(st.lists(st.integers(0, 3), max_size=10))
    tokens = base + tail
    media = ()
    if draw(st.booleans()):
        start = draw(st.integers(0, len(tokens) - 1))
        end = draw(st.integers(start + 1, len(tokens)))
        media = ((start, end, draw(st.sampled_from(MEDIA_IDS))),)
    return tokens, media


def prefix_content(tokens, media, end: int) -> tuple:
    """What a block's KV depends on: every token up to its end and the media spans clipped to that prefix."""
    return tuple(tokens[:end]), tuple((s, min(e, end), m) for s, e, m in media if s < end)


class PoolMachine(RuleBasedStateMachine):
    """Model: which tokens each live sequence holds and how far its KV is written."""

    def __init__(self):
        super().__init__()
        self.pool = BlockPool(num_blocks=12, block_size=BS)
        self.live: dict[int, tuple[list[int], tuple, int]] = {}  # seq -> (tokens, media, computed)
        self.writers: dict[int, int] = {}  # block -> seq that will write it (not yet committed)
        self.content: dict[int, tuple] = {}  # block -> (prefix tokens, media in prefix) last written there
        self.next_id = 0

    @rule(prompt=prompts())
    def allocate(self, prompt):
        tokens, media = prompt
        seq = self.next_id
        self.next_id += 1
        free_before = self.pool.num_free_blocks
        try:
            got = self.pool.allocate(seq, tokens, media)
        except PoolExhaustedError:
            assert self.pool.num_free_blocks == free_before  # a refused allocation changes nothing
            assert not self.pool.can_allocate(len(tokens))
            return
        assert len(got.block_table) == -(-len(tokens) // BS)
        assert got.num_cached_tokens % BS == 0 and got.num_cached_tokens <= len(tokens) - 1
        # A hit only reuses blocks committed by a live or freed sequence with the same tokens and media:
        # checked against the recorded content itself, not against the hashes.
        mine = hash_blocks(tokens, media, BS)
        for i in range(got.num_cached_tokens // BS):
            block = got.block_table[i]
            assert self.pool.is_cached(block) and block not in self.writers
            assert self.content[block] == prefix_content(tokens, media, (i + 1) * BS)
            assert self.pool.cached_hash(block) == mine[i]
        for block in got.block_table[got.num_cached_tokens // BS :]:
            assert self.pool.ref_count(block) == 1  # fresh blocks are exclusively ours
            self.writers[block] = seq
        self.live[seq] = (tokens, media, got.num_cached_tokens)

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def compute(self, data):
        seq = data.draw(st.sampled_from(sorted(self.live)))
        tokens, media, done = self.live[seq]
        n = data.draw(st.integers(done, len(tokens)))
        self.pool.mark_computed(seq, n)
        table = self.pool.block_table(seq)
        for i in range(n // BS):
            if self.writers.get(table[i]) == seq:
                del self.writers[table[i]]
                self.content[table[i]] = prefix_content(tokens, media, (i + 1) * BS)
        self.live[seq] = (tokens, media, n)

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def free(self, data):
        seq = data.draw(st.sampled_from(sorted(self.live)))
        table = self.pool.block_table(seq)
        self.pool.free(seq)
        del self.live[seq]
        for b in table:
            if self.writers.get(b) == seq:
                del self.writers[b]

    @invariant()
    def no_leak_no_double_owner(self):
        held = Counter(b for s in self.live for b in self.pool.block_table(s))
        for b in range(self.pool.num_blocks):
            assert self.pool.ref_count(b) == held.get(b, 0), f"block {b}: ref count vs owners"
        for s in self.live:
            table = self.pool.block_table(s)
            assert len(set(table)) == len(table), "a block appears twice in one table"
        # every block is exactly one of: held, free, or evictable-cached
        assert self.pool.num_free_blocks + len(held) == self.pool.num_blocks
        # a block still being written belongs to exactly one sequence
        for b, seq in self.writers.items():
            assert held[b] == 1 and b in self.pool.block_table(seq)


PoolMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=30, deadline=None)
test_pool_state_machine = PoolMachine.TestCase


def test_prefix_hit_needs_same_tokens_and_same_media():
    pool = BlockPool(num_blocks=32, block_size=BS)
    tokens = [7] * 8 + [1, 2, 3, 4, 5]
    a = pool.allocate("a", tokens, [(0, 8, "clipA")])
    pool.mark_computed("a", len(tokens))
    same = pool.allocate("same", tokens, [(0, 8, "clipA")])
    assert same.num_cached_tokens == 12 and same.block_table[:3] == a.block_table[:3]
    other_clip = pool.allocate("other", tokens, [(0, 8, "clipB")])
    assert other_clip.num_cached_tokens == 0
    shifted = pool.allocate("shifted", tokens, [(1, 8, "clipA")])
    assert shifted.num_cached_tokens == 0
    other_tail = pool.allocate("tail", tokens[:8] + [1, 2, 3, 9, 5], [(0, 8, "clipA")])
    assert other_tail.num_cached_tokens == 8


def test_uncommitted_blocks_are_never_hit_and_last_token_is_recomputed():
    pool = BlockPool(num_blocks=16, block_size=BS)
    tokens = list(range(8))
    pool.allocate("writer", tokens)
    assert pool.allocate("early", tokens).num_cached_tokens == 0  # KV not written yet
    pool.mark_computed("writer", 8)
    whole = pool.allocate("whole", tokens)
    assert whole.num_cached_tokens == 4  # fully cached prompt: last block recomputed for its logits
    assert pool.stats.query_tokens == 24 and pool.stats.hit_tokens == 4


def test_freed_cached_blocks_are_reused_lru_after_plain_free_ones():
    pool = BlockPool(num_blocks=7, block_size=BS)
    for name, tok in [("old", 1), ("new", 2)]:
        pool.allocate(name, [tok] * 5)  # one full (cached) block + one partial block each
        pool.mark_computed(name, 5)
    pool.free("old")
    pool.free("new")
    assert pool.num_free_blocks == 7
    # 5 plain free blocks are taken first; the sixth must evict a cached block: the least recently freed
    pool.allocate("big", list(range(100, 124)))
    pool.free("big")
    assert pool.allocate("new again", [2] * 5).num_cached_tokens == 4
    assert pool.allocate("old again", [1] * 5).num_cached_tokens == 0


def test_errors_name_the_problem():
    pool = BlockPool(num_blocks=2, block_size=BS)
    with pytest.raises(PoolExhaustedError, match="needs 3 new blocks"):
        pool.allocate("x", list(range(9)))
    with pytest.raises(ValueError, match="no tokens"):
        pool.allocate("x", [])
    with pytest.raises(ValueError, match="outside the prompt"):
        pool.allocate("x", [1, 2], [(1, 5, "clip")])
    pool.allocate("x", [1])
    with pytest.raises(ValueError, match="already holds blocks"):
        pool.allocate("x", [1])
    with pytest.raises(KeyError, match="holds no blocks"):
        pool.free("nope")
    with pytest.raises(ValueError, match="between 0 and"):
        pool.mark_computed("x", 2)


def test_media_hash_spans_pairs_runs_with_ids():
    toks = [1, 5, 5, 5, 2, 6, 6, 3, 5]
    assert media_hash_spans(toks, [5, 6], ["a", "b", "c"]) == [(1, 4, "a"), (4 + 1, 7, "b"), (8, 9, "c")]
    with pytest.raises(ValueError, match="one media id per video"):
        media_hash_spans(toks, 5, ["a"])


def test_duplicate_content_computed_twice_keeps_one_shared_copy():
    """Two sequences with the same prompt computed concurrently: the first commit wins, the other block stays
    private; evicting everything later must not trip over the duplicate."""
    pool = BlockPool(num_blocks=6, block_size=BS)
    a, b = pool.allocate("a", [3] * 9), pool.allocate("b", [3] * 9)
    assert b.num_cached_tokens == 0  # nothing committed yet
    pool.mark_computed("a", 9)
    pool.mark_computed("b", 9)
    assert pool.is_cached(a.block_table[0]) and not pool.is_cached(b.block_table[0])
    pool.free("a")
    pool.free("b")
    pool.allocate("evict all", list(range(24)))
    pool.free("evict all")
    assert pool.num_free_blocks == 6 and not any(pool.is_cached(i) for i in range(6))
    assert pool.allocate("again", [3] * 9).num_cached_tokens == 0


def test_a_pass_mate_shares_what_its_writer_writes_in_that_pass_and_nothing_is_registered_before():
    """`allocate(..., writer=, written=)`: past the committed hits, the blocks the writer fills by the end of the
    pass (its first `written` tokens), as far as the content matches; nothing findable by hash until the writer
    commits, so a failed pass leaves no trace."""
    pool = BlockPool(num_blocks=24, block_size=BS)
    system, video = [1, 2, 3, 4], [9] * 8
    media = ((4, 12, "clipA"),)
    leader = system + video + [5, 6, 7]
    follower = system + video + [8, 7, 6, 5, 4]
    lead = pool.allocate("L", leader, media)
    assert lead.num_cached_tokens == 0
    for written in range(len(leader) + 1):
        got = pool.allocate("F", follower, media, writer="L", written=written)
        shared = min(written // BS, 3)   # system and video: three full blocks in common
        assert got.num_cached_tokens == shared * BS
        assert got.block_table[:shared] == lead.block_table[:shared]
        assert set(got.block_table[shared:]).isdisjoint(lead.block_table)
        assert [pool.ref_count(b) for b in lead.block_table[:shared]] == [2] * shared
        pool.free("F")
    other = pool.allocate("O", system + video + [8], ((4, 12, "clipB"),), writer="L", written=len(leader))
    assert other.num_cached_tokens == BS   # the system prompt only: another clip's video
    pool.free("O")
    assert not any(pool.is_cached(b) for b in lead.block_table)   # not before the writer commits

    pool.allocate("F", follower, media, writer="L", written=len(leader))
    pool.free("F")
    pool.free("L")   # the pass failed: nothing was committed
    assert pool.allocate("X", follower, media).num_cached_tokens == 0
    pool.free("X")

    lead = pool.allocate("L2", leader, media)
    got = pool.allocate("F2", follower, media, writer="L2", written=len(leader))
    pool.mark_computed("L2", len(leader))
    pool.mark_computed("F2", len(follower))
    assert all(pool.is_cached(b) for b in lead.block_table[:3]) and got.block_table[:3] == lead.block_table[:3]
    pool.free("L2")
    pool.free("F2")
    assert pool.allocate("Y", follower, media).num_cached_tokens == 4 * BS   # by hash now (F2 committed block 4)


def _derived_prompt(rng, tokens: list[int], media: list) -> tuple[list[int], list]:
    """Another prompt sharing a random prefix with (tokens, media): tokens cut and changed past a point, spans
    shifted, renamed, cut short, dropped or added there (in any order, overlapping or not)."""
    cut = int(rng.integers(0, len(tokens) + 1))
    new_tokens = tokens[:cut] + [int(t) for t in rng.integers(0, 6, int(rng.integers(0, 40)))]
    new_media = []
    for s, e, m in media:
        change = rng.integers(0, 6)
        if change == 0:
            s, e = s + 1, e + 1
        elif change == 1:
            m = m + "'"
        elif change == 2:
            e = max(s + 1, e - int(rng.integers(1, 9)))
        elif change == 3:
            continue
        new_media.append((s, e, m))
    if new_tokens and rng.random() < 0.3:
        s = int(rng.integers(0, len(new_tokens)))
        new_media.append((s, s + int(rng.integers(1, 20)), "extra"))
    if rng.random() < 0.2:
        new_media.reverse()
    n = len(new_tokens)
    return new_tokens, [(s, min(e, n), m) for s, e, m in new_media if s < n]


def test_hashes_carried_over_from_a_shared_prefix_equal_the_whole_chain(rng):
    """hash_blocks continued from `shared_blocks` of an earlier prompt's hashes equals the chain hashed from the
    start, for random pairs (tokens and media changed past random points); for ordered, disjoint spans (what
    media_hash_spans makes) it carries over every leading block the two chains agree on."""
    carried = 0
    for trial in range(400):
        bs = int(rng.integers(1, 9))
        tokens = [int(t) for t in rng.integers(0, 6, int(rng.integers(1, 120)))]
        media, pos = [], 0
        while pos < len(tokens) - 1 and rng.random() < 0.7:
            s = int(rng.integers(pos, len(tokens)))
            e = int(rng.integers(s + 1, len(tokens) + 1))
            media.append((s, e, f"clip{int(rng.integers(0, 3))}"))
            pos = e
        other, other_media = _derived_prompt(rng, tokens, media)
        if not other:
            continue
        whole_a = hash_blocks(tokens, media, bs)
        whole_b = hash_blocks(other, other_media, bs)
        k = shared_blocks(np.asarray(tokens), media, np.asarray(other), other_media, bs)
        assert hash_blocks(other, other_media, bs, known=whole_a[:k]) == whole_b, trial
        agree = next((i for i, (x, y) in enumerate(zip(whole_a, whole_b)) if x != y), min(len(whole_a), len(whole_b)))
        assert k <= agree
        ordered = all(a[1] <= b[0] for a, b in zip(other_media, other_media[1:]))
        if ordered:
            assert k == agree, trial
        carried += k
    assert carried > 0


def test_a_clips_questions_hash_the_video_once(monkeypatch):
    """The pool carries the video prefix's hashes from one question to the next of the same clip (and the hits
    are those of hashing from scratch)."""
    import batchjob.metal_backend.block_pool as bp

    hashed: list[int] = []
    real = bp.hash_blocks

    def counting(token_ids, media, block_size, known=()):
        hashed.append(len(token_ids) // block_size - len(known))
        return real(token_ids, media, block_size, known)

    monkeypatch.setattr(bp, "hash_blocks", counting)
    pool = BlockPool(num_blocks=64, block_size=4)
    video = [7] * 40
    for q, question in enumerate(([1, 2, 3], [4, 5, 6, 7], [8])):
        tokens = [1, 2] + video + question
        got = pool.allocate(q, tokens, [(2, 42, "clipA")])
        assert got.num_cached_tokens == (0 if q == 0 else 40)
        pool.mark_computed(q, len(tokens))
    assert hashed[0] == (2 + 40 + 3) // 4
    assert hashed[1:] == [len([1, 2] + video + [4, 5, 6, 7]) // 4 - 10, len([1, 2] + video + [8]) // 4 - 10]
