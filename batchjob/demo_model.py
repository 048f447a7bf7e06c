"""The demo model: tiny checkpoints trained on synthetic scenes (`scripts/train_demo_model.py`), shipped as package
data so `batchjob demo` and the accuracy canary run a model whose answers mean something.

A recipe is everything the training script needs besides the seed: the checkpoint's shape, what the engine
is told (pixel budget, frames per clip) and the optimizer's settings. The demo's job config must match what
the model was trained with (`engine_config`, `num_frames`), or its accuracy says nothing.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path

from batchjob.engine.types import EngineConfig

ASSETS = "assets/demo_model"
RECORD = "training.json"


@dataclass(frozen=True)
class Recipe:
    model_type: str
    hidden_size: int
    num_layers: int
    intermediate_size: int
    vision_hidden: int
    vision_depth: int
    max_pixels: int                 # per frame (Qwen2.5-VL) or per clip (Qwen3-VL), as the family reads it
    num_frames: int = 8
    motion: str = "wrap"            # how the scenes' movers move (`batchjob.synthetic.scenes.MOTIONS`)
    burst_share: float = 0.0        # clips laid out as pyav_burst returns them (`trainer.burst_layout`), else uniform
    burst_frames: tuple[int, int] = (24, 360)   # those clips' length in frames, log-uniform (trainer.BURST_FRAMES)
    steps: int = 3000
    clips_per_step: int = 6         # every question each clip supports (3 or 4)
    one_question: bool = False
    # Direction is learned last (colour and count within a few hundred steps): its questions weigh double.
    kind_weights: dict = field(default_factory=lambda: {"direction": 2.0})
    lr: float = 1e-3
    betas: tuple[float, float] = (0.9, 0.98)
    # Larger than real models' 0.02: at 0.02 a 64-wide model starts with near-uniform attention and learned
    # nothing in hundreds of steps; at 0.1 it reads colours within a hundred.
    initializer_range: float = 0.1
    # The LM's rotary base. Real checkpoints' 1e6 with this 16-wide head leaves the width positions a
    # thousandth of a radian apart: the decoder could not tell left from right (direction, order).
    rope_theta: float | None = 3.0
    warmup: int = 50
    weight_decay: float = 0.01
    clip_grad: float = 1.0
    log_every: int = 50
    eval_every: int = 250
    extra: dict = field(default_factory=dict)

    @property
    def engine_config(self) -> EngineConfig:
        return EngineConfig(dtype="float32", device="cpu", max_pixels=self.max_pixels)

    def spec(self, seed: int):
        from batchjob.synthetic.scenes import VOCABULARY
        from batchjob.synthetic.tiny_model import TinyModelSpec

        qwen3 = self.model_type.startswith("qwen3")
        return TinyModelSpec(
            model_type=self.model_type, hidden_size=self.hidden_size, num_layers=self.num_layers, num_heads=4,
            num_kv_heads=2, intermediate_size=self.intermediate_size, vision_depth=self.vision_depth,
            vision_hidden=self.vision_hidden, vision_heads=2, seed=seed, initializer_range=self.initializer_range, rope_theta=self.rope_theta,
            max_pixels=self.max_pixels if not qwen3 else 28 * 28 * 16, video_max_pixels=self.max_pixels,
            corpus=VOCABULARY, **self.extra)


RECIPES = {
    # On "wrap" scenes (direction from motion alone) Qwen2.5-VL learned direction and order once its temporal
    # position step per temporal patch (tokens_per_second x seconds per patch) came down from 1-3 (the family's 2,
    # on these 2-6 s clips) to 0.5-1.5 (tokens_per_second 1). With 8 frames at the larger step, every earlier run
    # (3000-7000 steps, direction x3, learning rate 2e-3, a bigger vision tower, 28x56 frames) left direction at
    # 0.50-0.63; 16 frames (a 0.5-1.5 step too, offsets up to 10 positions) learned direction, not order. Likely
    # why: this 16-wide head gives time two rotary pairs of about 1 radian per position, and past about pi
    # positions the rotation that says "later" says "earlier". Order questions weigh double (they stopped at 0.94 otherwise).
    # Runs: benchmarks/results/demo-model-wrap-attempts-2026-11-26.json.
    "qwen2_5_vl": Recipe("qwen2_5_vl", hidden_size=64, num_layers=2, intermediate_size=256, vision_hidden=64,
                         vision_depth=2, max_pixels=7056, steps=6000, kind_weights={"direction": 2.0, "order": 2.0},
                         extra={"tokens_per_second": 1}),
    # The clip's budget gives 64x128 frames: 8 tokens per frame pair, as Qwen2.5-VL's 56x112. At 8 * 7056 the
    # frames were 32x96 (3 tokens per pair): three shapes were never counted and direction lagged.
    # On "wrap" scenes (direction from motion alone) 3000 steps left direction at 0.72 with colour, count and order
    # at 0.97-0.98; at 6000 steps, direction weighing triple, the loss fell from a plateau near step 3300 and
    # direction reached 0.97.
    # Half the clips laid out as pyav_burst lays them out (burst_share=0.5) left direction at chance on uniform
    # frames at step 4850 of 6000 (from scratch), and fine-tuned from this model did not lift direction on 5 s and
    # 10 s GOPs in the sampler curve (README): trained on uniform frames only.
    "qwen3_vl": Recipe("qwen3_vl", hidden_size=64, num_layers=2, intermediate_size=128, vision_hidden=64,
                       vision_depth=2, max_pixels=12 * 7056, steps=6000, kind_weights={"direction": 3.0},
                       extra={"deepstack_visual_indexes": (0,)}),
}


# The demo's model: Qwen3-VL, what video users run now. Both trained models answer direction from motion on "wrap"
# scenes (one frame repeated leaves them at chance).
DEFAULT_MODEL_TYPE = "qwen3_vl"
# What `batchjob demo --model-type` takes: the trained families, and Qwen3-VL-MoE with random weights (chance).
DEMO_MODEL_TYPES = ("qwen3_vl", "qwen2_5_vl", "qwen3_vl_moe")


def check_demo_model_type(model_type: str, *, trained: bool = False) -> str:
    """`model_type` if the demo can run it (`trained`: only families with a trained demo model), else a
    ValueError that names the value and the choices."""
    choices = tuple(RECIPES) if trained else DEMO_MODEL_TYPES
    if model_type not in choices:
        what = "trained demo model" if trained else "demo model type"
        raise ValueError(f"{model_type!r} is not a {what}: use one of {', '.join(choices)}")
    return model_type


def packaged_model_dir(model_type: str) -> Path:
    """Where the packaged checkpoint of `model_type` lives (inside the installed package)."""
    return Path(str(resources.files("batchjob").joinpath(ASSETS, model_type)))


def trained_motion(model_type: str) -> str | None:
    """How the movers of the scenes the packaged `model_type` learned from move (`scenes.MOTIONS`), from its
    training record: clips made for it (demo, canary, loader comparison) must be drawn the same way."""
    return recorded_motion(packaged_model_dir(check_demo_model_type(model_type)))


def recorded_motion(checkpoint: Path) -> str | None:
    """The scenes' motion a trained checkpoint directory's record names. A record from before motions had names
    is "span"; no record (no trained model) gives None, the scenes' default."""
    import json

    record = checkpoint / RECORD
    return json.loads(record.read_text()).get("motion", "span") if record.is_file() else None


def checkpoint_files(path: Path) -> list[Path]:
    return sorted(p for p in path.iterdir() if p.is_file() and p.name != RECORD and not p.name.startswith("."))


def checkpoint_sha256(path: Path) -> dict[str, str]:
    """sha256 of every file of the checkpoint (the training record aside), by name."""
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in checkpoint_files(Path(path))}
