"""The vision towers' planned forwards (Qwen3-VL, and the plan pieces shared with Qwen2-VL / Qwen2.5-VL) against
mlx-vlm's own forward and transformers' (fp32, CPU), and without a host sync.

References: mlx-vlm's `VisionModel.__call__` on a freshly loaded tower (only its GELU swap corrected, as
PLATFORM.md records), transformers' `Qwen3VLVisionModel` on the same checkpoint, and mlx-vlm's own window index
and rotary positions for the host-side plans.
"""

from __future__ import annotations

import sys
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
import torch

from batchjob.engine import EngineConfig
from batchjob.engine.checkpoint import load_checkpoint
from batchjob.engine.patch_embed import MatmulPatchEmbed, matmul_patch_embed
from batchjob.engine.qwen2_vision import encode_qwen2
from batchjob.engine.qwen25_vision import encode_qwen25, patch_window_index
from batchjob.engine.qwen3_vision import encode_qwen3
from batchjob.engine.vision_plan import merge_block_positions, window_order

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
from benchlib.syncs import count_host_syncs  # noqa: E402

torch.set_grad_enabled(False)
QWEN3 = ["qwen3_vl", "qwen3_vl_moe"]
# (t, h, w) in patches: merge-aligned, square and not, one temporal patch, more rows than the 8x8 learned grid
GRIDS = [(2, 10, 14), (1, 8, 8), (3, 6, 20), (2, 18, 4)]


def _pixels(rng, grid, patch=16):
    t, h, w = grid
    return rng.standard_normal((t * h * w, 3 * 2 * patch * patch)).astype(np.float32)


@pytest.fixture(scope="module")
def engine_towers(checkpoint_dir):
    """The engine's towers as `load_checkpoint` leaves them (fix_model: GELUs, padded MLPs, matmul embed)."""
    return {name: load_checkpoint(checkpoint_dir(name), EngineConfig(dtype="float32")).model.vision_tower
            for name in QWEN3}


@pytest.mark.parametrize("name", QWEN3)
def test_planned_qwen3_tower_equals_mlx_vlm_and_transformers(name, checkpoint_dir, engine_towers, rng,
                                                              mlx_vlm_qwen3_tower):
    from transformers import AutoModelForImageTextToText

    path = checkpoint_dir(name)
    reference = mlx_vlm_qwen3_tower(path)
    visual = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32).eval().model.visual
    tower = engine_towers[name]
    assert isinstance(tower.patch_embed, MatmulPatchEmbed)
    for grid in GRIDS:
        px = _pixels(rng, grid)
        got, got_stack = encode_qwen3(tower, mx.array(px), [grid])
        want, want_stack = reference(mx.array(px), mx.array([list(grid)]))
        assert got.shape == want.shape and len(got_stack) == len(want_stack) == len(tower.deepstack_visual_indexes)
        assert float(mx.abs(got - want).max()) <= 1e-5, grid
        for g, w in zip(got_stack, want_stack):
            assert float(mx.abs(g - w).max()) <= 1e-5, grid
        hf = visual(torch.from_numpy(px), grid_thw=torch.tensor([list(grid)]))
        np.testing.assert_allclose(np.array(got), hf.pooler_output.numpy(), atol=1e-5, rtol=0, err_msg=str(grid))
        for g, w in zip(got_stack, hf.deepstack_features):
            np.testing.assert_allclose(np.array(g), w.numpy(), atol=1e-5, rtol=0, err_msg=str(grid))


