"""Grouped SDPA calls (attention_plan): exact against the float64 dense per-sequence reference on random ragged
batches, the plan's own invariants, and the number of SDPA calls a packed batch costs per layer."""

from __future__ import annotations

import functools

import mlx.core as mx
import numpy as np
import pytest

from batchjob.metal_backend import SeqSlice, build_attention_metadata, paged_attention
from batchjob.metal_backend.attention_plan import (FOLD_SLACK, GPU_SHAPE_BUCKETS, PAD_SLACK, bucketed, causal_work,
                                                    padded_groups, plan_attention, stack_folds)
from batchjob.metal_backend.probe import make_ragged_batch

SETTINGS = {  # the CPU's defaults, CUDA's and Metal's (bf16) settings, and small chunks and coarse buckets that
    # force every path at once
    "cpu": dict(),
    "gpu": dict(query_chunk=4096, group_rows=1 << 16, contiguous_kv=False, fold_followers=True,
                shape_buckets=GPU_SHAPE_BUCKETS),
    "metal": dict(query_chunk=4096, group_rows=1 << 16, contiguous_kv=False, fold_followers=True),
    "tight": dict(query_chunk=24, group_rows=40, fold_followers=True, shape_buckets=2),
}


def new_kv_of(batch):
    """This layer's new K/V as the engine hands them over: the cache rows at each new token's slot."""
    _, bs, hkv, d = batch.k_cache.shape
    slots = batch.meta.slot_mapping
    return (batch.k_cache.reshape(-1, hkv, d)[slots], batch.v_cache.reshape(-1, hkv, d)[slots])


def ragged_batch_spec(rng: np.random.Generator, block_size: int) -> tuple[list[int], list[int]]:
    """Sequences drawn to hit every kind of call: equal-shape runs (fresh and over a shared prefix length),
    near-equal query lengths over one prefix (padded groups), one-token queries, a long prompt, odd sizes."""
    q_lens, cached = [], []
    for _ in range(int(rng.integers(1, 4))):  # runs of equal shape
        n, q, c = int(rng.integers(2, 5)), int(rng.integers(2, 30)), int(rng.choice([0, 0, block_size, 37]))
        q_lens += [q] * n
        cached += [c] * n
    prefix = int(rng.integers(1, 80))  # followers: short questions of similar length after one cached prefix
    for _ in range(int(rng.integers(0, 5))):
        q_lens.append(int(rng.integers(8, 12)))
        cached.append(prefix)
    for _ in range(int(rng.integers(0, 4))):  # one-token queries (decode groups, or alone)
        q_lens.append(1)
        cached.append(int(rng.integers(0, 60)))
    if rng.random() < 0.5:  # a prompt much longer than the rest (never padded to, chunked under "tight")
        q_lens.append(int(rng.integers(60, 120)))
        cached.append(int(rng.choice([0, 5])))
    order = rng.permutation(len(q_lens))
    return [q_lens[i] for i in order], [cached[i] for i in order]


def clip_followers(rng, q_lens, cached, block_size):
    """Mark runs of followers with one cached prefix as the followers of one clip (sharing its cached full
    blocks), as the pool lays them out; others (and every sequence sometimes) stay unshared."""
    groups = [-1] * len(q_lens)
    by_prefix = {}
    for i, (q, c) in enumerate(zip(q_lens, cached)):
        if c >= block_size and q > 1:
            by_prefix.setdefault(c, []).append(i)
    for g, members in enumerate(by_prefix.values()):
        if rng.random() < 0.8:
            for i in members:
                groups[i] = g
    shared = min((cached[i] for i, g in enumerate(groups) if g >= 0), default=0) // block_size
    return groups, shared


