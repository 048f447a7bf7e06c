"""The engine's public data: what a caller hands in (clips, requests, settings) and what comes back.

Kept free of MLX so the pipeline can build requests and read results without touching the model.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:  # preprocess imports EngineError from here
    from .preprocess import VideoInputs

DEFAULT_PROMPT_TEMPLATE = (
    "{question}\n{options}\nAnswer with the option's letter from the given choices directly."
)


class EngineError(Exception):
    """A problem found at load or construction time (architecture, files, memory budget, option labels)."""


@dataclass(frozen=True)
class Clip:
    """One decoded video: frames from `batchjob.loaders.load_video` and the loader's metadata.

    `media_id` keys prefix sharing: two clips with the same media_id must hold the same frames, because the
    KV blocks computed for one are reused for the other. `inputs` (from `preprocess_video` with the
    checkpoint's `VisionSettings`) may replace the frames: the CPU-heavy resize and patchify then happen
    wherever the caller made them, e.g. in a decode worker, and `frames` may be None.
    """

    frames: np.ndarray | None  # uint8 [T, H, W, 3] RGB
    metadata: dict
    media_id: str
    inputs: VideoInputs | None = None


@dataclass(frozen=True)
class ClassifyRequest:
    request_id: str
    clip: Clip
    question: str
    options: tuple[str, ...]  # 2..5 option texts


@dataclass
class ClassifyResult:
    request_id: str
    choice: int | None  # index into options (None on error)
    probs: list[float]  # softmax over the option-label tokens' logits at the last position; [] on error
    prompt_tokens: int
    cached_tokens: int
    error: str | None = None  # per-request error; the other requests of the batch go on
    logprobs: list[float] = field(default_factory=list)  # log of `probs`, computed in float64 from the logits


@dataclass
class EngineConfig:
    dtype: str = "auto"  # "auto" = float32 on CPU (no fast half-precision BLAS there), bfloat16 on a GPU
    device: str = "auto"  # "auto" = the GPU (Metal or CUDA) when MLX sees one, else CPU; "gpu" fails without one
    min_pixels: int | None = None  # None = the checkpoint processor's value
    max_pixels: int | None = None
    max_num_batched_tokens: int | str = "auto"  # tokens per forward pass; "auto" = from the model and device
    # (token_budget.py: 8192 on a CPU, up to 32768 on a GPU as its memory allows)
    max_model_len: int = 32768
    memory_budget_gb: float | None = None  # None = sized from the device (memory_budget.py); KV pool capped
    host_reserved_bytes: int = 0   # other processes' memory beside the engine where they share the device's
    block_size: int = 16
    option_labels: tuple[str, ...] = ("A", "B", "C", "D", "E")
    prompt_template: str = DEFAULT_PROMPT_TEMPLATE
    system_prompt: str | None = None
    # Additions (defaults keep the documented interface): turn per-clip prefix sharing off (benchmark
    # baseline), and use a fixed attention backend name instead of probing ("portable").
    enable_prefix_sharing: bool = True
    attention_backend: str = "auto"
    # "nominal": n / total_num_frames * fps, the temporal step the model was trained with (transformers, vLLM);
    # "actual": the sampled frames' mean spacing (see preprocess.sampling_fps).
    temporal_step: str = "nominal"
    # Qwen3-VL's per-group time text: "actual" = the decoded frames' presentation times (loader metadata
    # `frames_timestamps`), "nominal" = frames_indices / fps as transformers' processor computes it.
    timestamps: str = "actual"

    def validate(self) -> None:
        """Raise EngineError naming the setting and the fix for settings no schedule could run with."""
        checks = [
            (self.max_num_batched_tokens == "auto" or (type(self.max_num_batched_tokens) is int
                                                        and self.max_num_batched_tokens >= 1),
             "max_num_batched_tokens must be 'auto' or an integer >= 1"),
            (self.max_model_len >= 2, "max_model_len must be >= 2"),
            (self.block_size >= 1, "block_size must be >= 1"),
            (self.memory_budget_gb is None or self.memory_budget_gb > 0, "memory_budget_gb must be > 0 or None"),
            (self.min_pixels is None or self.min_pixels > 0, "min_pixels must be > 0 or None"),
            (self.max_pixels is None or self.max_pixels > 0, "max_pixels must be > 0 or None"),
            (
                self.min_pixels is None or self.max_pixels is None or self.min_pixels <= self.max_pixels,
                "min_pixels must be <= max_pixels",
            ),
            (len(self.option_labels) >= 2, "option_labels needs at least two labels"),
            (len(set(self.option_labels)) == len(self.option_labels), "option_labels must be distinct"),
            ("{question}" in self.prompt_template and "{options}" in self.prompt_template,
             "prompt_template must contain {question} and {options}"),
            (self.dtype in ("auto", "float32", "float16", "bfloat16"),
             "dtype must be one of auto, float32, float16, bfloat16"),
            (self.temporal_step in ("nominal", "actual"), "temporal_step must be one of nominal, actual"),
            (self.timestamps in ("actual", "nominal"), "timestamps must be one of actual, nominal"),
            (self.device in ("auto", "cpu", "gpu"), "device must be one of auto, cpu, gpu"),
            (self.attention_backend in ("auto", "portable", "metal", "cuda"),
             "attention_backend must be one of auto, portable, metal, cuda"),
        ]
        for ok, message in checks:
            if not ok:
                raise EngineError(f"EngineConfig: {message} (got {self!r})")