def test_towers_make_no_host_sync_and_one_sdpa_call_per_block(checkpoint_dir, engine_towers, rng, monkeypatch):
    """Every planned forward runs without a host sync (first call of a shape included) and never splits per
    frame or window; mlx-vlm's own forward, under the same counter, syncs (so the counter can see them)."""
    towers = {"qwen3_vl": (engine_towers["qwen3_vl"], encode_qwen3, 16)}
    for name, encode in (("qwen2_5_vl-mha", encode_qwen25), ("qwen2_vl-mha", encode_qwen2)):
        towers[name] = (load_checkpoint(checkpoint_dir(name), EngineConfig()).model.vision_tower, encode, 14)
    real_sdpa = mx.fast.scaled_dot_product_attention
    calls = []
    monkeypatch.setattr(mx.fast, "scaled_dot_product_attention", lambda *a, **k: calls.append(1) or real_sdpa(*a, **k))
    for name, (tower, encode, patch) in towers.items():
        grid = (2, 16, 24)
        px = mx.array(_pixels(rng, grid, patch))
        mx.eval(px)
        with monkeypatch.context() as m, count_host_syncs() as log:
            m.setattr(mx, "split", lambda *a, **k: (_ for _ in ()).throw(AssertionError("split per block")))
            calls.clear()
            out = encode(tower, px, [grid])
        assert log.syncs == 0 and log.evals == 0, (name, log.sites)
        mx.eval(out)
        # one call per block; Qwen2.5-VL's windows are of one size at 16 x 24 patches (two 8 x 8 window sizes
        # when the sides are not multiples of the window: 16 x 24 is 2 x 3 windows of 8 x 8)
        assert len(calls) == len(tower.blocks), (name, len(calls))
    from mlx_vlm.utils import load_model

    theirs = load_model(Path(checkpoint_dir("qwen3_vl"))).vision_tower
    with count_host_syncs() as log:
        mx.eval(theirs(mx.array(_pixels(rng, (2, 16, 24))), mx.array([[2, 16, 24]])))
    assert log.syncs > len(theirs.blocks)


def test_window_order_and_positions_equal_mlx_vlm(checkpoint_dir, rng):
    """The host-side plan pieces against mlx-vlm's own device computations on random clip shapes."""
    from mlx_vlm.utils import load_model

    tower = load_model(Path(checkpoint_dir("qwen2_5_vl-mha"))).vision_tower
    patch_window_index(tower)   # mlx-vlm's empty windows dropped, as the engine's forward drops them
    for _ in range(12):
        grid = [(int(rng.integers(1, 4)), 2 * int(rng.integers(1, 13)), 2 * int(rng.integers(1, 13)))
                for _ in range(int(rng.integers(1, 3)))]
        index, cu = tower.get_window_index(mx.array(grid))
        order, bounds = window_order(tuple(grid), tower.window_size, tower.spatial_merge_size, tower.patch_size)
        np.testing.assert_array_equal(order, np.array(index))
        np.testing.assert_array_equal(bounds, np.array(cu))
        # rotary positions: mlx-vlm's frequencies are its table gathered at (row, col) of each patch
        dim = tower.rotary_pos_emb.dim
        table = np.array(tower.rotary_pos_emb(mx.array(max(max(h, w) for _, h, w in grid))))
        pos = merge_block_positions(tuple(grid), tower.spatial_merge_size)
        np.testing.assert_array_equal(table[pos].reshape(len(pos), -1), np.array(tower.rot_pos_emb(mx.array(grid))))
        assert table.shape[1] == dim // 2


@pytest.mark.parametrize("bias", [True, False])
def test_matmul_patch_embedding_equals_the_conv3d(rng, bias):
    from mlx_vlm.models.qwen3_vl.vision import PatchEmbed

    mx.random.seed(int(rng.integers(1 << 30)))
    embed = PatchEmbed(patch_size=4, temporal_patch_size=2, in_channels=3, hidden_size=24)
    if not bias:
        del embed.proj.bias
    x = mx.array(rng.standard_normal((37, 3 * 2 * 4 * 4)).astype(np.float32))
    want = embed(x)
    holder = nn.Module()
    holder.patch_embed = embed
    assert matmul_patch_embed(holder) and matmul_patch_embed(holder)   # idempotent
    assert isinstance(holder.patch_embed, MatmulPatchEmbed) and ("bias" in holder.patch_embed.proj) == bias
    assert float(mx.abs(holder.patch_embed(x) - want).max()) <= 1e-5
