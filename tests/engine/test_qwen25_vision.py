"""Qwen2.5-VL vision tower: the window-index patch and the packed (plan-once) window attention.

References: mlx-vlm's own `VisionModel.__call__` on the same weights (which runs one SDPA per window after a
host sync per layer) and a per-segment numpy attention for the segment plan.
"""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from batchjob.engine.qwen2_vision import encode_qwen2
from batchjob.engine.qwen25_vision import encode_qwen25, patch_window_index
from batchjob.engine.vision_attention import (drop_repeated_boundaries, frame_boundaries, packed_attention,
                                              segment_plan)


@pytest.fixture(scope="module")
def tower(checkpoint_dir):
    from mlx_vlm.utils import load_model

    return load_model(Path(checkpoint_dir("qwen2_5_vl-mha"))).vision_tower  # 3 blocks, full attention at 2


def pixels(rng, grid):
    t, h, w = grid
    return mx.array(rng.standard_normal((t * h * w, 3 * 2 * 14 * 14)).astype(np.float32))


def test_drop_repeated_boundaries():
    assert drop_repeated_boundaries(np.array([0, 64, 64, 128, 128, 128, 160])).tolist() == [0, 64, 128, 160]
    assert drop_repeated_boundaries(np.array([0, 3, 7])).tolist() == [0, 3, 7]
    with pytest.raises(ValueError, match="non-decreasing"):
        drop_repeated_boundaries(np.array([0, 5, 3]))


def test_mlx_vlm_window_index_has_empty_windows_and_the_patch_removes_them(checkpoint_dir):
    """Grid sides that are multiples of the window (448 px: 16 merged patches, windows of 4) give repeated
    boundaries in mlx-vlm 0.7.10; the patched method gives the same windows without the empty ones."""
    from mlx_vlm.utils import load_model

    tower = load_model(Path(checkpoint_dir("qwen2_5_vl-mha"))).vision_tower
    grid = mx.array([[8, 32, 32]])  # 16 frames at 448x448
    index_before, cu_before = tower.get_window_index(grid)
    cu_before = np.array(cu_before)
    empty = int((np.diff(cu_before) == 0).sum())
    assert empty == 72 and len(cu_before) - 1 == 200, "mlx-vlm's window index changed: re-check the patch"
    patch_window_index(tower)
    patch_window_index(tower)  # idempotent
    index_after, cu_after = tower.get_window_index(grid)
    cu_after = np.array(cu_after)
    assert np.all(np.diff(cu_after) > 0) and len(cu_after) - 1 == 128
    assert cu_after.tolist() == sorted(set(cu_before.tolist()))
    assert np.array_equal(np.array(index_before), np.array(index_after))


def test_patched_tower_survives_an_sdpa_that_rejects_empty_queries(checkpoint_dir, monkeypatch, rng):
    """MLX CUDA's SDPA fails on an empty query; emulate that on CPU. mlx-vlm's own forward fails without the
    patch and runs with it, with output identical to the unpatched CPU run."""
    from mlx_vlm.utils import load_model

    tower = load_model(Path(checkpoint_dir("qwen2_5_vl-mha"))).vision_tower
    grid, px = [[2, 16, 16]], pixels(rng, (2, 16, 16))
    reference = tower(px, mx.array(grid))
    real_sdpa = mx.fast.scaled_dot_product_attention

    def strict_sdpa(q, k, v, **kwargs):
        if q.shape[2] == 0:
            raise RuntimeError("empty query (MLX CUDA: cudaGraphAddKernelNode invalid argument)")
        return real_sdpa(q, k, v, **kwargs)

    monkeypatch.setattr(mx.fast, "scaled_dot_product_attention", strict_sdpa)
    with pytest.raises(RuntimeError, match="empty query"):
        mx.eval(tower(px, mx.array(grid)))
    patch_window_index(tower)
    patched = tower(px, mx.array(grid))
    assert mx.array_equal(patched, reference).item()
    assert mx.array_equal(encode_qwen25(tower, px, [tuple(grid[0])]), reference).item()


