"""Qwen3-VL and Qwen3-VL-MoE: timestamped temporal groups, interleaved M-RoPE, DeepStack.

Prompt: each temporal group (two frames) is written as `<t seconds><|vision_start|>` + its patches +
`<|vision_end|>`, replacing the chat template's `<|vision_start|><|video_pad|><|vision_end|>` (Qwen's original
layout, as vLLM and mlx-vlm render it; transformers 5.23 keeps the template's outer pair around the groups).
The time is each group's real time by default (the decoded frames' presentation times; see
preprocess.group_timestamps), which is what lets the model read irregular keyframes correctly.

Positions: every group is positioned like an image of one temporal patch: text runs on, the group's
tokens get (start, start + row, start + col), and the text after it continues at start + max(rows, cols)
(= max + 1, so transformers, vLLM and the original code agree). The rotary embedding interleaves the
(t, h, w) frequencies (mlx-vlm's `style="interleaved"`, checked against transformers by the parity tests).

Vision: the tower returns the merged features and one DeepStack feature set per `deepstack_visual_indexes`
entry; DeepStack set i is added to the video tokens' hidden states after LM layer i.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from ..fused_ops import GeluTanh
from ..lm_fusion import fuse_decoder_projections
from ..mrope import placeholder_runs
from ..patch_embed import matmul_patch_embed
from ..preprocess import load_vision_settings
from ..types import EngineError
from ..qwen3_vision import encode_qwen3
from ..vision_heads import pad_rotary_heads
from ..vision_mlp import pad_plain_mlps
from . import ModelFamily, VideoPrompt, video_rows


def qwen3_positions(token_ids: np.ndarray, video_token_id: int, rows: int, cols: int) -> np.ndarray:
    """M-RoPE positions `[3, L]` for a prompt whose every video run is one temporal group of rows x cols."""
    ids = np.asarray(token_ids)
    positions = np.empty((3, len(ids)), dtype=np.int64)
    cursor, next_pos = 0, 0
    hh, ww = np.meshgrid(np.arange(rows), np.arange(cols), indexing="ij")
    for start, end in placeholder_runs(ids, video_token_id):
        if end - start != rows * cols:
            raise ValueError(f"video run [{start}, {end}) has {end - start} tokens, expected {rows} x {cols}")
        positions[:, cursor:start] = np.arange(start - cursor) + next_pos
        next_pos += start - cursor
        positions[0, start:end] = next_pos
        positions[1, start:end] = hh.ravel() + next_pos
        positions[2, start:end] = ww.ravel() + next_pos
        next_pos += max(rows, cols)
        cursor = end
    positions[:, cursor:] = np.arange(len(ids) - cursor) + next_pos
    return positions


def timestamp_text(seconds: float) -> str:
    """One group's time as Qwen3-VL's processor writes it."""
    return f"<{seconds:.1f} seconds>"


class Qwen3VLFamily(ModelFamily):
    model_types = ("qwen3_vl", "qwen3_vl_moe")
    label = "Qwen3-VL / Qwen3-VL-MoE"

    def check_config(self) -> None:
        config_file = self.path / "config.json"
        text = self.hf_config.get("text_config")
        if not isinstance(text, dict) or "hidden_size" not in text:
            raise EngineError(f"{config_file}: Qwen3-VL settings belong under text_config (the hub layout); "
                              "this config has none")
        rope = text.get("rope_scaling") or {}
        if "mrope_section" not in rope or "rope_theta" not in text:
            raise EngineError(
                f"{config_file}: text_config has no rope_scaling.mrope_section / rope_theta (a transformers 5 "
                "save_pretrained layout with rope_parameters?); mlx-vlm 0.7.10 would silently use mrope_section "
                "[24, 20, 20]. Use the hub layout: text_config.rope_theta and text_config.rope_scaling: "
                "{rope_type: default, mrope_section: [...], mrope_interleaved: true}")
        if rope.get("mrope_interleaved") is False:
            raise EngineError(f"{config_file}: rope_scaling.mrope_interleaved is false; Qwen3-VL is trained with "
                              "interleaved M-RoPE and mlx-vlm only implements that")

    def vision_settings(self, engine_config):
        self.vision = load_vision_settings(self.path, engine_config.min_pixels, engine_config.max_pixels,
                                           engine_config.temporal_step, engine_config.timestamps)
        return self.vision

    @property
    def vision_act(self) -> str:
        """The vision blocks' MLP activation (`vision_config.hidden_act`; Qwen3-VL's default)."""
        return (self.hf_config.get("vision_config") or {}).get("hidden_act", "gelu_pytorch_tanh")

    @property
    def num_deepstack(self) -> int:
        return len((self.hf_config.get("vision_config") or {}).get("deepstack_visual_indexes") or [])

    def correct_model(self, model) -> None:
        """mlx-vlm 0.7.10's Qwen3-VL-MoE tower swaps its two GELUs (mergers exact, block MLPs per hidden_act)."""
        tower = model.vision_tower
        block_gelu = nn.GELU(approx="tanh") if "tanh" in self.vision_act else nn.GELU()
        for merger in [tower.merger, *getattr(tower, "deepstack_merger_list", [])]:
            merger.act_fn = nn.GELU()
        for block in tower.blocks:
            block.mlp.act_fn = block_gelu

    def tune_model(self, model) -> None:
        """Exact speed-ups: block MLPs padded to the GEMM tile, their tanh GELU as one fp32 kernel (fused_ops.py),
        attention heads padded to whole-word rotary halves (vision_heads.py), the patch embedding as a matmul, the
        decoder's projections fused (lm_fusion.py)."""
        pad_plain_mlps(model.vision_tower.blocks)   # GEMM-friendly widths (vision_mlp.py)
        pad_rotary_heads(model.vision_tower)        # rotary halves of whole 16-byte words (vision_heads.py)
        for block in model.vision_tower.blocks if "tanh" in self.vision_act else ():
            if isinstance(getattr(block.mlp, "act_fn", None), nn.GELU):
                block.mlp.act_fn = GeluTanh()
        matmul_patch_embed(model.vision_tower)      # the Conv3d as the matmul it is (patch_embed.py)
        fuse_decoder_projections(model.language_model)

    def video_prompt(self, prompts, question, options, plan) -> VideoPrompt:
        tok = prompts.tokenizer
        start, end, pad = (tok.convert_ids_to_tokens(int(self.hf_config[key])) for key in
                           ("vision_start_token_id", "vision_end_token_id", "video_token_id"))
        text = prompts.rendered(question, options)
        outer = start + pad + end
        if text.count(outer) != 1:
            raise EngineError(f"the chat template rendered {text.count(outer)} '{outer}' video placeholders; "
                              "expected exactly one. Is this the checkpoint's own template?")
        groups = "".join(timestamp_text(t) + start + pad + end for t in plan.timestamps)
        ids = np.asarray(tok.encode(text.replace(outer, groups), add_special_tokens=False), dtype=np.int64)
        merge = self.vision.merge_size
        rows, cols = plan.grid_thw[1] // merge, plan.grid_thw[2] // merge
        ids = np.repeat(ids, np.where(ids == self.video_token_id, rows * cols, 1))
        runs = placeholder_runs(ids, self.video_token_id)
        if len(runs) != plan.grid_thw[0]:
            raise EngineError(f"the prompt has {len(runs)} video groups for {plan.grid_thw[0]} temporal patches")
        positions = qwen3_positions(ids, self.video_token_id, rows, cols)
        return VideoPrompt(ids, positions, (runs[0][0], runs[-1][1]), video_rows(ids, self.video_token_id))

    def encode_video(self, model, pixel_values, grid_thw, dtype) -> mx.array:
        """Our planned tower forward (no host sync, one SDPA per block): equal to mlx-vlm's."""
        features, deepstack = encode_qwen3(model.vision_tower, mx.array(pixel_values).astype(dtype), [tuple(grid_thw)])
        return mx.concatenate([features, *deepstack], axis=-1).astype(dtype)
