"""The attention swap: without a paged context the wrapped model is exactly mlx-vlm's model."""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import numpy as np

from batchjob.engine import EngineConfig
from batchjob.engine.attention import PagedAttention, install_paged_attention
from batchjob.engine.checkpoint import load_checkpoint
from batchjob.engine.preprocess import preprocess_video


def test_delegates_to_mlx_vlm_without_context(checkpoint_dir, rng, make_clip):
    ckpt = load_checkpoint(checkpoint_dir("qwen2_5_vl-gqa"), EngineConfig())
    clip = make_clip(rng, "swap")
    inputs = preprocess_video(clip.frames, clip.metadata, ckpt.vision)
    video_id = ckpt.video_token_id
    ids = mx.array([[1, 2, 3] + [video_id] * inputs.num_tokens + rng.integers(0, 100, 9).tolist()])

    def logits():
        out = ckpt.model(ids, pixel_values=mx.array(inputs.pixel_values), video_grid_thw=mx.array([inputs.grid_thw]))
        return np.array(out.logits)

    before = logits()
    assert install_paged_attention(ckpt.model.language_model) == 2
    assert install_paged_attention(ckpt.model.language_model) == 2  # idempotent: no double wrapping
    layers = ckpt.model.language_model.model.layers
    assert all(isinstance(layer.self_attn, PagedAttention) for layer in layers)
    assert not isinstance(layers[0].self_attn.inner, PagedAttention)
    np.testing.assert_array_equal(logits(), before)


def test_rotary_with_heads_on_axis_two_equals_mlx_vlms_head_major_call(rng):
    """The wrapper applies each family's M-RoPE to token-major q/k (heads on axis 2) so nothing is transposed
    and copied; the values must be bit-identical to mlx-vlm's own head-major call, in fp32 and bf16."""
    import importlib

    for family in ("qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe"):
        apply = importlib.import_module(f"mlx_vlm.models.{family}.language").apply_multimodal_rotary_pos_emb
        for dtype in (mx.float32, mx.bfloat16):
            t, hq, hkv, d = int(rng.integers(1, 40)), 4, 2, 32
            q, k = (mx.array(rng.standard_normal((1, t, h, d)).astype(np.float32)).astype(dtype) for h in (hq, hkv))
            cos, sin = (mx.array(rng.standard_normal((1, t, d)).astype(np.float32)).astype(dtype) for _ in "cs")
            q_ref, k_ref = apply(q.transpose(0, 2, 1, 3), k.transpose(0, 2, 1, 3), cos, sin, 1)
            q_tok, k_tok = apply(q, k, cos, sin, 2)
            assert mx.array_equal(q_tok, q_ref.transpose(0, 2, 1, 3)).item(), (family, dtype)
            assert mx.array_equal(k_tok, k_ref.transpose(0, 2, 1, 3)).item(), (family, dtype)


def test_stacked_projections_hold_one_copy_of_the_weights(checkpoint_dir, rng):
    """q/k/v and gate/up stacked at load: the same parameter count (no second copy), idempotent, and mlx-vlm's
    own modules (through the row slices) compute what they computed before."""
    from mlx.utils import tree_flatten
    from mlx_vlm.utils import load_model

    from batchjob.engine.lm_fusion import RowSlice, fuse_decoder_projections

    for name in ("qwen2_5_vl-gqa", "qwen3_vl"):
        lm = load_model(Path(checkpoint_dir(name))).language_model
        x = mx.array(rng.standard_normal((1, 7, lm.args.hidden_size)).astype(np.float32))
        layer = lm.model.layers[0]
        before = [np.array(p(x)) for p in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj,
                                           layer.mlp)]
        size = sum(v.size for _, v in tree_flatten(lm.parameters()))
        assert fuse_decoder_projections(lm) == len(lm.model.layers)
        assert fuse_decoder_projections(lm) == 0
        assert sum(v.size for _, v in tree_flatten(lm.parameters())) == size
        assert isinstance(layer.self_attn.q_proj, RowSlice) and "qkv_proj" in layer.self_attn
        after = [np.array(p(x)) for p in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj,
                                          layer.mlp)]
        for b, a in zip(before, after):
            np.testing.assert_allclose(a, b, atol=1e-5, rtol=0)
