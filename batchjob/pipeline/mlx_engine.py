"""The MLX engine (`model.engine: mlx`) behind the engine contract: job config -> `batchjob.engine`.

Importing this module imports no MLX; `load` does, in the engine actor. The input preparer runs the
checkpoint's processor (resize, patchify) in the decode actors and ships the patches as bytes, so the
engine's process only looks them up (normalise, on its device) and runs the model.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

from batchjob.config import ModelConfig, PromptConfig
from batchjob.contract import Answer, ClipMetadata, EngineBase, EngineClip, EngineDescription


def engine_config(model: ModelConfig, prompt: PromptConfig):
    """The MLX engine's settings for a job: the one place job config keys become `EngineConfig` fields."""
    from batchjob.engine.types import EngineConfig

    extra: dict[str, Any] = {}
    if prompt.template is not None:
        extra["prompt_template"] = prompt.template
    return EngineConfig(dtype=model.dtype, device=model.device, min_pixels=model.min_pixels, max_pixels=model.max_pixels,
                        max_num_batched_tokens=model.max_num_batched_tokens, max_model_len=model.max_model_len,
                        memory_budget_gb=model.memory_budget_gb, temporal_step=model.temporal_step,
                        host_reserved_bytes=int((model.host_reserved_gb or 0) * 2**30),
                        timestamps=model.timestamps, option_labels=tuple(prompt.option_labels), system_prompt=prompt.system, **extra)


class MlxClipPreparer:
    """Resize + patchify a clip (the checkpoint's own processor) inside a decode worker.

    In the engine's process this took about half of the engine's time per clip on the tiny benchmark model;
    in the decoders it runs beside other clips. It needs only numpy (engine/preprocess.py): a decoder
    imports neither torch nor transformers, unless `BATCHJOB_RESIZE=torch` asks for PyTorch's resize.
    """

    def __init__(self, settings):
        self.settings = settings

    def warm_up(self) -> None:
        """Import the preprocessing and check the resize backend now, at actor start: a bad
        BATCHJOB_RESIZE, or torch missing where it names torch, fails here rather than on every clip."""
        import numpy as np

        from batchjob.engine.preprocess import preprocess_video

        p = self.settings.patch_size * self.settings.merge_size
        preprocess_video(np.zeros((2, p + 1, p + 1, 3), np.uint8), {}, self.settings, normalise=False)  # every path

    def __call__(self, frames, metadata: ClipMetadata):
        """The clip's patches as uint8 bytes: a quarter of the float32 values' size through Ray's object store
        and up to the device, where the engine normalises them (engine/patchify.py)."""
        from batchjob.engine.preprocess import preprocess_video

        return preprocess_video(frames, metadata.as_dict(), self.settings, normalise=False)


class MlxEngine(EngineBase):
    """batchjob's own MLX classifier (Apple GPU, CUDA through mlx[cuda], or CPU)."""

    name = "mlx"
    hides_torch = True   # its actor hides torch from transformers (see batchjob.engine.process_setup)
    runs_in_driver = True  # MLX releases the GIL while the device computes: the driver's loop keeps going

    @classmethod
    def on_gpu(cls, model: ModelConfig) -> bool:
        """Whether MLX will find a GPU that `model.device` allows, judged without importing MLX or touching a
        device: the driver asks before Ray forks its processes, and a process holding a CUDA context forks
        slowly. Apple silicon has Metal; elsewhere MLX's CUDA build must be installed and an NVIDIA GPU visible.
        (A wrong guess costs only the placement: the engine itself still picks its device at load.)"""
        import platform
        import sys

        if model.device == "cpu":
            return False
        if sys.platform == "darwin":
            return platform.machine() == "arm64"
        from batchjob.pipeline.placement import local_gpu_count

        return local_gpu_count() > 0 and mlx_cuda_installed()

    @classmethod
    def input_preparer(cls, model: ModelConfig) -> MlxClipPreparer | None:
        """Decoder-side preparation from the checkpoint's processor settings; None (the engine prepares
        clips itself) when the checkpoint is a hub id not on disk yet or its settings are unreadable: the
        engine's own load then reports the problem."""
        from batchjob.engine.preprocess import load_vision_settings
        from batchjob.engine.types import EngineError

        path = Path(model.checkpoint).expanduser()
        if not path.is_dir():
            return None
        try:
            return MlxClipPreparer(load_vision_settings(path, model.min_pixels, model.max_pixels, model.temporal_step,
                                                        model.timestamps))
        except EngineError:
            return None

    @classmethod
    def check(cls, model: ModelConfig, prompt: PromptConfig) -> None:
        check_engine_config(model, prompt)

    @classmethod
    def check_local(cls, model: ModelConfig) -> None:
        check_budget_fits(model)

    @classmethod
    def load(cls, model: ModelConfig, prompt: PromptConfig) -> "MlxEngine":
        from batchjob.startup import StepClock

        clock = StepClock()   # its first step ("imports") covers MLX's import too
        from batchjob.engine import Classifier

        return cls(Classifier.from_pretrained(model.checkpoint, engine_config(model, prompt), clock), model)

    def __init__(self, classifier, model: ModelConfig):
        self._clf = classifier
        self._model = model
        self.model_id = classifier.model_id

    def describe(self) -> EngineDescription:
        return EngineDescription("mlx", self.model_id, {
            **self._clf.runtime.as_dict(),   # device, dtype, attention backend and why it was chosen
            "temporal_step": self._model.temporal_step, "timestamps": self._model.timestamps,
            "memory": self._clf.memory.as_dict()}, startup=self._clf.startup)

    @staticmethod
    def _requests(clips: Sequence[EngineClip]) -> list:
        from batchjob.engine import ClassifyRequest, Clip, VideoInputs

        def clip(c: EngineClip) -> Clip:
            meta = c.metadata.as_dict()
            if isinstance(c.payload, VideoInputs):
                return Clip(None, meta, c.job.media_id, inputs=c.payload)
            return Clip(c.payload, meta, c.job.media_id)

        requests = []
        for c in clips:
            engine_clip = clip(c)
            requests += [ClassifyRequest(q.row_id, engine_clip, q.text, q.options) for q in c.job.questions]
        return requests

    def stage(self, clips: Sequence[EngineClip]) -> None:
        self._clf.stage(self._requests(clips))

    def watch_device(self, busy) -> None:
        self._clf.on_device_busy = busy

    def answer(self, clips: Sequence[EngineClip]) -> list[Answer]:
        return [Answer(r.request_id, r.choice, r.probs, r.prompt_tokens, r.cached_tokens, r.error)
                for r in self._clf.classify(self._requests(clips))]