@pytest.mark.parametrize("grid", [(2, 16, 16), (2, 12, 20), (1, 10, 6), (3, 8, 24)])
def test_packed_tower_matches_mlx_vlm(tower, rng, grid):
    px = pixels(rng, grid)
    patch_window_index(tower)  # the reference must not produce empty windows either (harmless on CPU)
    want = tower(px, mx.array([list(grid)]))
    got = encode_qwen25(tower, px, [grid])
    assert got.shape == want.shape
    assert float(mx.abs(got - want).max()) <= 1e-5


def test_segment_plan_groups_equal_lengths():
    even = segment_plan(np.array([0, 4, 8, 12]))
    assert [(g.length, g.count, g.gather) for g in even.groups] == [(4, 3, None)] and even.restore is None
    uneven = segment_plan(np.array([0, 4, 6, 6, 10, 13]))  # lengths 4, 2, 0 (dropped), 4, 3
    assert sorted((g.length, g.count) for g in uneven.groups) == [(2, 1), (3, 1), (4, 2)]
    order = np.concatenate([np.array(g.gather) for g in uneven.groups])
    assert np.array_equal(order[np.array(uneven.restore)], np.arange(13))
    assert segment_plan(np.array([0, 0])).groups == ()


def test_packed_attention_equals_per_segment_reference(tower, rng):
    """Uneven segments through one attention module vs a numpy softmax per segment (fp64)."""
    attn = tower.blocks[0].attn
    cu = np.array([0, 5, 5, 17, 21, 33, 40])
    x = mx.array(rng.standard_normal((40, attn.num_heads * attn.head_dim)).astype(np.float32))
    rotary = mx.array(rng.standard_normal((40, attn.head_dim // 2)).astype(np.float32))
    got = np.array(packed_attention(attn, x, segment_plan(cu), rotary))

    heads, d = attn.num_heads, attn.head_dim
    qkv = np.array(attn.qkv(x)).astype(np.float64).reshape(40, 3, heads, d)
    freqs = np.array(rotary, np.float64)
    cos, sin = np.tile(np.cos(freqs), 2)[:, None], np.tile(np.sin(freqs), 2)[:, None]  # [T, 1, D]: halves repeat

    def rope(t):
        half = d // 2
        rotated = np.concatenate([-t[..., half:], t[..., :half]], axis=-1)
        return t * cos + rotated * sin

    q, k, v = rope(qkv[:, 0]), rope(qkv[:, 1]), qkv[:, 2]
    out = np.zeros((40, heads, d))
    for a, b in zip(cu[:-1], cu[1:]):
        if a == b:
            continue
        scores = np.einsum("qhd,khd->hqk", q[a:b], k[a:b]) * attn.scale
        p = np.exp(scores - scores.max(-1, keepdims=True))
        p /= p.sum(-1, keepdims=True)
        out[a:b] = np.einsum("hqk,khd->qhd", p, v[a:b])
    want = np.array(attn.proj(mx.array(out.reshape(40, -1).astype(np.float32))))
    assert np.abs(got - want).max() <= 1e-4


def test_frame_boundaries():
    assert frame_boundaries([(2, 4, 6), (1, 2, 2)]).tolist() == [0, 24, 48, 52]


@pytest.mark.parametrize("name", ["qwen2_vl-gqa", "qwen2_vl-mha"])
def test_packed_qwen2_vl_tower_matches_mlx_vlm(checkpoint_dir, rng, name, monkeypatch):
    """Qwen2-VL's tower (full attention per frame) through the packed path equals mlx-vlm's forward, and
    never splits per block (mlx-vlm's per-block host sync)."""
    from mlx_vlm.utils import load_model

    tower = load_model(Path(checkpoint_dir(name))).vision_tower
    for grid in [(3, 8, 12), (1, 6, 4)]:
        px = pixels(rng, grid)
        want = tower(px, mx.array([list(grid)]))
        with monkeypatch.context() as m:
            m.setattr(mx, "split", lambda *a, **k: (_ for _ in ()).throw(AssertionError("split per block")))
            got = encode_qwen2(tower, px, [grid])
        assert got.shape == want.shape and float(mx.abs(got - want).max()) <= 1e-5


@pytest.mark.parametrize("inter,bias", [(96, True), (100, False), (128, True), (3420 // 10, True)])
def test_fused_gated_mlp_equals_the_three_linears(rng, inter, bias):
    """Gate/up stacked and zero-padded to the GEMM tile: same values as mlx-vlm's `down(silu(gate) * up)`."""
    import mlx.nn as nn

    from batchjob.engine.vision_mlp import GEMM_TILE, FusedGatedMLP

    hidden = 48
    mx.random.seed(int(rng.integers(1 << 30)))
    gate, up, down = nn.Linear(hidden, inter, bias=bias), nn.Linear(hidden, inter, bias=bias), nn.Linear(inter, hidden)
    x = mx.array(rng.standard_normal((37, hidden)).astype(np.float32))
    want = down(nn.silu(gate(x)) * up(x))
    fused = FusedGatedMLP(gate, up, down)
    assert fused.gate_up.weight.shape[0] % (2 * GEMM_TILE) == 0 and fused.down.weight.shape[1] % GEMM_TILE == 0
    assert float(mx.abs(fused(x) - want).max()) <= 1e-5


def test_fused_tower_matches_unfused_mlx_vlm(checkpoint_dir, rng):
    """The load-time swap (`fix_model`) keeps the tower's output: mlx-vlm's untouched forward as reference,
    then our packed forward over the fused, padded MLPs (intermediate 96 -> 128 here)."""
    from mlx_vlm.utils import load_model

    from batchjob.engine.vision_mlp import FusedGatedMLP, fuse_gated_mlps

    tower = load_model(Path(checkpoint_dir("qwen2_5_vl-mha"))).vision_tower
    patch_window_index(tower)
    for grid in [(2, 16, 16), (1, 10, 6)]:
        px = pixels(rng, grid)
        want = tower(px, mx.array([list(grid)]))
        fused_tower = load_model(Path(checkpoint_dir("qwen2_5_vl-mha"))).vision_tower
        assert fuse_gated_mlps(fused_tower.blocks) == len(fused_tower.blocks)
        assert all(isinstance(b.mlp, FusedGatedMLP) for b in fused_tower.blocks)
        got = encode_qwen25(fused_tower, px, [grid])
        assert float(mx.abs(got - want).max()) <= 1e-5


def test_fuse_leaves_quantized_mlps_alone(checkpoint_dir):
    import mlx.nn as nn
    from mlx_vlm.utils import load_model

    from batchjob.engine.vision_mlp import fuse_gated_mlps

    tower = load_model(Path(checkpoint_dir("qwen2_5_vl-mha"))).vision_tower
    block = tower.blocks[0]
    block.mlp.up_proj = nn.QuantizedLinear.from_linear(nn.Linear(64, 96), group_size=32, bits=4)
    assert fuse_gated_mlps(tower.blocks) == len(tower.blocks) - 1
    assert hasattr(tower.blocks[0].mlp, "up_proj")


@pytest.mark.parametrize("inter,approx", [(64, "tanh"), (100, "none"), (4304 // 8, "tanh")])
def test_padded_plain_mlp_keeps_its_values(rng, inter, approx):
    """Qwen3-VL's `fc2(gelu(fc1(x)))` zero-padded in place to the GEMM tile: same output (gelu(0) = 0)."""
    import types

    import mlx.nn as nn

    from batchjob.engine.vision_mlp import GEMM_TILE, pad_plain_mlps

    hidden = 48
    mx.random.seed(int(rng.integers(1 << 30)))
    mlp = nn.Module()
    mlp.linear_fc1, mlp.linear_fc2 = nn.Linear(hidden, inter), nn.Linear(inter, hidden)
    act = nn.GELU(approx=approx)
    x = mx.array(rng.standard_normal((29, hidden)).astype(np.float32))
    want = mlp.linear_fc2(act(mlp.linear_fc1(x)))
    block = types.SimpleNamespace(mlp=mlp)
    assert pad_plain_mlps([block]) == (1 if inter % GEMM_TILE else 0)
    assert mlp.linear_fc1.weight.shape[0] % GEMM_TILE == 0 and mlp.linear_fc2.weight.shape[1] % GEMM_TILE == 0
    assert float(mx.abs(mlp.linear_fc2(act(mlp.linear_fc1(x))) - want).max()) <= 1e-5
    assert pad_plain_mlps([block]) == 0   # already aligned
