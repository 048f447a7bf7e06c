"""Video frames -> the vision tower's input, exactly as the checkpoint's own processor would make it.

Frames are resized to the smart_resize grid the way transformers' *video* processor resizes them
(resize.py: PyTorch's fixed-point antialiased bicubic, reproduced in numpy), then rescaled, normalised and
cut into patches as the checkpoint's *image* processor does it (patchify.py), and grouped in time the way
the video processor groups them: `temporal_patch_size` consecutive frames form one temporal patch, and a
short last group is padded by repeating the last frame. No transformers and no torch: decoders run this
for every clip, and each of those imports costs a decoder process memory and start-up time.

Qwen3-VL's video processor differs in two ways that change the tokens: its pixel budget
(`size.longest_edge`) bounds the whole clip (`frames x height x width`), not each frame, and it rejects clips
of one frame (that one frame is doubled first, as mlx-vlm does). Its prompt also carries each temporal
group's time as text (`group_timestamps`).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .patchify import normalize_table, patchify
from .resize import resize_frames
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
    temporal_step: str = "nominal"  # how the sampled frame rate is read from the loader's metadata: see sampling_fps
    pixel_budget: str = "frame"  # "frame": min/max_pixels per frame (Qwen2-VL); "clip": over all frames (Qwen3-VL)
    timestamps: str = "actual"  # Qwen3-VL's timestamp text: see group_timestamps


@dataclass(frozen=True)
class VideoPlan:
    """What the prompt needs to know about a clip before any pixel is processed."""

    grid_thw: tuple[int, int, int]  # in patches, before the spatial merge
    second_per_grid_t: float  # seconds covered by one temporal patch (drives temporal M-RoPE positions)
    num_tokens: int  # video placeholder tokens in the prompt: grid_t * grid_h * grid_w / merge**2
    timestamps: tuple[float, ...]  # seconds of each temporal group (Qwen3-VL writes them into the prompt)


@dataclass(frozen=True)
class VideoInputs(VideoPlan):
    """One clip ready for the vision tower, and the settings it was made with.

    Made wherever there is CPU to spare (the pipeline's decode workers make it, so the engine's process
    only runs the model); the engine accepts it only when `settings` equal its checkpoint's own.
    """

    # [grid_t * grid_h * grid_w, C * temporal_patch * patch * patch]: float32 pixel values, or uint8 patch bytes
    # (preprocess_video(normalise=False)) that the engine normalises on its device
    pixel_values: np.ndarray
    settings: VisionSettings


def _pixel_bounds(config: dict) -> tuple[int | None, int | None]:
    size = config.get("size") or {}
    return (config.get("min_pixels", size.get("shortest_edge")), config.get("max_pixels", size.get("longest_edge")))


TEMPORAL_STEPS = ("nominal", "actual")
TIMESTAMP_RULES = ("actual", "nominal")
# Model types whose video processor applies the pixel budget to the whole clip.
CLIP_BUDGET_MODEL_TYPES = ("qwen3_vl", "qwen3_vl_moe")


def _model_type(model_dir: Path) -> str | None:
    config_file = model_dir / "config.json"
    return json.loads(config_file.read_text()).get("model_type") if config_file.is_file() else None


def load_vision_settings(model_dir: Path, min_pixels: int | None, max_pixels: int | None,
                         temporal_step: str = "nominal", timestamps: str = "actual") -> VisionSettings:
    """Read the checkpoint's processor config (video config first, as transformers does), apply overrides.

    For Qwen3-VL checkpoints min/max_pixels bound the whole clip, as its video processor's `size` does."""
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
    if temporal_step not in TEMPORAL_STEPS:
        raise EngineError(f"temporal_step must be one of {', '.join(TEMPORAL_STEPS)}, got {temporal_step!r}")
    if timestamps not in TIMESTAMP_RULES:
        raise EngineError(f"timestamps must be one of {', '.join(TIMESTAMP_RULES)}, got {timestamps!r}")
    budget = "clip" if _model_type(model_dir) in CLIP_BUDGET_MODEL_TYPES else "frame"
    return VisionSettings(
        min_pixels=int(lo), max_pixels=int(hi), temporal_step=temporal_step, pixel_budget=budget,
        timestamps=timestamps,
        patch_size=int(config.get("patch_size", 14)),
        temporal_patch_size=int(config.get("temporal_patch_size", 2)),
        merge_size=int(config.get("merge_size", 2)),
        image_mean=tuple(config.get("image_mean", VisionSettings.image_mean)),
        image_std=tuple(config.get("image_std", VisionSettings.image_std)),
    )