def mlx_cuda_installed() -> bool:
    """MLX's CUDA backend is installed (the `mlx[cuda*]` extra brings a distribution named mlx-cuda-<version>)."""
    from importlib import metadata

    for dist in metadata.distributions():
        name = (dist.metadata["Name"] or "").lower().replace("_", "-")
        if name.startswith("mlx-cuda"):
            return True
    return False


_THIS_MACHINE = "this machine"


def check_budget_fits(model: ModelConfig, device=_THIS_MACHINE) -> None:
    """ConfigError when `model.memory_budget_gb` is more than this machine's device holds (the same rule the
    engine applies at load, where it can be known without starting the device). `device`: the DeviceMemory to
    check against, None when unknown (the engine checks at load), default what this machine has."""
    from batchjob.config import ConfigError
    from batchjob.engine.memory_budget import MemoryBudgetError, choose_budget, local_device_memory

    if model.memory_budget_gb is None:
        return
    if device == _THIS_MACHINE:
        device = local_device_memory(model.device)
    if device is None:
        return
    try:
        choose_budget(device, model.memory_budget_gb, checkpoint_weights_bytes(model, device.device))
    except MemoryBudgetError as err:
        raise ConfigError(str(err)) from None


def checkpoint_weights_bytes(model: ModelConfig, device: str) -> int:
    """The weights' bytes at the dtype the engine will run (from config.json's shapes alone); 0 when the
    checkpoint is not a local directory of a family whose layout we can count."""
    import json

    from batchjob.engine.footprint import SUPPORTED, Quantization, weights_bytes

    path = Path(model.checkpoint).expanduser() / "config.json"
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError):
        return 0
    if config.get("model_type") not in SUPPORTED:
        return 0
    q = config.get("quantization")
    quant = Quantization(int(q["bits"]), int(q.get("group_size", 64))) if isinstance(q, dict) and "bits" in q else None
    dtype_bytes = {"float32": 4, "float16": 2, "bfloat16": 2}.get(model.dtype, 4 if device == "cpu" else 2)
    try:
        return weights_bytes(config, quant, dtype_bytes, engine=True)
    except (KeyError, TypeError, ValueError):
        return 0


# EngineConfig fields -> the job config keys that set them (for errors that name the key to edit).
_JOB_KEYS = {"option_labels": "prompt.option_labels", "prompt_template": "prompt.template",
             "system_prompt": "prompt.system"}


def check_engine_config(model: ModelConfig, prompt: PromptConfig) -> None:
    """ConfigError naming the job key for any setting the MLX engine's own validation rejects."""
    from batchjob.config import ConfigError
    from batchjob.engine.types import EngineError

    cfg = engine_config(model, prompt)
    try:
        cfg.validate()
    except EngineError as err:
        reason = str(err).removeprefix("EngineConfig: ").split(" (got ")[0]
        field = reason.split()[0]
        raise ConfigError(f"{_JOB_KEYS.get(field, 'model.' + field)}: {reason}") from None
