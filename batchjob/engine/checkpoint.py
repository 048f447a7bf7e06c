"""Loading a Qwen2-VL / Qwen2.5-VL / Qwen3-VL checkpoint with mlx-vlm's model definitions, with load-time checks.

Every problem we can see before the first request (unknown architecture, missing files, a layout mlx-vlm
cannot read) is an EngineError naming the path and the fix: a nightly job should fail at start, not at 3 a.m.
"""

from __future__ import annotations

import contextlib
import json
import os
import threading
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from batchjob.startup import StepClock

from .device import activate, resolve_dtype, select_device
from .families import ModelFamily, family_for, supported_model_types
from .patchify import device_pixels
from .preprocess import VisionSettings
from .shards import weight_files
from .types import EngineConfig, EngineError

SUPPORTED_MODEL_TYPES = supported_model_types()


@dataclass
class LoadedCheckpoint:
    model: nn.Module  # mlx-vlm Model: .vision_tower, .language_model
    model_type: str
    model_id: str
    path: Path
    hf_config: dict
    tokenizer: object
    vision: VisionSettings
    video_token_id: int
    family: ModelFamily  # the model_type's module: prompts, positions, vision features
    dtype: mx.Dtype
    weights_bytes: int
    device: str = "cpu"  # "cpu" | "metal" | "cuda"

    def encode_clip(self, inputs, uploaded=None) -> mx.array:
        """A prepared clip's vision features (`family.encode_video`), its patch bytes normalised on the device
        (`patchify.device_pixels`; `uploaded`: those bytes uploaded ahead): how the classifier, and benchmarks of
        its tower, run the tower."""
        return self.family.encode_video(self.model, device_pixels(inputs, uploaded), inputs.grid_thw, self.dtype)


def resolve_model_dir(model: str | os.PathLike) -> Path:
    """A local checkpoint directory, or a hub id downloaded where the network allows."""
    path = Path(model).expanduser()
    if path.is_dir():
        return path
    if path.exists():
        raise EngineError(f"{path} is a file; pass the checkpoint directory (with config.json and *.safetensors)")
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(str(model), allow_patterns=["*.json", "*.safetensors", "*.jinja", "*.txt"]))
    except Exception as exc:  # offline, unknown id, auth: all mean "no checkpoint here"
        raise EngineError(
            f"model {str(model)!r} is not a local directory and could not be fetched from the Hugging Face hub "
            f"({type(exc).__name__}: {exc}); pass the path of a downloaded checkpoint directory"
        ) from exc


def _read_config(path: Path) -> dict:
    config_file = path / "config.json"
    if not config_file.is_file():
        raise EngineError(f"{path}: no config.json; this is not a Hugging Face checkpoint directory")
    return json.loads(config_file.read_text())


def _check_files(path: Path) -> None:
    if not list(path.glob("*.safetensors")):
        raise EngineError(f"{path}: no *.safetensors weight files; download the checkpoint's weights into it")
    if not any((path / f).is_file() for f in ("tokenizer.json", "vocab.json", "tokenizer_config.json")):
        raise EngineError(f"{path}: no tokenizer files (tokenizer.json / tokenizer_config.json); copy them in")


def touch_on_device(model: nn.Module) -> None:
    """Read every weight once on the GPU, so the driver moves the unified-memory pages the CPU read there now,
    at load, instead of during the first forward pass."""
    mx.eval([mx.sum(p) for _, p in tree_flatten(model.parameters())])
    mx.synchronize()


def read_weights(files: list[Path], prefetch_to_gpu: bool = False) -> dict[str, dict[str, mx.array]]:
    """Every shard read into memory on the CPU stream: MLX's CPU load reads a file with parallel readers into
    unified memory, where the GPU load reads it tensor by tensor on one thread. Keyed by path as mlx-vlm names it.

    `prefetch_to_gpu` (CUDA): each shard, once read, is touched on the GPU asynchronously while the next shard
    is read, so the pages' move to the device (what `touch_on_device` otherwise does after the whole read)
    overlaps the disk."""
    shards = {}
    for f in files:
        with mx.stream(mx.cpu):
            try:
                shard = mx.load(str(f))
            except RuntimeError:     # a dtype MLX cannot read directly: mlx-vlm's loader converts it itself
                continue
            mx.eval(list(shard.values()))
        shards[str(f)] = shard
        if prefetch_to_gpu:
            with mx.stream(mx.gpu):
                mx.async_eval([mx.sum(a) for a in shard.values()])
    return shards