@pytest.mark.parametrize("setting", sorted(SETTINGS))
@pytest.mark.parametrize("with_new_kv", [True, False])
@pytest.mark.parametrize("trial", range(3))
def test_grouped_attention_matches_dense_per_sequence_reference(rng, dense_reference, setting, with_new_kv, trial):
    block_size = int(rng.choice([8, 16]))
    gqa, num_kv_heads, head_dim = int(rng.choice([1, 2, 4])), int(rng.choice([1, 2])), int(rng.choice([32, 64]))
    q_lens, cached = ragged_batch_spec(rng, block_size)
    groups, shared = clip_followers(rng, q_lens, cached, block_size)
    batch = make_ragged_batch(rng, q_lens, cached, num_q_heads=gqa * num_kv_heads, num_kv_heads=num_kv_heads,
                              head_dim=head_dim, block_size=block_size, shuffle_blocks=bool(rng.random() < 0.7),
                              prefix_groups=groups, shared_blocks=shared)
    scale = head_dim**-0.5
    fn = functools.partial(paged_attention, **SETTINGS[setting])
    out = fn(batch.q, batch.k_cache, batch.v_cache, batch.meta, scale,
             new_kv=new_kv_of(batch) if with_new_kv else None)
    assert out.shape == batch.q.shape and out.dtype == mx.float32
    err = np.abs(np.array(out).astype(np.float64) - dense_reference(batch, scale)).max()
    assert err < 1e-5, f"max abs error {err} for q_lens={q_lens} cached={cached} ({setting})"
    per_sequence = paged_attention(batch.q, batch.k_cache, batch.v_cache, batch.meta, scale, group_rows=1)
    assert np.abs(np.array(out) - np.array(per_sequence)).max() < 1e-5


def check_plan(plan, q_lens, cached, *, query_chunk, group_rows, pad_slack=PAD_SLACK, buckets=0):
    """Invariants every plan must keep, checked from the calls alone."""
    cu = np.concatenate([[0], np.cumsum(q_lens)])
    seen = np.concatenate([c.out_tokens[c.out_tokens >= 0] for c in plan.calls])
    assert sorted(seen.tolist()) == list(range(int(cu[-1]))), "every token computed exactly once"
    stacked = np.concatenate([c.out_tokens for c in plan.calls])
    order = np.arange(len(stacked)) if plan.inverse is None else plan.inverse
    assert np.array_equal(stacked[order], np.arange(int(cu[-1]))), "inverse maps tokens to their rows"
    for c in plan.calls:
        assert c.n >= 1 and c.q_len >= 1 and c.k_len >= c.q_len, "no empty SDPA call, keys cover the queries"
        assert len(c.q_tokens) == len(c.out_tokens) == c.batch * c.q_len
        if c.key_slots is not None:   # folded followers: checked by check_fold
            continue
        real = c.out_tokens >= 0
        assert np.array_equal(c.q_tokens[real], c.out_tokens[real])
        if c.q_start is not None:
            assert np.array_equal(c.q_tokens, c.q_start + np.arange(c.n * c.q_len))
        rows = c.out_tokens.reshape(c.n, c.q_len)
        longest = int((rows >= 0).sum(axis=1).max())   # the group's longest real rows: what it pads to
        if c.mask == "causal":
            assert c.q_len == bucketed(longest, buckets), "causal calls padded to the bucket of their longest"
        else:
            assert c.q_len == longest, "one-row calls are never padded"
        for s, r in zip(c.seqs, rows):
            mine = r[r >= 0]
            assert np.all((mine >= cu[s]) & (mine < cu[s + 1])), "a call's rows belong to their own sequence"
            assert np.array_equal(mine, np.arange(mine[0], mine[0] + len(mine))) and np.all(r[len(mine):] < 0), \
                "real rows first and consecutive, padding only at the end"
            # The exactness condition of a lower-right causal mask: the offset k_len - q_len is the number of
            # positions before the call's first row, for every sequence in the call.
            if c.mask == "causal":
                assert c.k_len - c.q_len == cached[s] + (mine[0] - cu[s])
            elif c.mask is None:  # one row that sees every key: exactly the positions up to its own
                assert c.q_len == 1 and c.k_len == cached[s] + (mine[0] - cu[s]) + 1
            else:  # one-token sequences, keys padded to the longest and masked past each context
                assert c.mask == "keys" and c.q_len == 1 == q_lens[s] and c.k_len >= cached[s] + 1
        if c.mask == "causal" and c.n > 1:
            prefix = c.k_len - c.q_len
            real_work = sum(causal_work(int(q_lens[s]), prefix) for s in c.seqs)
            assert c.n * causal_work(longest, prefix) <= pad_slack * real_work + 1e-9
            assert c.n * longest <= group_rows
        if c.key_tokens is not None:
            assert all(cached[s] == 0 for s in c.seqs)
            keys = c.key_tokens.reshape(c.n, c.k_len)
            for s, k in zip(c.seqs, keys):
                assert np.all((k >= cu[s]) & (k < cu[s + 1]))
        assert max(q_lens[s] for s in c.seqs) <= query_chunk or c.n == 1


