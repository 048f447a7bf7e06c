"""The attention swap: without a paged context the wrapped model is exactly mlx-vlm's model."""

from __future__ import annotations

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