def sampling_fps(metadata: dict, num_frames: int | None = None, rule: str = "nominal") -> float:
    """Frames per second of the *sampled* frames, which sets the temporal M-RoPE step.

    `nominal` is the convention the model was trained with, as transformers, vLLM and Qwen's own
    preprocessing compute it: `n / total_num_frames * fps` (n sampled frames spread over the clip).
    `actual` is the mean spacing of the frames really picked, `(n - 1) * fps / (last - first index)`: for
    keyframe sampling it puts the last temporal position where the clip's real time puts it, but the model
    never saw that step in training. Missing `total_num_frames` makes `nominal` fall back to `actual`; no
    span (one frame, or all indices equal) falls back to the source fps, and no fps to Qwen's default 2.
    """
    if rule not in TEMPORAL_STEPS:
        raise ValueError(f"temporal step rule must be one of {', '.join(TEMPORAL_STEPS)}, got {rule!r}")
    fps = metadata.get("fps")
    fps = float(fps) if fps else DEFAULT_SAMPLING_FPS
    indices = metadata.get("frames_indices")
    n = num_frames if num_frames is not None else (len(indices) if indices is not None else None)
    total = metadata.get("total_num_frames")
    if rule == "nominal" and n and total and int(total) > 0 and metadata.get("fps"):
        return n / int(total) * fps
    if indices is None or len(indices) < 2:
        return fps
    span = float(indices[-1]) - float(indices[0])
    return fps if span <= 0 else (len(indices) - 1) * fps / span


def group_timestamps(metadata: dict, num_frames: int, temporal_patch: int = 2,
                     rule: str = "actual") -> tuple[float, ...]:
    """Seconds of each temporal group, as Qwen3-VL's processor computes them: the mean of the group's first and
    last frame times, a short last group padded with its last frame.

    `nominal`: frame times are `frames_indices / fps`, exactly what transformers' processor computes (fps 24
    when unknown, as there). `actual`: the decoded frames' own presentation times (`frames_timestamps` in the
    loader's metadata), which differ from the nominal ones for irregular keyframes; without them, nominal."""
    if rule not in TIMESTAMP_RULES:
        raise ValueError(f"timestamps rule must be one of {', '.join(TIMESTAMP_RULES)}, got {rule!r}")
    times = metadata.get("frames_timestamps") if rule == "actual" else None
    if times is None or len(times) != num_frames:
        fps = float(metadata.get("fps") or 24.0)
        indices = metadata.get("frames_indices")
        if indices is None or len(indices) != num_frames:
            indices = range(num_frames)  # no source indices: frames taken as consecutive
        times = [int(i) / fps for i in indices]
    times = [float(t) for t in times]
    if len(times) % temporal_patch:
        times += [times[-1]] * (temporal_patch - len(times) % temporal_patch)
    return tuple((times[i] + times[i + temporal_patch - 1]) / 2 for i in range(0, len(times), temporal_patch))


