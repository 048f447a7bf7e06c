"""Qwen2-VL and Qwen2.5-VL: one run of video placeholders, temporal M-RoPE scaled by the clip's time.

Qwen2.5-VL's temporal position step is `tokens_per_second * second_per_grid_t` (see mrope.py and
preprocess.sampling_fps); Qwen2-VL steps by one per temporal patch.
"""

from __future__ import annotations

import mlx.core as mx

from ..lm_fusion import fuse_decoder_projections
from ..mrope import mrope_positions, placeholder_runs, video_temporal_interval
from ..patch_embed import matmul_patch_embed
from ..preprocess import load_vision_settings
from ..qwen2_vision import encode_qwen2
from ..qwen25_vision import encode_qwen25, patch_window_index
from ..vision_mlp import fuse_gated_mlps
from ..types import EngineError
from . import ModelFamily, VideoPrompt, video_rows


class Qwen2VLFamily(ModelFamily):
    model_types = ("qwen2_5_vl", "qwen2_vl")
    label = "Qwen2-VL / Qwen2.5-VL"

    def check_config(self) -> None:
        if "hidden_size" not in self.hf_config:
            raise EngineError(
                f"{self.path / 'config.json'}: text settings are nested under text_config (transformers 5 "
                "save_pretrained layout), which mlx-vlm cannot read; use the hub's flat layout (hidden_size etc. at "
                "top level, rope_scaling: {type: mrope, mrope_section: [...]})"
            )

    @property
    def tokens_per_second(self) -> float | None:
        """None for Qwen2-VL (temporal positions step by one)."""
        if self.hf_config["model_type"] != "qwen2_5_vl":
            return None
        return float((self.hf_config.get("vision_config") or {}).get("tokens_per_second", 2))

    def vision_settings(self, engine_config):
        # timestamps is unused by this family but kept, so decoder-side settings (made without the family) match
        self.vision = load_vision_settings(self.path, engine_config.min_pixels, engine_config.max_pixels,
                                           engine_config.temporal_step, engine_config.timestamps)
        return self.vision

    def video_prompt(self, prompts, question, options, plan) -> VideoPrompt:
        ids = prompts.token_ids(question, options, plan.num_tokens)
        interval = video_temporal_interval(self.tokens_per_second, plan.second_per_grid_t)
        positions = mrope_positions(ids, self.video_token_id, [plan.grid_thw], [interval], self.vision.merge_size)
        span = placeholder_runs(ids, self.video_token_id)[0]
        return VideoPrompt(ids, positions, span, video_rows(ids, self.video_token_id))

    def correct_model(self, model) -> None:
        if self.hf_config["model_type"] == "qwen2_5_vl":   # mlx-vlm 0.7.10's empty windows (docs/upstream.md)
            patch_window_index(model.vision_tower)

    def tune_model(self, model) -> None:
        if self.hf_config["model_type"] == "qwen2_5_vl":
            fuse_gated_mlps(model.vision_tower.blocks)     # GEMM-friendly widths (vision_mlp.py)
        matmul_patch_embed(model.vision_tower)             # the Conv3d as the matmul it is (patch_embed.py)
        fuse_decoder_projections(model.language_model)     # one GEMM for q/k/v, one for gate/up (lm_fusion.py)

    def encode_video(self, model, pixel_values, grid_thw, dtype) -> mx.array:
        """Our packed tower forward (the plan built once per call, no host sync per layer): equal to mlx-vlm's."""
        encode = encode_qwen25 if self.hf_config["model_type"] == "qwen2_5_vl" else encode_qwen2
        return encode(model.vision_tower, mx.array(pixel_values).astype(dtype), [tuple(grid_thw)]).astype(dtype)
