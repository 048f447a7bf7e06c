"""The CUDA kernel sources (kernels/*.cu) on the CPU emulator, against the portable path.

The exact kernel text, the launch the product computes (`cuda_launch`: grid, template constants, inputs),
real barriers and warp shuffles; what it cannot catch is NVRTC diagnostics, bf16 rounding on the GPU and
speed (scripts/gpu_check.py runs the real kernels and the probe on an NVIDIA GPU).
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from batchjob.metal_backend import paged_attention, select_cuda_backend
from batchjob.metal_backend.kernels.cuda import cuda_launch
from batchjob.metal_backend.probe import make_ragged_batch


@pytest.mark.parametrize("kind", ["per_token", "tiled"])
@pytest.mark.parametrize("head_dim,gqa,block_size", [(64, 1, 16), (80, 8, 32)])  # the probe test adds 128, GQA 4
def test_cuda_kernel_matches_portable_path(rng, cuda_emulator, kind, head_dim, gqa, block_size):
    num_seqs = int(rng.choice([3, 9]))
    q_lens = [int(rng.choice([1, block_size, block_size + 1, int(rng.integers(2, 40))])) for _ in range(num_seqs)]
    cached = [int(rng.choice([0, block_size, int(rng.integers(1, 60))])) for _ in range(num_seqs)]
    batch = make_ragged_batch(rng, q_lens, cached, num_q_heads=gqa, num_kv_heads=1, head_dim=head_dim,
                              block_size=block_size)
    scale = head_dim**-0.5
    got = cuda_emulator(cuda_launch(batch.q, batch.k_cache, batch.v_cache, batch.meta, scale, kind))
    want = np.array(paged_attention(batch.q, batch.k_cache, batch.v_cache, batch.meta, scale))
    err = np.abs(got - want).max()
    assert err < 1e-5, f"{kind}: max abs diff {err} for q_lens={q_lens} cached={cached}"


def test_cuda_kernels_against_the_dense_reference(rng, cuda_emulator, dense_reference):
    """Followers over a cached prefix (the short-query case) vs an fp64 dense attention, not the portable path."""
    batch = make_ragged_batch(rng, [40, 23, 1], [300, 150, 77], num_q_heads=8, num_kv_heads=2, head_dim=64,
                              block_size=16)
    got = cuda_emulator(cuda_launch(batch.q, batch.k_cache, batch.v_cache, batch.meta, 0.125, "tiled"))
    assert np.abs(got - dense_reference(batch, 0.125)).max() < 1e-5


def test_real_cuda_kernels_pass_the_selection_probe_in_the_emulator(cuda_emulator):
    def emulated(q, k_cache, v_cache, meta, scale):
        return mx.array(cuda_emulator(cuda_launch(q, k_cache, v_cache, meta, scale)))

    backend = select_cuda_backend(dtype=mx.float32, load_kernel=lambda: emulated)
    assert backend.name == "cuda", backend.reason


def test_cuda_emulator_catches_a_wrong_causal_limit(rng, cuda_emulator, monkeypatch):
    import batchjob.metal_backend.kernels as kernels

    original = kernels.kernel_source

    def broken(name):
        text = original(name)
        return text.replace("pos >= offset + row + 1", "pos >= offset + row + 2") if "tiled" in name else text

    monkeypatch.setattr(kernels, "kernel_source", broken)
    batch = make_ragged_batch(rng, [20, 7], [0, 3], num_q_heads=2, num_kv_heads=1, head_dim=64, block_size=16)
    got = cuda_emulator(cuda_launch(batch.q, batch.k_cache, batch.v_cache, batch.meta, 0.125, "tiled"))
    want = np.array(paged_attention(batch.q, batch.k_cache, batch.v_cache, batch.meta, 0.125))
    assert np.abs(got - want).max() > 1e-3


def test_cuda_emulator_catches_a_divergent_shuffle(rng, cuda_emulator, monkeypatch):
    import batchjob.metal_backend.kernels as kernels

    original = kernels.kernel_source

    def broken(name):
        return original(name).replace("const float score = warp_sum(partial);",
                                      "const float score = lane < 16 ? warp_sum(partial) : 0.0f;")

    monkeypatch.setattr(kernels, "kernel_source", broken)
    batch = make_ragged_batch(rng, [1, 1], [4, 9], num_q_heads=1, num_kv_heads=1, head_dim=64, block_size=16)
    with pytest.raises(AssertionError, match="not every thread reaches"):
        cuda_emulator(cuda_launch(batch.q, batch.k_cache, batch.v_cache, batch.meta, 0.125, "per_token"))


@pytest.mark.parametrize("kind", ["per_token", "tiled"])
def test_cuda_kernel_half_precision(rng, cuda_emulator, kind):
    batch = make_ragged_batch(rng, [1, 17, 5], [30, 0, 16], num_q_heads=4, num_kv_heads=2, head_dim=64,
                              block_size=16, dtype=mx.float16)
    got = cuda_emulator(cuda_launch(batch.q, batch.k_cache, batch.v_cache, batch.meta, 0.125, kind))
    want = np.array(paged_attention(batch.q, batch.k_cache, batch.v_cache, batch.meta, 0.125).astype(mx.float32))
    assert got.dtype == np.float16 and np.abs(got.astype(np.float32) - want).max() < 4e-3
