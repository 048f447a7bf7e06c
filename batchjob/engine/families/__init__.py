"""Model families: what differs between Qwen2-VL / Qwen2.5-VL and Qwen3-VL, behind one small interface.

The engine (scheduler, paged attention, packing, prefix sharing) is family-agnostic; a family knows how its
checkpoint is laid out, how a clip becomes prompt tokens (timestamps or not) and M-RoPE positions, how the
vision tower's output is consumed (DeepStack or not), and which mlx-vlm bugs to correct at load. The
checkpoint's `model_type` picks the family; a new family is one new module registered here.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..types import EngineError


@dataclass(frozen=True)
class VideoPrompt:
    """A request's prompt with its clip expanded: what the scheduler and the forward pass need."""

    token_ids: np.ndarray  # int64 [L]
    positions: np.ndarray  # int64 [3, L] M-RoPE positions
    video_span: tuple[int, int]  # [start, end): the clip's part of the prompt (timestamps included)
    video_rows: np.ndarray  # int32 [L]: row of the clip's features for each video token, -1 elsewhere


def video_rows(token_ids: np.ndarray, video_token_id: int) -> np.ndarray:
    """Feature row of each video placeholder (in prompt order), -1 for every other token."""
    is_video = np.asarray(token_ids) == video_token_id
    return np.where(is_video, np.cumsum(is_video) - 1, -1).astype(np.int32)


class ModelFamily:
    """Interface; see qwen2.py and qwen3.py. One instance per loaded checkpoint (holds its settings)."""

    model_types: tuple[str, ...] = ()
    label = ""

    def __init__(self, hf_config: dict, path: Path):
        self.hf_config = hf_config
        self.path = path

    # --- load time -----------------------------------------------------------------------------------------
    def check_config(self) -> None:
        """EngineError for a config.json layout mlx-vlm would misread (silently or not)."""

    def vision_settings(self, engine_config):
        """Read the processor settings (with the job's overrides); kept as `self.vision` for prompts."""
        raise NotImplementedError

    def fix_model(self, model) -> None:
        """What loading does to mlx-vlm's model, in place: the corrections, then the exact speed-ups."""
        self.correct_model(model)
        self.tune_model(model)

    def correct_model(self, model) -> None:
        """Correct known mlx-vlm model-definition bugs in place; parameters keep the checkpoint's layout (what
        training needs: it must compute what the engine computes and save weights the hub way)."""

    def tune_model(self, model) -> None:
        """Exact speed-ups in place (fused or padded layers): the same outputs, another parameter layout."""

    def kv_shape(self, language_model) -> tuple[int, int]:
        """(num_kv_heads, head_dim) of the decoder's attention, for the KV cache."""
        attn = language_model.model.layers[0].self_attn
        attn = getattr(attn, "inner", attn)
        return attn.n_kv_heads, attn.head_dim

    @property
    def video_token_id(self) -> int:
        return int(self.hf_config.get("video_token_id", 151656))

    @property
    def num_deepstack(self) -> int:
        """Vision feature sets added to the first LM layers' hidden states (0: none)."""
        return 0

    # --- per request ---------------------------------------------------------------------------------------
    def video_prompt(self, prompts, question: str, options, plan) -> VideoPrompt:
        raise NotImplementedError

    def encode_video(self, model, pixel_values: np.ndarray, grid_thw: tuple[int, int, int], dtype):
        """`[num_video_tokens, hidden * (1 + num_deepstack)]`: main features, then each DeepStack set."""
        raise NotImplementedError


def _registry() -> dict[str, type[ModelFamily]]:
    from .qwen2 import Qwen2VLFamily
    from .qwen3 import Qwen3VLFamily

    return {t: fam for fam in (Qwen2VLFamily, Qwen3VLFamily) for t in fam.model_types}


# Model types we know and do not run yet, with the reason (a clear error at start instead of a wrong answer).
UNSUPPORTED = {
    "qwen3_5": "Qwen3.5 (hybrid Gated DeltaNet + attention) needs a recurrent state per sequence beside the paged "
               "KV cache (and kept at the end of a shared video prefix); the engine does not carry that state yet",
    "qwen3_5_moe": "Qwen3.5-MoE (hybrid Gated DeltaNet + attention) needs a recurrent state per sequence beside "
                   "the paged KV cache; the engine does not carry that state yet",
}


def supported_model_types() -> tuple[str, ...]:
    return tuple(sorted(_registry()))


def family_for(hf_config: dict, path: Path) -> ModelFamily:
    """The family of a checkpoint's config.json; EngineError naming the supported types otherwise."""
    model_type = hf_config.get("model_type")
    registry = _registry()
    if model_type in UNSUPPORTED:
        raise EngineError(f"{path / 'config.json'}: model_type {model_type!r} is not supported yet: "
                          f"{UNSUPPORTED[model_type]}. Supported: {', '.join(sorted(registry))}")
    if model_type not in registry:
        raise EngineError(f"{path / 'config.json'}: model_type {model_type!r} is not supported; the engine runs "
                          f"{', '.join(sorted(registry))} checkpoints (Qwen2-VL, Qwen2.5-VL, Qwen3-VL, Qwen3-VL-MoE)")
    family = registry[model_type](hf_config, path)
    family.check_config()
    return family
