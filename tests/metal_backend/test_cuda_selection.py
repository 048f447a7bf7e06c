"""CUDA kernels' host side: launch shapes shared with Metal, grid limits, probe-and-fallback, per-case choice.

The kernels themselves only run on an NVIDIA GPU (scripts/gpu_check.py runs the real probe there); here the
kernel is injected: the portable path itself (passes the probe), or a wrong one (must be rejected).
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from batchjob.metal_backend import (SeqSlice, batch_case, build_attention_metadata, paged_attention,
                                    select_cuda_backend)
from batchjob.metal_backend.kernels import kernel_launch, kernel_source
from batchjob.metal_backend.kernels.cuda import CUDA_MAX_GRID_YZ, cuda_launch
from batchjob.metal_backend.probe import make_ragged_batch


def test_cuda_launch_is_the_metal_launch(rng):
    batch = make_ragged_batch(rng, [1, 16, 37, 5], [31, 0, 32, 3], num_q_heads=8, num_kv_heads=2, head_dim=128,
                              block_size=16)
    for kind in ("tiled", "per_token"):
        a = kernel_launch(batch.q, batch.k_cache, batch.v_cache, batch.meta, 0.1, kind)
        b = cuda_launch(batch.q, batch.k_cache, batch.v_cache, batch.meta, 0.1, kind)
        assert (a.kind, a.grid, a.threadgroup, a.template) == (b.kind, b.grid, b.threadgroup, b.template)


def test_cuda_launch_refuses_grids_past_the_limit():
    tokens = (CUDA_MAX_GRID_YZ + 1)  # per-token kernel: one block per token on z
    meta = build_attention_metadata([SeqSlice([i], 0, 1) for i in range(tokens)], 1)
    q = mx.zeros((tokens, 2, 32))
    cache = mx.zeros((tokens, 1, 1, 32))
    with pytest.raises(ValueError, match="exceeds 65535"):
        cuda_launch(q, cache, cache, meta, 1.0, "per_token")


def test_cuda_sources_use_the_shared_index_helpers():
    """The CUDA bodies call the same helpers as the Metal ones (their Python twins are tested exhaustively)."""
    header = kernel_source("paged_attention_common.cuh")
    for helper in ("find_seq_for_token", "find_seq_for_query_block", "kv_slot"):
        assert f"{helper}(" in header
    assert "find_seq_for_query_block(" in kernel_source("paged_attention_tiled.cu")
    assert "find_seq_for_token(" in kernel_source("paged_attention_per_token.cu")


def test_batch_case():
    fresh = build_attention_metadata([SeqSlice([0, 1], 0, 20), SeqSlice([2, 3], 16, 10)], 16)
    followers = build_attention_metadata([SeqSlice([0, 1, 2], 32, 10), SeqSlice([0, 1, 3], 32, 12)], 16)
    assert batch_case(fresh) == "prefill" and batch_case(followers) == "follower"


SHAPE = dict(num_q_heads=4, num_kv_heads=2, head_dim=32, block_size=16)


def test_probe_rejects_a_wrong_kernel_and_falls_back():
    def wrong(q, k, v, meta, scale):
        return paged_attention(q, k, v, meta, scale * 1.5)

    backend = select_cuda_backend(dtype=mx.float32, load_kernel=lambda: wrong)
    assert backend.name == "portable" and "differs from the portable path" in backend.reason

    def broken():
        raise RuntimeError("nvrtc: error")

    backend = select_cuda_backend(dtype=mx.float32, load_kernel=broken)
    assert backend.name == "portable" and "failed to build" in backend.reason


@pytest.mark.parametrize("kernel_ms, expected", [
    ({"prefill": 1.0, "follower": 1.0}, {"prefill": "kernel", "follower": "kernel"}),
    ({"prefill": 9.0, "follower": 1.0}, {"prefill": "portable", "follower": "kernel"}),
    ({"prefill": 9.0, "follower": 9.0}, None),
])
def test_per_case_choice_takes_the_faster_correct_path(kernel_ms, expected, rng, monkeypatch):
    calls = []

    def kernel(q, k, v, meta, scale):
        calls.append(batch_case(meta))
        return paged_attention(q, k, v, meta, scale)

    def timer(fn, batch):
        case = batch_case(batch.meta)
        return kernel_ms[case] if fn is kernel else 5.0

    monkeypatch.setattr("batchjob.metal_backend.selection.timing_batches",
                        lambda dtype, **shape: {"prefill": make_ragged_batch(rng, [40], [0], dtype=dtype, **shape),
                                                "follower": make_ragged_batch(rng, [4], [40], dtype=dtype, **shape)})
    backend = select_cuda_backend(dtype=mx.float32, model_shape=SHAPE, load_kernel=lambda: kernel, timer=timer)
    if expected is None:
        assert backend.name == "portable" and "no case" in backend.reason
        return
    assert backend.name == "cuda" and backend.fn.choice == expected
    batch = make_ragged_batch(rng, [3, 2], [20, 30], dtype=mx.float32, **SHAPE)  # a follower batch
    calls.clear()
    out = backend(batch.q, batch.k_cache, batch.v_cache, batch.meta, 0.2)
    want = paged_attention(batch.q, batch.k_cache, batch.v_cache, batch.meta, 0.2)
    assert np.allclose(np.array(out), np.array(want), atol=1e-6)
    assert calls == (["follower"] if expected["follower"] == "kernel" else [])


def test_gpu_portable_path_uses_long_query_chunks_only_in_half_precision(rng):
    from batchjob.metal_backend.selection import GPU_GROUP_ROWS, GPU_QUERY_CHUNK, gpu_portable_attention

    assert gpu_portable_attention(mx.float32) is paged_attention  # unfused on CUDA: keep score matrices small
    fn = gpu_portable_attention(mx.bfloat16)
    assert fn.keywords == {"query_chunk": GPU_QUERY_CHUNK, "group_rows": GPU_GROUP_ROWS, "contiguous_kv": False}
    batch = make_ragged_batch(rng, [700, 3], [0, 40], dtype=mx.float32, **SHAPE)
    np.testing.assert_allclose(np.array(fn(batch.q, batch.k_cache, batch.v_cache, batch.meta, 0.2)),
                               np.array(paged_attention(batch.q, batch.k_cache, batch.v_cache, batch.meta, 0.2)),
                               atol=1e-5)