@pytest.mark.parametrize("trial", range(20))
def test_plan_invariants_on_random_batches(rng, trial):
    n = int(rng.integers(1, 40))
    q_lens = [int(x) for x in rng.choice([1, 1, 2, 7, 16, 40, 41, 300, 2100], size=n)]
    prefixes = [0, 0, 16, 2064, int(rng.integers(1, 3000))]
    cached = [int(rng.choice(prefixes)) for _ in range(n)]
    query_chunk, group_rows = int(rng.choice([64, 512, 4096])), int(rng.choice([1, 512, 1 << 16]))
    buckets = int(rng.choice([0, 2, GPU_SHAPE_BUCKETS]))
    plan = plan_attention(np.concatenate([[0], np.cumsum(q_lens)]), np.add(q_lens, cached), query_chunk=query_chunk,
                          group_rows=group_rows, buckets=buckets)
    check_plan(plan, q_lens, cached, query_chunk=query_chunk, group_rows=group_rows, buckets=buckets)


def test_bucketed_lengths_are_few_and_close_above(rng):
    """`bucketed`: never shorter, at most 1/per_octave longer, idempotent and monotone, and exactly `per_octave`
    lengths per octave above the small ones (which stay exact)."""
    for per_octave in (1, 2, 4, 8, 16):
        n = np.sort(rng.integers(1, 20000, size=400))
        b = np.array([bucketed(int(x), per_octave) for x in n])
        assert np.all(b >= n) and np.all(b <= n * (1 + 1 / per_octave)) and np.all(np.diff(b) >= 0)
        assert all(bucketed(int(x), per_octave) == x for x in b)
        assert len({bucketed(x, per_octave) for x in range(1025, 2049)}) == per_octave
        assert all(bucketed(x, per_octave) == x for x in range(1, per_octave + 1))
    assert bucketed(1700, 0) == 1700 and bucketed(1700, GPU_SHAPE_BUCKETS) == 1792


def test_questions_of_different_lengths_reuse_the_same_sdpa_shapes(rng):
    """What the buckets are for: a job's passes hold clips whose prompts differ by a few words and clips'
    followers whose questions differ too; without buckets nearly every pass makes SDPA calls of shapes never
    seen before (each a new cuDNN graph on CUDA), with them a handful of shapes recur."""
    def shapes(buckets):
        seen = set()
        for _ in range(30):
            leaders = [int(x) for x in 1500 + rng.integers(0, 40, size=4)]   # a clip and its first question
            followers = [int(x) for x in 30 + rng.integers(0, 25, size=3)]    # the clip's other questions
            q_lens, cached = leaders + followers, [16] * 4 + [1530] * 3
            tables = np.tile(np.arange(200), (7, 1))   # the followers share the clip's cached blocks
            cu = np.concatenate([[0], np.cumsum(q_lens)])
            plan = plan_attention(cu, np.add(q_lens, cached), query_chunk=4096, group_rows=1 << 16,
                                  block_tables=tables, block_size=16, buckets=buckets)
            check_plan(plan, q_lens, cached, query_chunk=4096, group_rows=1 << 16, buckets=buckets)
            seen |= {(c.batch, c.q_len, c.k_len) for c in plan.calls}
        return seen

    without, with_buckets = len(shapes(0)), len(shapes(GPU_SHAPE_BUCKETS))
    assert without >= 25 and with_buckets <= 12, (without, with_buckets)


