"""The Metal kernel sources, run on the CPU emulator (see conftest), against the portable path.

This is as close as a machine without Metal gets to running the kernels: the exact kernel text, the launch
the product computes (grid, template constants, inputs), MLX's signature rules, real barriers.
"""

from __future__ import annotations

import re

import mlx.core as mx
import numpy as np
import pytest

from batchjob.metal_backend import paged_attention, select_attention_backend
from batchjob.metal_backend.kernels import kernel_launch, kernel_source
from batchjob.metal_backend.probe import make_ragged_batch

CONFIGS = [  # (head_dim, GQA ratio, block size): few, because each is one compile per kernel; the probe
    (64, 1, 16),  # test below adds head_dim 128 with GQA 4
    (80, 8, 32),
]


@pytest.mark.parametrize("kind", ["per_token", "tiled"])
@pytest.mark.parametrize("head_dim,gqa,block_size", CONFIGS)
def test_kernel_matches_portable_path(rng, metal_emulator, kind, head_dim, gqa, block_size):
    # 3 sequences keep cu_seqlens_q/context_lens under 8 elements (MLX binds them as `constant`), 9 do not.
    num_seqs = int(rng.choice([3, 9]))
    q_lens = [int(rng.choice([1, block_size, block_size + 1, int(rng.integers(2, 40))])) for _ in range(num_seqs)]
    cached = [int(rng.choice([0, block_size, int(rng.integers(1, 60))])) for _ in range(num_seqs)]
    batch = make_ragged_batch(rng, q_lens, cached, num_q_heads=gqa, num_kv_heads=1, head_dim=head_dim,
                              block_size=block_size)
    scale = head_dim**-0.5
    got = metal_emulator(kernel_launch(batch.q, batch.k_cache, batch.v_cache, batch.meta, scale, kind))
    want = np.array(paged_attention(batch.q, batch.k_cache, batch.v_cache, batch.meta, scale))
    err = np.abs(got - want).max()
    assert err < 1e-5, f"{kind}: max abs diff {err} for q_lens={q_lens} cached={cached}"


def test_real_kernels_pass_the_selection_probe_in_the_emulator(metal_emulator):
    """The selection path end to end with the genuine kernel text standing in for the GPU."""

    def emulated(q, k_cache, v_cache, meta, scale):
        return mx.array(metal_emulator(kernel_launch(q, k_cache, v_cache, meta, scale)))

    backend = select_attention_backend(dtype=mx.float32, metal_available=lambda: True, load_kernel=lambda: emulated)
    assert backend.name == "metal", backend.reason


def test_emulator_catches_a_wrong_causal_limit(rng, metal_emulator, monkeypatch):
    """The emulator comparison can fail: an off-by-one in the tiled kernel's causal check is caught."""
    import batchjob.metal_backend.kernels as kernels

    original = kernels.kernel_source

    def broken(name):
        text = original(name)
        return text.replace("pos >= offset + row + 1", "pos >= offset + row + 2") if "tiled" in name else text

    monkeypatch.setattr(kernels, "kernel_source", broken)
    batch = make_ragged_batch(rng, [20, 7], [0, 3], num_q_heads=2, num_kv_heads=1, head_dim=64, block_size=16)
    got = metal_emulator(kernel_launch(batch.q, batch.k_cache, batch.v_cache, batch.meta, 0.125, "tiled"))
    want = np.array(paged_attention(batch.q, batch.k_cache, batch.v_cache, batch.meta, 0.125))
    assert np.abs(got - want).max() > 1e-3


def test_sources_never_name_an_address_space():
    """MLX binds inputs under 8 elements as `constant`, others as `device`; code must accept both."""
    for name in ["paged_attention_common.metal", "paged_attention_per_token.metal", "paged_attention_tiled.metal"]:
        code = re.sub(r"//[^\n]*", "", kernel_source(name))
        assert not re.search(r"\b(device|constant)\b", code), name


def test_emulator_catches_a_divergent_simd_sum(rng, metal_emulator, monkeypatch):
    """simd_sum reached by only half the lanes hangs or corrupts on a GPU; the emulator must refuse it."""
    import batchjob.metal_backend.kernels as kernels

    original = kernels.kernel_source

    def broken(name):
        text = original(name)
        return text.replace("metal::simd_sum(partial)", "(lane < 16 ? metal::simd_sum(partial) : 0.0f)")

    monkeypatch.setattr(kernels, "kernel_source", broken)
    batch = make_ragged_batch(rng, [1, 1], [4, 9], num_q_heads=1, num_kv_heads=1, head_dim=64, block_size=16)
    with pytest.raises(AssertionError, match="not every thread reaches"):
        metal_emulator(kernel_launch(batch.q, batch.k_cache, batch.v_cache, batch.meta, 0.125, "per_token"))


@pytest.mark.parametrize("kind", ["per_token", "tiled"])
def test_kernel_half_precision(rng, metal_emulator, kind):
    batch = make_ragged_batch(rng, [1, 17, 5], [30, 0, 16], num_q_heads=4, num_kv_heads=2, head_dim=64,
                              block_size=16, dtype=mx.float16)
    got = metal_emulator(kernel_launch(batch.q, batch.k_cache, batch.v_cache, batch.meta, 0.125, kind))
    want = np.array(paged_attention(batch.q, batch.k_cache, batch.v_cache, batch.meta, 0.125).astype(mx.float32))
    assert got.dtype == np.float16 and np.abs(got.astype(np.float32) - want).max() < 4e-3
