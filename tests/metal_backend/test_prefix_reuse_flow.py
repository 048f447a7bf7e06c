"""The engine's flow end to end: pool -> metadata -> write_kv -> paged_attention, with a prefix hit.

A second question about the same clip reuses the first question's KV blocks and computes only its own tail;
its outputs must equal computing the whole prompt from scratch in an empty cache.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from batchjob.metal_backend import BlockPool, KVCache, SeqSlice, build_attention_metadata, paged_attention, write_kv

BS, HQ, HKV, D, VOCAB = 16, 4, 2, 64, 50


def fake_layer(rng):
    """Per-token q/k/v as a deterministic function of (token id, position, media id), like one causal layer
    whose inputs are embeddings: enough for KV of a shared prefix to be identical across prompts."""
    tables = {name: rng.standard_normal((VOCAB, heads, D)).astype(np.float32)
              for name, heads in [("q", HQ), ("k", HKV), ("v", HKV)]}
    media_vec = {m: rng.standard_normal(D).astype(np.float32) for m in ["clipA", "clipB"]}

    def project(name, tokens, positions, media_of):
        out = tables[name][tokens] + np.sin(positions)[:, None, None] * 0.1
        return mx.array(out + np.stack([media_vec.get(m, 0 * media_vec["clipA"]) for m in media_of])[:, None, :])

    return project


def run(pool, cache, project, seq_id, tokens, media, span_media):
    got = pool.allocate(seq_id, tokens, [media] if media else [])
    start = got.num_cached_tokens
    pos = np.arange(start, len(tokens))
    media_of = [span_media if media and media[0] <= p < media[1] else None for p in pos]
    meta = build_attention_metadata([SeqSlice(got.block_table, start, len(tokens) - start)], BS)
    new_tokens = np.array(tokens[start:])
    cache.k[0], cache.v[0] = write_kv(cache.k[0], cache.v[0], project("k", new_tokens, pos, media_of),
                                      project("v", new_tokens, pos, media_of), meta)
    out = paged_attention(project("q", new_tokens, pos, media_of), cache.k[0], cache.v[0], meta, D**-0.5)
    pool.mark_computed(seq_id, len(tokens))
    return got.num_cached_tokens, np.array(out)


def test_second_question_reuses_the_clip_prefix_and_matches_a_fresh_run(rng):
    project = fake_layer(rng)
    video = [7] * int(rng.integers(40, 90))  # placeholder tokens: the same ids for every clip
    prefix = [1, 2, 3] + video + [4]
    q1 = prefix + [int(t) for t in rng.integers(10, VOCAB, size=int(rng.integers(3, 30)))]
    q2 = prefix + [int(t) for t in rng.integers(10, VOCAB, size=int(rng.integers(3, 30)))]
    span = (3, 3 + len(video), "clipA")

    pool, cache = BlockPool(64, BS), KVCache(1, 64, BS, HKV, D, mx.float32)
    run(pool, cache, project, "q1", q1, span, "clipA")
    cached, tail = run(pool, cache, project, "q2", q2, span, "clipA")
    assert cached == (len(prefix) // BS) * BS > 0

    fresh_pool, fresh_cache = BlockPool(64, BS), KVCache(1, 64, BS, HKV, D, mx.float32)
    _, whole = run(fresh_pool, fresh_cache, project, "q2", q2, span, "clipA")
    np.testing.assert_allclose(tail, whole[cached:], atol=1e-5)

    # Same tokens, another clip: no hit, because the media identity differs.
    other, _ = run(pool, cache, project, "q3", q2, (3, 3 + len(video), "clipB"), "clipB")
    assert other == 0
