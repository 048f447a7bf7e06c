"""The trained demo models as benchmarks use them: which one (`--model-type`), its recipe, its checkpoint, the
motion its scenes were drawn with, and how a clip's time axis is told to it.

A benchmark that answers with a demo model must draw its clips as that model was trained (`recorded_motion`)
and name the model in everything it prints and writes; this is the one place that knows how.
"""
from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class DemoModel:
    model_type: str
    checkpoint: Path
    motion: str | None          # how the movers of its training scenes move (`scenes.MOTIONS`); None: untrained
    recipe: object              # batchjob.demo_model.Recipe

    @property
    def label(self) -> str:
        return f"the {self.model_type} demo model ({self.motion or 'default'} scenes)"

    @property
    def num_frames(self) -> int:
        return self.recipe.num_frames

    def describe(self) -> dict:
        """What a results file records about the model that answered."""
        from batchjob.demo_model import checkpoint_sha256

        return {"model_type": self.model_type, "checkpoint": str(self.checkpoint), "motion": self.motion,
                "num_frames": self.num_frames, "max_pixels": self.recipe.max_pixels,
                "weights_sha256": checkpoint_sha256(self.checkpoint)}

    def classifier(self):
        from batchjob.engine import Classifier

        return Classifier.from_pretrained(self.checkpoint, self.recipe.engine_config)


def add_model_type_argument(parser: argparse.ArgumentParser) -> None:
    """`--model-type`: a trained demo model, the demo's default unless named."""
    from batchjob.demo_model import DEFAULT_MODEL_TYPE, RECIPES

    parser.add_argument("--model-type", default=DEFAULT_MODEL_TYPE, choices=tuple(RECIPES),
                        help=f"which trained demo model answers (default: the demo's, {DEFAULT_MODEL_TYPE})")


def demo_model(model_type: str, checkpoint: Path | None = None) -> DemoModel:
    """The packaged trained demo model of `model_type` (a ValueError naming the choices otherwise), or one trained
    to its recipe in `checkpoint` (a candidate, before it is packaged)."""
    from batchjob.demo_model import RECIPES, check_demo_model_type, packaged_model_dir, recorded_motion

    path = packaged_model_dir(check_demo_model_type(model_type, trained=True))
    if checkpoint is not None:
        if not (Path(checkpoint) / "config.json").is_file():
            raise ValueError(f"--checkpoint {checkpoint}: no config.json there; give a trained checkpoint directory")
        path = Path(checkpoint)
    return DemoModel(model_type, path, recorded_motion(path), RECIPES[model_type])


def told_as(meta: dict, seconds: float) -> dict:
    """The metadata the engine is given: the loader's, with the clip's time axis scaled so it lasts `seconds`.

    The demo models were trained on 2-6 s clips. Qwen2.5-VL's temporal positions step by the clip's frame rate
    (`n / total * fps`), Qwen3-VL writes each frame pair's time as text (`frames_timestamps`): a 12 s clip is
    outside what either has seen. Scenes are drawn against the clip's fraction of time, so the same clip told
    as 4 s is a 4 s scene. Frame indices stay the loader's; `seconds <= 0` leaves the metadata as it is."""
    if seconds <= 0 or not meta.get("total_num_frames"):
        return meta
    told = {**meta, "fps": meta["total_num_frames"] / seconds, "duration": seconds}
    if meta.get("duration") and meta.get("frames_timestamps") is not None:
        scale = seconds / float(meta["duration"])
        told["frames_timestamps"] = [float(t) * scale for t in meta["frames_timestamps"]]
    return told