def _fit_pixels(height: int, width: int, factor: int, min_pixels: int, max_pixels: int, frames: int = 1,
                frames_bar: int = 1) -> tuple[int, int]:
    """smart_resize's core, shared by both budgets: round to multiples of `factor`, then scale both sides so
    frames x height x width falls inside [min_pixels, max_pixels] (transformers' arithmetic, step for step)."""
    h_bar, w_bar = round(height / factor) * factor, round(width / factor) * factor
    if frames_bar * h_bar * w_bar > max_pixels:
        beta = math.sqrt((frames * height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif frames_bar * h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (frames * height * width))
        h_bar, w_bar = math.ceil(height * beta / factor) * factor, math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def frame_smart_resize(height: int, width: int, factor: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """Qwen2-VL's smart_resize: (height, width) multiples of `factor` with each frame's pixels inside
    [min_pixels, max_pixels] (same arithmetic as transformers' image_processing_qwen2_vl)."""
    if max(height, width) / min(height, width) > 200:
        raise ValueError(f"aspect ratio {max(height, width) / min(height, width):.0f} is above 200")
    return _fit_pixels(height, width, factor, min_pixels, max_pixels)


def clip_smart_resize(num_frames: int, height: int, width: int, factor: int, min_pixels: int, max_pixels: int,
                      temporal_factor: int = 2) -> tuple[int, int]:
    """Qwen3-VL's video smart_resize: (height, width) multiples of `factor` with the *clip* (frames x h x w)
    inside [min_pixels, max_pixels] (same arithmetic as transformers' video_processing_qwen3_vl)."""
    if num_frames < temporal_factor:
        raise ValueError(f"{num_frames} frames; Qwen3-VL needs at least {temporal_factor} (double a single frame)")
    if height < factor or width < factor:
        scale = max(factor / height, factor / width)
        height, width = int(height * scale), int(width * scale)
    if max(height, width) / min(height, width) > 200:
        raise ValueError(f"aspect ratio {max(height, width) / min(height, width):.0f} is above 200")
    t_bar = round(num_frames / temporal_factor) * temporal_factor
    return _fit_pixels(height, width, factor, min_pixels, max_pixels, num_frames, t_bar)


def check_frames(frames: np.ndarray) -> None:
    """ValueError (a per-request error) unless `frames` is what the loaders return: uint8 [T, H, W, 3]."""
    if not (isinstance(frames, np.ndarray) and frames.ndim == 4 and frames.shape[-1] == 3 and len(frames)):
        shape = getattr(frames, "shape", None)
        raise ValueError(f"clip frames must be a non-empty uint8 array [T, H, W, 3], got shape {shape}")
    if frames.dtype != np.uint8:
        raise ValueError(f"clip frames must be uint8 RGB, got dtype {frames.dtype}")


def plan_video(shape: tuple[int, ...], metadata: dict, settings: VisionSettings) -> VideoPlan:
    """Grid, token count and temporal step for `T` frames of `H x W` (`shape` = frames.shape)."""
    t, h, w = (int(v) for v in shape[:3])
    p, merge, tp = settings.patch_size, settings.merge_size, settings.temporal_patch_size
    if settings.pixel_budget == "clip":
        height, width = clip_smart_resize(max(t, tp), h, w, p * merge, settings.min_pixels, settings.max_pixels, tp)
    else:
        height, width = frame_smart_resize(h, w, p * merge, settings.min_pixels, settings.max_pixels)
    grid = (math.ceil(t / tp), height // p, width // p)
    return VideoPlan(grid_thw=grid, second_per_grid_t=tp / sampling_fps(metadata, t, settings.temporal_step),
                     num_tokens=grid[0] * grid[1] * grid[2] // merge**2,
                     timestamps=group_timestamps(metadata, t, tp, settings.timestamps))


def check_prepared(inputs: VideoInputs, settings: VisionSettings) -> None:
    """ValueError (a per-request error) unless `inputs` were made for this checkpoint's processor settings."""
    if inputs.settings != settings:
        raise ValueError(f"clip inputs were prepared with processor settings {inputs.settings}, but this checkpoint "
                         f"uses {settings}; prepare them with the engine's own settings (or pass frames)")
    gt, gh, gw = inputs.grid_thw
    width = 3 * settings.temporal_patch_size * settings.patch_size**2
    if getattr(inputs.pixel_values, "dtype", None) not in (np.float32, np.uint8):
        raise ValueError(f"clip inputs: pixel_values must be float32 values or uint8 patch bytes, not "
                         f"{getattr(inputs.pixel_values, 'dtype', type(inputs.pixel_values).__name__)}")
    if getattr(inputs.pixel_values, "shape", None) != (gt * gh * gw, width):
        raise ValueError(f"clip inputs: pixel_values shape {getattr(inputs.pixel_values, 'shape', None)} does not "
                         f"match grid {inputs.grid_thw} ({gt * gh * gw} patches x {width})")


def preprocess_video(frames: np.ndarray, metadata: dict, settings: VisionSettings, *,
                     normalise: bool = True) -> VideoInputs:
    """Pixel values and grid for one clip (see the module docstring for the method). `normalise=False` keeps
    the patches' uint8 bytes (a quarter of the size; the engine makes the same float32 values on its device)."""
    check_frames(frames)
    plan = plan_video(frames.shape, metadata, settings)
    tp = settings.temporal_patch_size
    pad = (-len(frames)) % tp
    if pad:
        frames = np.concatenate([frames, np.repeat(frames[-1:], pad, axis=0)])
    # Resize once, to the plan, as the video processor does: smart_resize is not idempotent (where max_pixels
    # forces a size under min_pixels, planning again grows it), so nothing downstream may plan again.
    p = settings.patch_size
    frames = resize_frames(frames, plan.grid_thw[1] * p, plan.grid_thw[2] * p)
    table = normalize_table(settings.image_mean, settings.image_std) if normalise else None
    pixel_values = patchify(frames, p, settings.merge_size, tp, table)
    return VideoInputs(grid_thw=plan.grid_thw, second_per_grid_t=plan.second_per_grid_t, num_tokens=plan.num_tokens,
                       timestamps=plan.timestamps, pixel_values=pixel_values, settings=settings)
