"""Vision heads padded to whole-word rotary halves (engine/vision_heads.py): a tiny Qwen3-VL whose vision heads are
24 wide (rotary halves of 12, padded to 16) against mlx-vlm's own forward on a freshly loaded tower and against
transformers' (fp32, CPU); mlx-vlm's forward on the padded tower must agree too, and padding twice changes
nothing."""

from __future__ import annotations


import mlx.core as mx
import numpy as np
import pytest
import torch

from batchjob.engine import EngineConfig
from batchjob.engine.checkpoint import load_checkpoint
from batchjob.engine.qwen3_vision import encode_qwen3
from batchjob.engine.vision_heads import pad_rotary_heads, padded_half
from batchjob.synthetic.tiny_model import TinyModelSpec, write_tiny_checkpoint

torch.set_grad_enabled(False)
SPEC = TinyModelSpec(model_type="qwen3_vl", hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=32,
                     intermediate_size=128, vision_hidden=48, vision_heads=2, deepstack_visual_indexes=(0, 1),
                     seed=21)
GRIDS = [(2, 10, 14), (1, 8, 8), (3, 6, 20)]


@pytest.fixture(scope="module")
def wide_heads(tmp_path_factory):
    return str(write_tiny_checkpoint(tmp_path_factory.mktemp("qwen3-heads24"), SPEC))


def test_padded_half_rule():
    assert [padded_half(d) for d in (72, 24, 80, 128, 16)] == [40, 16, 40, 64, 8]


def test_padded_tower_equals_mlx_vlm_and_transformers(wide_heads, mlx_vlm_qwen3_tower):
    from transformers import AutoModelForImageTextToText

    rng = np.random.default_rng(5)
    tower = load_checkpoint(wide_heads, EngineConfig(dtype="float32")).model.vision_tower
    attn = tower.blocks[0].attn
    assert (attn.head_dim, attn.rotary_half) == (32, 12) and attn.scale == pytest.approx(24 ** -0.5)
    assert tower.blocks[0].attn.qkv.weight.shape == (3 * 2 * 32, 48)
    reference = mlx_vlm_qwen3_tower(wide_heads)
    visual = AutoModelForImageTextToText.from_pretrained(wide_heads, dtype=torch.float32).eval().model.visual
    for grid in GRIDS:
        px = rng.standard_normal((int(np.prod(grid)), 3 * 2 * 16 * 16)).astype(np.float32)
        got, got_stack = encode_qwen3(tower, mx.array(px), [grid])
        want, want_stack = reference(mx.array(px), mx.array([list(grid)]))
        assert float(mx.abs(got - want).max()) <= 1e-5, grid
        for g, w in zip(got_stack, want_stack):
            assert float(mx.abs(g - w).max()) <= 1e-5, grid
        hf = visual(torch.from_numpy(px), grid_thw=torch.tensor([list(grid)]))
        np.testing.assert_allclose(np.array(got), hf.pooler_output.numpy(), atol=1e-5, rtol=0, err_msg=str(grid))
        # mlx-vlm's own forward still runs on the padded tower, with the same values
        theirs_padded, _ = tower(mx.array(px), mx.array([list(grid)]))
        assert float(mx.abs(theirs_padded - want).max()) <= 1e-5, grid


def test_padding_is_idempotent_and_skips_aligned_heads(wide_heads, checkpoint_dir):
    tower = load_checkpoint(wide_heads, EngineConfig(dtype="float32")).model.vision_tower
    before = np.array(tower.blocks[0].attn.qkv.weight)
    assert pad_rotary_heads(tower) == 0
    np.testing.assert_array_equal(np.array(tower.blocks[0].attn.qkv.weight), before)
    aligned = load_checkpoint(checkpoint_dir("qwen3_vl"), EngineConfig(dtype="float32")).model.vision_tower
    assert aligned.blocks[0].attn.head_dim == 16 and not getattr(aligned.blocks[0].attn, "rotary_half", None)
