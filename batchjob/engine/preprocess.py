"""Video frames -> the vision tower's input, exactly as the checkpoint's own processor would make it.

transformers' Qwen2-VL *video* processor needs torchvision, which cannot run beside the CPU torch build
here, so each frame goes through the checkpoint's *image* processor (PIL backend: smart_resize to the pixel
bounds, bicubic resize, rescale, CLIP mean/std, patchify) and the frames are then grouped in time the way
the video processor groups them: `temporal_patch_size` consecutive frames form one temporal patch, and a
short last group is padded by repeating the last frame.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .types import EngineError

# Qwen2-VL's processor samples 2 frames per second by default; used only when loader metadata has no fps.
DEFAULT_SAMPLING_FPS = 2.0


@dataclass(frozen=True)
class VisionSettings:
    """The processor settings that decide pixel values and the token grid."""

    min_pixels: int
    max_pixels: int
    patch_size: int = 14
    temporal_patch_size: int = 2
    merge_size: int = 2
    image_mean: tuple[float, ...] = (0.48145466, 0.4578275, 0.40821073)
    image_std: tuple[float, ...] = (0.26862954, 0.26130258, 0.27577711)


@dataclass(frozen=True)
class VideoInputs:
    """One clip ready for the vision tower."""

    pixel_values: np.ndarray  # float32 [grid_t * grid_h * grid_w, C * temporal_patch * patch * patch]
    grid_thw: tuple[int, int, int]  # in patches, before the spatial merge
    second_per_grid_t: float  # seconds covered by one temporal patch (drives temporal M-RoPE positions)
    num_tokens: int  # video placeholder tokens in the prompt: grid_t * grid_h * grid_w / merge**2


def _pixel_bounds(config: dict) -> tuple[int | None, int | None]:
    size = config.get("size") or {}
    return (config.get("min_pixels", size.get("shortest_edge")), config.get("max_pixels", size.get("longest_edge")))


def load_vision_settings(model_dir: Path, min_pixels: int | None, max_pixels: int | None) -> VisionSettings:
    """Read the checkpoint's processor config (video config first, as transformers does), apply overrides."""
    candidates = [model_dir / "video_preprocessor_config.json", model_dir / "preprocessor_config.json"]
    found = [p for p in candidates if p.is_file()]
    if not found:
        raise EngineError(
            f"{model_dir}: no preprocessor_config.json (or video_preprocessor_config.json); the engine needs the "
            "checkpoint's processor settings. Copy the processor files from the original checkpoint."
        )
    config = json.loads(found[0].read_text())
    file_min, file_max = _pixel_bounds(config)
    lo = min_pixels if min_pixels is not None else file_min
    hi = max_pixels if max_pixels is not None else file_max
    if lo is None or hi is None or lo > hi:
        raise EngineError(
            f"{found[0]}: pixel bounds min_pixels={lo}, max_pixels={hi} are missing or inverted; set "
            "EngineConfig.min_pixels / max_pixels"
        )
    return VisionSettings(
        min_pixels=int(lo), max_pixels=int(hi),
        patch_size=int(config.get("patch_size", 14)),
        temporal_patch_size=int(config.get("temporal_patch_size", 2)),
        merge_size=int(config.get("merge_size", 2)),
        image_mean=tuple(config.get("image_mean", VisionSettings.image_mean)),
        image_std=tuple(config.get("image_std", VisionSettings.image_std)),
    )


def image_processor(settings: VisionSettings):
    """transformers' PIL Qwen2-VL image processor configured like the checkpoint."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    return Qwen2VLImageProcessorPil(
        min_pixels=settings.min_pixels, max_pixels=settings.max_pixels, patch_size=settings.patch_size,
        temporal_patch_size=settings.temporal_patch_size, merge_size=settings.merge_size,
        image_mean=list(settings.image_mean), image_std=list(settings.image_std),
    )


def sampling_fps(metadata: dict) -> float:
    """Frames per second of the *sampled* frames, from the loader's `fps` and `frames_indices`.

    Keyframe sampling is not evenly spaced, so we use the mean rate over the sampled span:
    `(n - 1) / ((last_index - first_index) / fps)`. That keeps the last temporal position where the clip's
    real duration puts it. With one frame (or all indices equal) there is no span: the source fps is used.
    """
    fps = metadata.get("fps")
    fps = float(fps) if fps else DEFAULT_SAMPLING_FPS
    indices = metadata.get("frames_indices")
    if indices is None or len(indices) < 2:
        return fps
    span = float(indices[-1]) - float(indices[0])
    return fps if span <= 0 else (len(indices) - 1) * fps / span


def check_frames(frames: np.ndarray) -> None:
    """ValueError (a per-request error) unless `frames` is what the loaders return: uint8 [T, H, W, 3]."""
    if not (isinstance(frames, np.ndarray) and frames.ndim == 4 and frames.shape[-1] == 3 and len(frames)):
        shape = getattr(frames, "shape", None)
        raise ValueError(f"clip frames must be a non-empty uint8 array [T, H, W, 3], got shape {shape}")
    if frames.dtype != np.uint8:
        raise ValueError(f"clip frames must be uint8 RGB, got dtype {frames.dtype}")


def preprocess_video(frames: np.ndarray, metadata: dict, settings: VisionSettings, processor=None) -> VideoInputs:
    """Pixel values and grid for one clip (see the module docstring for the method)."""
    check_frames(frames)
    tp = settings.temporal_patch_size
    pad = (-len(frames)) % tp
    if pad:
        frames = np.concatenate([frames, np.repeat(frames[-1:], pad, axis=0)])
    processor = processor or image_processor(settings)
    out = processor(list(frames), return_tensors="np")
    grids = out["image_grid_thw"]
    _, gh, gw = (int(v) for v in grids[0])
    per_frame = np.asarray(out["pixel_values"], dtype=np.float32)
    c, p = 3, settings.patch_size
    n = gh * gw
    # Each image patch repeats its frame over the temporal slot; keep slot 0 and put the real frames there.
    per_frame = per_frame.reshape(len(frames), n, c, tp, p, p)[:, :, :, 0]
    gt = len(frames) // tp
    pixel_values = per_frame.reshape(gt, tp, n, c, p, p).transpose(0, 2, 3, 1, 4, 5).reshape(gt * n, c * tp * p * p)
    return VideoInputs(
        pixel_values=np.ascontiguousarray(pixel_values),
        grid_thw=(gt, gh, gw),
        second_per_grid_t=tp / sampling_fps(metadata),
        num_tokens=gt * n // settings.merge_size**2,
    )
