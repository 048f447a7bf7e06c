"""Diagnostic: how much of the demo model's direction and order accuracy one frame explains.

    scripts/diag_demo_shortcut.py                              # the default (Qwen3-VL) demo model, 200 clips
    scripts/diag_demo_shortcut.py --model-type qwen2_5_vl --clips 400
    scripts/diag_demo_shortcut.py --checkpoint /tmp/model      # a model trained with --out

Fresh clips of the training distribution (`batchjob.synthetic.trainer.sample_clip`), answered through the
trainer's forward (the engine's preprocessing, prompt and positions) from four views of the same 8 uniform
frames: as sampled, the first frame eight times, the last frame eight times, and reversed. A question that
needs two frames in order is at chance from one repeated frame; well above (or below) chance there, the model
reads where things stand, not how they move.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def main(argv: list[str] | None = None) -> int:
    from batchjob.demo_model import DEFAULT_MODEL_TYPE, RECIPES

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model-type", default=DEFAULT_MODEL_TYPE, choices=tuple(RECIPES))
    parser.add_argument("--checkpoint", type=Path, help="default: the packaged demo model of --model-type")
    parser.add_argument("--clips", type=int, default=200)
    parser.add_argument("--seed", type=int, default=777)
    parser.add_argument("--motion", default=None, help="the scenes' motion (default: the one the checkpoint's "
                        "training.json records; 'span' for a record from before motions had names)")
    args = parser.parse_args(argv)

    import numpy as np

    from batchjob.demo_model import packaged_model_dir, recorded_motion
    from batchjob.synthetic.scenes import questions_for
    from batchjob.synthetic.trainer import EnginePrep, batch_logits, load_for_training, sample_clip

    recipe = RECIPES[args.model_type]
    path = args.checkpoint or packaged_model_dir(args.model_type)
    motion = args.motion or recorded_motion(path)
    prep = EnginePrep(path, recipe.engine_config)
    model = load_for_training(path, prep.family)
    views = {"uniform": lambda f: f, "first x8": lambda f: np.repeat(f[:1], len(f), 0),
             "last x8": lambda f: np.repeat(f[-1:], len(f), 0), "reversed": lambda f: f[::-1]}
    right: dict[str, dict[str, list[bool]]] = {v: {"direction": [], "order": []} for v in views}
    rng = np.random.default_rng(args.seed)
    for c in range(args.clips):
        scene, frames, meta = sample_clip(rng, recipe.num_frames, order=bool(c % 2), motion=motion)
        questions = [q for q in questions_for(scene) if q.kind in ("direction", "order")]
        for view, pick in views.items():
            inputs = prep.clip_inputs(np.ascontiguousarray(pick(frames)), meta)
            logits = batch_logits(model, prep.family, prep.batch([inputs], [prep.example(0, inputs, q)
                                                                              for q in questions]))
            for q, row in zip(questions, logits):
                right[view][q.kind].append(bool(row[:len(q.options)].argmax() == q.answer))
    print(f"{path}: {args.clips} fresh clips (seed {args.seed}, motion {motion}); accuracy (questions)")
    print("| frames | direction | order |\n|---|---|---|")
    for view, kinds in right.items():
        print(f"| {view} | " + " | ".join(f"{np.mean(v):.3f} ({len(v)})" for v in kinds.values()) + " |")
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    raise SystemExit(main())