def test_plan_shapes_for_the_engines_cases():
    def plan(q_lens, cached, **kw):
        kw = {"query_chunk": 4096, "group_rows": 1 << 16, **kw}
        return plan_attention(np.concatenate([[0], np.cumsum(q_lens)]), np.add(q_lens, cached), **kw)

    fresh = plan([2135] * 8, [0] * 8)  # eight distinct clips: one call, q and K/V views, no reordering
    assert fresh.num_calls == 1 and fresh.inverse is None
    (call,) = fresh.calls
    assert (call.n, call.q_len, call.k_len, call.q_start, call.k_start) == (8, 2135, 2135, 0, 0)
    followers = plan([40, 47, 52, 44] * 3, [2064] * 12)  # questions of different lengths over a video prefix
    assert followers.num_calls == 1 and followers.calls[0].key_tokens is None and followers.calls[0].q_len == 52
    ragged = plan([30000, 5000, 10], [0, 0, 0])  # never pad the short ones to the long one
    assert sum(c.padded_rows for c in ragged.calls) == 0
    assert ragged.num_calls == -(-30000 // 4096) + -(-5000 // 4096) + 1
    mixed = plan([2135, 40, 40, 1, 1, 2135], [0, 2064, 2064, 300, 310, 0])
    assert mixed.num_calls == 3  # the fresh pair, the followers, the one-token pair
    assert plan([100, 50], [0, 0]).num_calls == 2  # 2x the real work if padded: above PAD_SLACK
    assert plan([16] * 8, [0] * 8, group_rows=64).num_calls == 2  # 4 sequences of 16 rows per call


def test_padded_groups_partition_and_bound_padding(rng):
    lengths = [int(x) for x in rng.integers(1, 400, size=int(rng.integers(1, 60)))]
    prefix = int(rng.integers(0, 3000))
    groups = padded_groups(lengths, prefix, pad_slack=1.25, group_rows=2048)
    assert sorted(i for g in groups for i in g) == list(range(len(lengths)))
    for g in groups:
        longest = max(lengths[i] for i in g)
        assert lengths[g[0]] == longest
        if len(g) > 1:
            assert len(g) * causal_work(longest, prefix) <= 1.25 * sum(causal_work(lengths[i], prefix) for i in g)
            assert len(g) * longest <= 2048
    assert len(padded_groups([33] * 10, prefix, pad_slack=1.0, group_rows=1 << 16)) == 1  # equal shapes: one


def test_empty_sequences_are_refused_before_any_attention():
    """A sequence with no new tokens would become a zero-row SDPA call (fatal on CUDA): refused up front."""
    with pytest.raises(ValueError, match="at least one new token"):
        build_attention_metadata([SeqSlice([0], 0, 4), SeqSlice([1], 3, 0)], 16)
    with pytest.raises(ValueError, match=">= 1 new token"):
        plan_attention(np.array([0, 4, 4]), np.array([4, 3]), query_chunk=512, group_rows=512)


class SdpaSpy:
    """Wraps MLX's SDPA and records each call's query and key shapes."""

    def __init__(self, monkeypatch):
        self.real, self.calls = mx.fast.scaled_dot_product_attention, []
        monkeypatch.setattr(mx.fast, "scaled_dot_product_attention", self)

    def __call__(self, q, k, v, **kwargs):
        assert q.size > 0 and k.size > 0, "an empty SDPA call (fatal on CUDA) was issued"
        self.calls.append((q.shape, k.shape))
        return self.real(q, k, v, **kwargs)


@pytest.mark.parametrize("setting", ["cpu", "gpu", "metal"])
def test_packed_equal_length_prefill_is_one_sdpa_call_per_layer(rng, dense_reference, monkeypatch, setting):
    n, q_len, layers = int(rng.integers(2, 9)), int(rng.integers(2, 512 // 8)), 4
    batch = make_ragged_batch(rng, [q_len] * n, [0] * n, num_q_heads=4, num_kv_heads=2, head_dim=32, block_size=16)
    spy = SdpaSpy(monkeypatch)
    fn = functools.partial(paged_attention, **SETTINGS[setting])
    for _ in range(layers):  # one forward pass: the plan is built by the first layer and reused
        out = fn(batch.q, batch.k_cache, batch.v_cache, batch.meta, 0.2, new_kv=new_kv_of(batch))
    assert len(spy.calls) == layers
    rows = bucketed(q_len, SETTINGS[setting].get("shape_buckets", 0))   # CUDA pads to a repeating length
    assert spy.calls[0] == ((n, 4, rows, 32), (n, 2, rows, 32))
    assert np.abs(np.array(out).astype(np.float64) - dense_reference(batch, 0.2)).max() < 1e-5
    spy.calls.clear()  # the per-sequence baseline pays one call per sequence
    paged_attention(batch.q, batch.k_cache, batch.v_cache, batch.meta, 0.2, group_rows=1)
    assert len(spy.calls) == n


def test_followers_over_one_prefix_share_a_call(rng, dense_reference, monkeypatch):
    """Short questions after the same cached video prefix (the followers of a clip): one call, padded."""
    q_lens = [int(x) for x in rng.integers(20, 25, size=6)]
    batch = make_ragged_batch(rng, q_lens, [160] * 6, num_q_heads=8, num_kv_heads=2, head_dim=32, block_size=16)
    spy = SdpaSpy(monkeypatch)
    out = paged_attention(batch.q, batch.k_cache, batch.v_cache, batch.meta, 0.2, new_kv=new_kv_of(batch))
    assert spy.calls == [((6, 8, max(q_lens), 32), (6, 2, 160 + max(q_lens), 32))]
    assert np.abs(np.array(out).astype(np.float64) - dense_reference(batch, 0.2)).max() < 1e-5


def test_fresh_sequences_read_the_new_kv_not_the_cache(rng, dense_reference):
    """With `new_kv`, sequences with nothing cached never read the cache: a poisoned cache changes nothing
    for them (and everything for a sequence whose prefix is cached)."""
    batch = make_ragged_batch(rng, [12, 12, 9, 5], [0, 0, 0, 20], num_q_heads=4, num_kv_heads=2, head_dim=32,
                              block_size=8)
    new_kv = new_kv_of(batch)
    poisoned = mx.full(batch.k_cache.shape, 1e4)
    out = paged_attention(batch.q, poisoned, poisoned, batch.meta, 0.2, new_kv=new_kv)
    ref = dense_reference(batch, 0.2)
    fresh_rows = 12 + 12 + 9
    assert np.abs(np.array(out)[:fresh_rows] - ref[:fresh_rows]).max() < 1e-5
    assert np.abs(np.array(out)[fresh_rows:] - ref[fresh_rows:]).max() > 1.0


def test_new_kv_of_the_wrong_shape_is_named(rng):
    batch = make_ragged_batch(rng, [5, 3], [0, 0], num_q_heads=4, num_kv_heads=2, head_dim=32, block_size=8)
    k, v = new_kv_of(batch)
    with pytest.raises(ValueError, match="new_kv must be K and V"):
        paged_attention(batch.q, batch.k_cache, batch.v_cache, batch.meta, 0.2, new_kv=(k[:4], v[:4]))


@pytest.mark.parametrize("dtype,tol", [(mx.bfloat16, 3e-2)])
def test_gpu_settings_in_half_precision_within_dtype_tolerance(rng, dense_reference, dtype, tol):
    q_lens, cached = ragged_batch_spec(rng, 16)
    batch = make_ragged_batch(rng, q_lens, cached, num_q_heads=8, num_kv_heads=2, head_dim=64, block_size=16,
                              dtype=dtype)
    out = paged_attention(batch.q, batch.k_cache, batch.v_cache, batch.meta, 0.125, new_kv=new_kv_of(batch),
                          **SETTINGS["gpu"])
    assert out.dtype == dtype
    err = np.abs(np.array(out.astype(mx.float32)).astype(np.float64) - dense_reference(batch, 0.125)).max()
    assert err < tol, f"max abs error {err} for q_lens={q_lens} cached={cached}"


def check_fold(call, q_lens, cached, tables, block_size):
    """A folded call (one fold, or folds of several clips stacked on the batch axis): each fold's sequences share
    their cached full blocks; every real row sees exactly its own keys; padded rows are dropped and padded keys
    seen by no row."""
    assert call.mask == "visible" and call.batch == call.folds >= 1
    assert call.visible.shape == (call.folds, call.q_len, call.k_len)
    rows = call.out_tokens.reshape(call.folds, call.q_len)
    cu = np.concatenate([[0], np.cumsum(q_lens)])
    owner = {t: s for s in range(len(q_lens)) for t in range(cu[s], cu[s + 1])}
    for f in range(call.folds):
        real = rows[f][rows[f] >= 0]
        assert np.all(rows[f][len(real):] < 0), "padded rows only at the end"
        seqs = sorted({owner[int(t)] for t in real}, key=lambda s: cu[s])
        assert len(seqs) >= 2 and set(seqs) <= set(call.seqs)
        shared = cached[seqs[0]] // block_size * block_size
        assert shared > 0
        for s in seqs:
            assert np.array_equal(tables[s, :shared // block_size], tables[seqs[0], :shared // block_size])
        keys = shared + sum(q_lens[s] + cached[s] - shared for s in seqs)
        assert len(real) == sum(q_lens[s] for s in seqs) and keys <= call.k_len
        assert len(real) * keys <= FOLD_SLACK * sum(causal_work(q_lens[s], cached[s]) for s in seqs) + 1e-9
        # each real row sees (shared + its own position + 1) keys: the causal count of its sequence
        seen = call.visible[f, :len(real)].sum(axis=1)
        want = np.concatenate([cached[s] + np.arange(q_lens[s]) + 1 for s in seqs])
        assert np.array_equal(seen, want) and not call.visible[f, :, keys:].any()


@pytest.mark.parametrize("trial", range(10))
def test_followers_of_a_clip_fold_into_one_call_over_their_shared_context(rng, dense_reference, monkeypatch, trial):
    """Questions over a clip's cached prefix (shared blocks) next to other work: the followers become one SDPA
    call with a batch of one, whose keys are the shared prefix once plus each follower's own positions; exact
    against the dense per-sequence reference."""
    block_size = int(rng.choice([8, 16]))
    clips = int(rng.integers(1, 3))
    q_lens, cached, groups = [], [], []
    for clip in range(clips):
        # not block-aligned; long next to the questions, as a clip's prefix is (so two followers always fold)
        prefix = int(rng.integers(10, 16)) * block_size + int(rng.integers(0, block_size - 1))
        for _ in range(int(rng.integers(2, 7))):
            q_lens.append(int(rng.integers(2, 17)))
            cached.append(prefix + int(rng.choice([0, 0, 1])))   # a follower whose own prefix is one longer
            groups.append(clip)
    q_lens += [int(rng.integers(2, 30)), 1]
    cached += [0, int(rng.integers(0, 50))]
    groups += [-1, -1]
    order = rng.permutation(len(q_lens))
    q_lens, cached, groups = ([x[i] for i in order] for x in (q_lens, cached, groups))
    shared = min(c for c, g in zip(cached, groups) if g >= 0) // block_size
    batch = make_ragged_batch(rng, q_lens, cached, num_q_heads=8, num_kv_heads=2, head_dim=32, block_size=block_size,
                              prefix_groups=groups, shared_blocks=shared)
    plan = plan_attention(batch.meta.cu_seqlens_q_host, batch.meta.context_lens_host, query_chunk=4096,
                          group_rows=1 << 16, block_tables=batch.meta.block_tables_host, block_size=block_size)
    check_plan(plan, q_lens, cached, query_chunk=4096, group_rows=1 << 16)
    folds = [c for c in plan.calls if c.key_slots is not None]
    assert folds, "followers sharing a clip's blocks must fold"
    for c in folds:
        check_fold(c, q_lens, cached, batch.meta.block_tables_host, block_size)
    spy = SdpaSpy(monkeypatch)
    out = paged_attention(batch.q, batch.k_cache, batch.v_cache, batch.meta, 0.2, new_kv=new_kv_of(batch),
                          **SETTINGS["gpu"])
    assert len(spy.calls) == plan.num_calls
    assert np.abs(np.array(out).astype(np.float64) - dense_reference(batch, 0.2)).max() < 1e-5


@pytest.mark.parametrize("dtype,tol", [(mx.float32, 1e-5), (mx.bfloat16, 3e-2)])
def test_twelve_followers_are_one_call_that_reads_the_prefix_once(rng, dense_reference, monkeypatch, dtype, tol):
    """The engine's follower case: 12 questions of 40 tokens over a 2,064-token cached clip prefix."""
    q_lens, cached = [40] * 12, [2064] * 12
    batch = make_ragged_batch(rng, q_lens, cached, num_q_heads=4, num_kv_heads=2, head_dim=32, block_size=16,
                              prefix_groups=[0] * 12, shared_blocks=2064 // 16, dtype=dtype)
    spy = SdpaSpy(monkeypatch)
    out = paged_attention(batch.q, batch.k_cache, batch.v_cache, batch.meta, 0.2, new_kv=new_kv_of(batch),
                          **SETTINGS["gpu"])
    keys = bucketed(2064 + 480, GPU_SHAPE_BUCKETS)   # (the keys padded to CUDA's bucket, seen by no row)
    assert spy.calls == [((1, 4, 480, 32), (1, 2, keys, 32))]   # vs 12 x (2064 + 40) keys padded
    assert out.dtype == dtype
    assert np.abs(np.array(out.astype(mx.float32)).astype(np.float64) - dense_reference(batch, 0.2)).max() < tol
    unshared = make_ragged_batch(rng, q_lens, cached, num_q_heads=4, num_kv_heads=2, head_dim=32, block_size=16)
    spy.calls.clear()   # followers of different clips (no shared blocks): the padded call, as before
    paged_attention(unshared.q, unshared.k_cache, unshared.v_cache, unshared.meta, 0.2, **SETTINGS["gpu"])
    assert spy.calls == [((12, 4, 40, 32), (12, 2, 2104, 32))]


def test_folds_respect_their_slack_and_rows(rng):
    """Many followers over a short prefix: split into several folds, each within FOLD_SLACK and group_rows."""
    n, prefix = 40, 64
    q_lens, cached = [int(x) for x in rng.integers(20, 40, size=n)], [prefix] * n
    tables = np.tile(np.arange(8), (n, 1))   # every follower shares the same 4 cached blocks of 16
    tables[:, 4:] = np.arange(n * 4).reshape(n, 4) + 100
    cu = np.concatenate([[0], np.cumsum(q_lens)])
    plan = plan_attention(cu, np.add(q_lens, cached), query_chunk=4096, group_rows=200, block_tables=tables,
                          block_size=16)
    folds = [c for c in plan.calls if c.key_slots is not None]
    assert len(folds) >= 2
    for c in folds:
        check_fold(c, q_lens, cached, tables, 16)
        assert c.q_len <= 200
    check_plan(plan, q_lens, cached, query_chunk=4096, group_rows=200)


@pytest.mark.parametrize("dtype,tol", [(mx.float32, 1e-5), (mx.bfloat16, 3e-2)])
def test_followers_of_many_clips_are_one_stacked_call(rng, dense_reference, monkeypatch, dtype, tol):
    """A step of the engine's job: the questions over several clips' cached prefixes, each clip's followers a fold,
    the folds of clips of slightly different lengths stacked into one SDPA call (rows and keys padded); exact
    against the dense per-sequence reference, with the other work of the pass beside them."""
    block_size, clips = 16, int(rng.integers(3, 7))
    q_lens, cached, groups = [], [], []
    for clip in range(clips):
        prefix = 62 * block_size + int(rng.integers(0, block_size - 1))   # 62 full blocks each, shared per clip
        for _ in range(3):   # folds of 84-96 rows: within PAD_SLACK of each other, so the rule stacks them all
            q_lens.append(int(rng.integers(28, 33)))
            cached.append(prefix)
            groups.append(clip)
    q_lens += [int(rng.integers(30, 60))]
    cached += [0]
    groups += [-1]
    order = rng.permutation(len(q_lens))
    q_lens, cached, groups = ([x[i] for i in order] for x in (q_lens, cached, groups))
    batch = make_ragged_batch(rng, q_lens, cached, num_q_heads=4, num_kv_heads=2, head_dim=32, block_size=block_size,
                              prefix_groups=groups, shared_blocks=62, dtype=dtype)
    plan = plan_attention(batch.meta.cu_seqlens_q_host, batch.meta.context_lens_host, query_chunk=4096,
                          group_rows=1 << 16, block_tables=batch.meta.block_tables_host, block_size=block_size)
    check_plan(plan, q_lens, cached, query_chunk=4096, group_rows=1 << 16)
    folded = [c for c in plan.calls if c.key_slots is not None]
    assert len(folded) == 1 and folded[0].folds == clips, [c.folds for c in folded]
    check_fold(folded[0], q_lens, cached, batch.meta.block_tables_host, block_size)
    assert folded[0].padded_rows > 0 or len({sum(q for q, g in zip(q_lens, groups) if g == c)
                                             for c in range(clips)}) == 1
    spy = SdpaSpy(monkeypatch)
    out = paged_attention(batch.q, batch.k_cache, batch.v_cache, batch.meta, 0.2, new_kv=new_kv_of(batch),
                          **SETTINGS["gpu"])
    assert len(spy.calls) == plan.num_calls == 2   # the stacked folds, and the fresh prompt
    err = np.abs(np.array(out.astype(mx.float32)).astype(np.float64) - dense_reference(batch, 0.2)).max()
    assert err < tol, err


def test_stacks_keep_their_padding_within_slack(rng):
    """A fold ten times another's size is not stacked with it; equal folds always are (up to group_rows)."""
    def fold(q, k, seq):
        from batchjob.metal_backend.attention_plan import SdpaCall
        tokens = np.arange(seq * 100, seq * 100 + q, dtype=np.int32)
        visible = np.ones((1, q, k), dtype=bool)
        return SdpaCall((seq, seq + 1000), q, k, tokens, tokens.copy(), int(tokens[0]), None, None, "visible",
                        np.arange(k, dtype=np.int32), visible, 1)

    big, small = fold(400, 4000, 1), fold(40, 400, 2)
    assert [c.folds for c in stack_folds([big, small], group_rows=1 << 16)] == [1, 1]
    same = [fold(90, 2100, i) for i in range(5)]
    assert [c.folds for c in stack_folds(same, group_rows=1 << 16)] == [5]
    assert [c.folds for c in stack_folds(same, group_rows=200)] == [2, 2, 1]   # at most 200 rows a stack
    near = [fold(int(rng.integers(80, 100)), int(rng.integers(2000, 2200)), i) for i in range(6)]
    for c in stack_folds(near, group_rows=1 << 16):
        members = [f for f in near if set(f.seqs) <= set(c.seqs)]
        assert c.batch * c.q_len * c.k_len <= PAD_SLACK * sum(f.q_len * f.k_len for f in members)


@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float16, mx.float32])
def test_rows_move_as_words_with_their_bits_unchanged(rng, dtype):
    """`take_rows` (the gathers of keys, and of outputs back into token order) equals `mx.take` bit for bit,
    NaNs and negative zeros included, for rows whose bytes make 64-bit words and for rows that do not."""
    from batchjob.metal_backend.attention import take_rows

    for width in (int(rng.integers(1, 5)) * 8, int(rng.integers(1, 7)) * 8 + 3):
        x = mx.array(rng.standard_normal((int(rng.integers(5, 40)), 3, width)).astype(np.float32)).astype(dtype)
        x = mx.where(mx.array(rng.random(x.shape) < 0.05), mx.array(float("nan"), dtype), x)
        x = mx.where(mx.array(rng.random(x.shape) < 0.05), mx.array(-0.0, dtype), x)
        flat = x.reshape(-1, width)
        idx = mx.array(rng.integers(0, flat.shape[0], size=int(rng.integers(1, 60))).astype(np.int32))
        got, want = take_rows(flat, idx), mx.take(flat, idx, axis=0)
        assert got.dtype == dtype and got.shape == want.shape
        bits = mx.uint16 if dtype.size == 2 else mx.uint32
        assert mx.array_equal(got.view(bits), want.view(bits)).item()


@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float32])
def test_packed_rows_of_a_stacked_projection_gather_the_same_bits(rng, dtype):
    """`PackedRows`: the heads of a stacked projection (q's or k's, a strided view) gathered as words of one
    contiguous copy equal `mx.take` of the view, bit for bit, for every call of a layer; runs stay views."""
    from batchjob.metal_backend.attention import PackedRows

    t, hq, hkv, d = int(rng.integers(8, 40)), 4, 2, int(rng.choice([16, 36]))   # 36: rows that make no words
    qkv = mx.array(rng.standard_normal((t, hq + 2 * hkv, d)).astype(np.float32)).astype(dtype)
    for view in (qkv[:, :hq], qkv[:, hq:hq + hkv], qkv[:, hq + hkv:]):
        rows = PackedRows(view)
        for _ in range(3):   # several calls of one layer share the copy
            n, length = int(rng.integers(1, 4)), int(rng.integers(1, 6))
            tokens = rng.integers(0, t, size=n * length).astype(np.int32)
            got = rows.rows(None, tokens, n, length, lambda build: build())
            want = mx.take(view, mx.array(tokens), axis=0).reshape(n, length, -1, d).transpose(0, 2, 1, 3)
            bits = mx.uint16 if dtype.size == 2 else mx.uint32
            assert got.shape == want.shape and mx.array_equal(got.view(bits), want.view(bits)).item()
        start = int(rng.integers(0, t - 4))
        run = rows.rows(start, np.arange(start, start + 4, dtype=np.int32), 2, 2, lambda build: build())
        assert mx.array_equal(run, view[start:start + 4].reshape(2, 2, -1, d).transpose(0, 2, 1, 3)).item()
    assert rows._contiguous is not None   # made once, by the first gather