class _BackgroundImports(threading.Thread):
    """mlx-vlm and transformers (which pulls in torch where it is installed) imported while the main thread
    reads the weights: the import is Python work and the read is MLX's, so the two overlap."""

    def __init__(self):
        super().__init__(name="engine-imports", daemon=True)
        self.error: BaseException | None = None
        self.start()

    def run(self) -> None:
        try:
            import mlx_vlm.utils  # noqa: F401
            import transformers  # noqa: F401
            from transformers import AutoTokenizer  # noqa: F401
        except BaseException as exc:      # re-raised in the loading thread by wait()
            self.error = exc

    def wait(self) -> None:
        self.join()
        if self.error is not None:
            raise self.error


@contextlib.contextmanager
def _serving_read_weights(shards: dict[str, dict[str, mx.array]]):
    """mlx-vlm's loader handed the shards already read, by path; any other file it reads itself."""
    import mlx_vlm.utils as vlm_utils

    original = getattr(vlm_utils, "_load_safetensors", None)
    if original is None:          # another mlx-vlm layout: it reads the files again, correct and slower
        yield
        return
    vlm_utils._load_safetensors = lambda f: shards.pop(str(f), None) or original(f)
    try:
        yield
    finally:
        vlm_utils._load_safetensors = original


def load_checkpoint(model: str | os.PathLike, config: EngineConfig, clock: StepClock | None = None) -> LoadedCheckpoint:
    """`clock` (optional) gets one mark per load step: imports, files, device, weights, cast, tokenizer."""
    clock = clock or StepClock()
    clock.mark("imports")                 # MLX and the engine's own modules
    imports = _BackgroundImports()
    path = resolve_model_dir(model)
    hf_config = _read_config(path)
    family = family_for(hf_config, path)
    _check_files(path)
    vision = family.vision_settings(config)
    clock.mark("checkpoint_files")
    device = select_device(config.device)
    activate(device)
    clock.mark("device_init")
    try:
        shards = read_weights(weight_files(path), prefetch_to_gpu=device == "cuda")
    except Exception as exc:
        raise EngineError(f"{path}: the weights could not be read ({type(exc).__name__}: {exc})") from exc
    clock.mark("weights_read")
    imports.wait()
    clock.mark("imports_wait")            # what the weights read did not hide of mlx-vlm's and transformers' import
    from mlx_vlm.utils import load_model
    from transformers import AutoTokenizer

    try:
        with mx.stream(mx.cpu), _serving_read_weights(shards):
            mlx_model = load_model(path, lazy=True)
            mx.eval(mlx_model.parameters())
    except Exception as exc:
        raise EngineError(f"{path}: mlx-vlm could not build the model ({type(exc).__name__}: {exc})") from exc
    del shards
    clock.mark("model_build")
    family.fix_model(mlx_model)
    dtype = resolve_dtype(config.dtype, device)
    mlx_model.set_dtype(dtype)
    mx.eval(mlx_model.parameters())
    if device == "cuda":
        touch_on_device(mlx_model)
    clock.mark("weights_to_device")
    try:
        tokenizer = AutoTokenizer.from_pretrained(path)
    except Exception as exc:
        raise EngineError(f"{path}: the tokenizer could not be loaded ({type(exc).__name__}: {exc})") from exc
    clock.mark("tokenizer")
    return LoadedCheckpoint(
        model=mlx_model,
        model_type=hf_config["model_type"],
        model_id=str(model),
        path=path,
        hf_config=hf_config,
        tokenizer=tokenizer,
        vision=vision,
        video_token_id=family.video_token_id,
        family=family,
        dtype=dtype,
        weights_bytes=sum(v.nbytes for _, v in tree_flatten(mlx_model.parameters())),
        device=device,
    )
