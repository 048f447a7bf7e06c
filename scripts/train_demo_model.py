"""Train the demo model: a tiny Qwen2.5-VL (or Qwen3-VL) that learned to see moving shapes, on this CPU.

    scripts/train_demo_model.py                       # rebuild the committed Qwen2.5-VL checkpoint (minutes)
    scripts/train_demo_model.py --model-type qwen3_vl
    scripts/train_demo_model.py --short --out /tmp/x  # a few steps: the loss on a fixed batch must fall

From a seeded random initialisation (`batchjob.synthetic.tiny_model`), on scenes rendered on the fly
(`batchjob.synthetic.scenes`) and sampled as a uniform loader samples a clip, through the engine's own
preprocessing, prompt and positions (`batchjob.synthetic.trainer`); the loss is the cross-entropy of the
option-label logits. The output directory gets the checkpoint (hub layout) and `training.json`: the seed,
the command, the training curve, the accuracy per question kind on fresh clips, and the files' sha256.
Deterministic for a given seed, thread count and MLX build.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from dataclasses import replace
from functools import partial
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MOTIONS = ("wrap", "span")      # batchjob.synthetic.scenes.MOTIONS (parsed before the package is importable)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model-type", default="qwen2_5_vl", choices=("qwen2_5_vl", "qwen3_vl"))
    parser.add_argument("--out", type=Path, help="checkpoint directory (default: the packaged demo model's)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--steps", type=int, default=None, help="optimizer steps (default: the model's recipe)")
    parser.add_argument("--lr", type=float, default=None, help="peak learning rate (default: the recipe's)")
    parser.add_argument("--burst-share", type=float, default=None,
                        help="share of clips laid out as pyav_burst lays them out (default: the recipe's)")
    parser.add_argument("--burst-frames", type=int, nargs=2, default=None,
                        help="lengths (frames) of the clips laid out as pyav_burst lays them out "
                             "(default: the recipe's)")
    parser.add_argument("--init-from", type=Path, default=None,
                        help="start from this trained checkpoint's weights (same recipe) instead of random ones")
    parser.add_argument("--short", action="store_true", help="a few steps (CI): checks that the loss falls")
    parser.add_argument("--eval-clips", type=int, default=None, help="fresh clips for the final accuracy")
    parser.add_argument("--motion", default=None, choices=MOTIONS,
                        help="how the scenes' movers move (batchjob.synthetic.scenes; default: the recipe's)")
    args = parser.parse_args(argv)

    from batchjob.demo_model import RECIPES, packaged_model_dir

    if args.short and args.out is None:
        parser.error("--short trains a throwaway model: give --out DIR (the packaged model stays as it is)")
    recipe = RECIPES[args.model_type]
    if args.burst_share is not None and not 0 <= args.burst_share <= 1:
        parser.error(f"--burst-share {args.burst_share}: give a share between 0 and 1")
    recipe = replace(recipe, **{k: v for k, v in (("lr", args.lr), ("burst_share", args.burst_share),
                                                 ("burst_frames", args.burst_frames and tuple(args.burst_frames)))
                                if v is not None})
    out = args.out or packaged_model_dir(args.model_type)
    steps = args.steps or (8 if args.short else recipe.steps)
    eval_clips = args.eval_clips if args.eval_clips is not None else (0 if args.short else 1200)
    given = list(argv if argv is not None else sys.argv[1:])
    if "--out" in given:                     # where it is written does not change what is trained
        del given[given.index("--out"):given.index("--out") + 2]
    given = [a for a in given if not a.startswith("--out=")]
    record = train(out, recipe, seed=args.seed, steps=steps, eval_clips=eval_clips, short=args.short,
                   command=" ".join(["scripts/train_demo_model.py", *given]), motion=args.motion or recipe.motion,
                   init_from=args.init_from)
    if args.short:
        first, last = record["fixed_batch_loss"]
        print(f"loss on a fixed batch: {first:.4f} -> {last:.4f}")
        return 0 if last < first else 1
    return 0


def train(out: Path, recipe, *, seed: int, steps: int, eval_clips: int, short: bool, command: str,
          motion: str, init_from: Path | None = None) -> dict:
    import mlx.core as mx
    import mlx.nn as nn
    import mlx.optimizers as optim
    import numpy as np

    from batchjob import openblas
    from batchjob.demo_model import checkpoint_sha256
    from batchjob.synthetic.tiny_model import write_tiny_checkpoint
    from batchjob.synthetic.trainer import (EnginePrep, accuracy_by_kind, batch_stream, load_for_training, loss,
                                            sample_batch, save_hub_weights)

    start = time.perf_counter()
    tmp = out.with_name(out.name + ".training")
    shutil.rmtree(tmp, ignore_errors=True)
    write_tiny_checkpoint(tmp, recipe.spec(seed))
    if init_from is not None:
        if not all((Path(init_from) / name).is_file() for name in ("config.json", "model.safetensors")):
            raise SystemExit(f"--init-from {init_from}: no config.json and model.safetensors there; give a "
                             f"checkpoint directory this script trained")
        if (Path(init_from) / "config.json").read_text() != (tmp / "config.json").read_text():
            raise SystemExit(f"--init-from {init_from}: its config.json is not the {recipe.model_type} recipe's")
        shutil.copyfile(Path(init_from) / "model.safetensors", tmp / "model.safetensors")
    prep = EnginePrep(tmp, recipe.engine_config)
    model = load_for_training(tmp, prep.family)
    mx.random.seed(seed)
    fixed = sample_batch(prep, np.random.default_rng(seed + 1), 16, recipe.num_frames, recipe.one_question,
                         recipe.kind_weights, motion)
    grids = fixed.grids[:recipe.clips_per_step]    # every clip has one size and frame count: one grid, one shape

    warmup = max(1, min(recipe.warmup, steps // 10))
    schedule = optim.join_schedules([optim.linear_schedule(recipe.lr / 20, recipe.lr, warmup),
                                     optim.cosine_decay(recipe.lr, max(1, steps - warmup), recipe.lr / 50)], [warmup])
    optimizer = optim.AdamW(learning_rate=schedule, betas=list(recipe.betas), weight_decay=recipe.weight_decay)
    value_and_grad = nn.value_and_grad(model, lambda m, *arrays: loss(m, prep.family, grids, *arrays))
    state = [model.state, optimizer.state]

    def step_fn(*arrays):
        value, grads = value_and_grad(model, *arrays)
        grads, _ = optim.clip_grad_norm(grads, recipe.clip_grad)
        optimizer.update(model, grads)
        return value

    if not short:        # compiling pays back over hundreds of steps, not over a few
        step_fn = partial(mx.compile, inputs=state, outputs=state)(step_fn)

    def fixed_loss() -> float:
        return float(loss(model, prep.family, fixed.grids, *fixed.arrays()))

    curve, before, running = [], fixed_loss(), []
    stream = batch_stream(tmp, recipe.engine_config, seed, recipe.clips_per_step, recipe.num_frames, steps,
                          recipe.one_question, recipe.kind_weights, motion, recipe.burst_share, recipe.burst_frames)
    for step, batch in enumerate(stream, 1):
        if batch.grids != grids:
            raise RuntimeError(f"batch grids {batch.grids} differ from {grids}: the compiled step assumes one")
        value = step_fn(*batch.arrays())
        mx.eval(state, value)
        running.append(float(value))
        if step % recipe.log_every == 0 or step == steps:
            curve.append({"step": step, "loss": round(float(np.mean(running)), 5),
                          "seconds": round(time.perf_counter() - start, 1)})
            running = []
            print(f"step {step:5d}  loss {curve[-1]['loss']:.4f}  {curve[-1]['seconds']:7.1f} s", flush=True)
        if step % recipe.eval_every == 0 and step < steps:      # progress per kind, on the fixed batch's clips
            curve[-1]["fixed_batch_accuracy"] = accuracy_by_kind(model, prep, [fixed])
            print("   fixed batch accuracy:", json.dumps(curve[-1]["fixed_batch_accuracy"]), flush=True)
    after = fixed_loss()
    trained = time.perf_counter() - start
    record = {"model_type": recipe.model_type, "seed": seed, "steps": steps, "command": command,
              "clips_per_step": recipe.clips_per_step, "num_frames": recipe.num_frames,
              "engine": {"max_pixels": recipe.engine_config.max_pixels, "dtype": recipe.engine_config.dtype},
              "kind_weights": recipe.kind_weights, "lr": recipe.lr, "motion": motion,
              "burst_share": recipe.burst_share, "burst_frames": list(recipe.burst_frames),
              "init_from": None if init_from is None else checkpoint_sha256(Path(init_from)).get("model.safetensors"),
              "mlx": mx.__version__, "threads": _blas_threads(), "openblas": openblas.preloaded(os.environ),
              "fixed_batch_loss": [round(before, 5), round(after, 5)], "curve": curve}
    if eval_clips:       # every question of every clip: 1200 clips put a kind's accuracy within about +-1%
        eval_rng = np.random.default_rng(seed + 2)
        batches = [sample_batch(prep, eval_rng, recipe.clips_per_step, recipe.num_frames, one_question=False,
                                motion=motion)
                   for _ in range(max(1, eval_clips // recipe.clips_per_step))]
        record["accuracy"] = accuracy_by_kind(model, prep, batches)
        record["eval_clips"] = len(batches) * recipe.clips_per_step
        print("accuracy on fresh clips (uniform frames):", json.dumps(record["accuracy"]))
        if recipe.burst_share:       # the same count of fresh clips, every one laid out as pyav_burst lays it out
            batches = [sample_batch(prep, eval_rng, recipe.clips_per_step, recipe.num_frames, one_question=False,
                                    motion=motion, burst_share=1.0, burst_frames=recipe.burst_frames)
                       for _ in range(len(batches))]
            record["accuracy_bursts"] = accuracy_by_kind(model, prep, batches)
            print("accuracy on fresh clips (pyav_burst layouts):", json.dumps(record["accuracy_bursts"]))
        record["eval_seconds"] = round(time.perf_counter() - start - trained, 1)
    save_hub_weights(model, tmp)
    record["training_seconds"] = round(trained, 1)        # set-up and training; the final evaluation aside
    shutil.rmtree(out, ignore_errors=True)       # the old checkpoint goes only once the new one is complete
    tmp.rename(out)
    record["sha256"] = checkpoint_sha256(out)
    (out / "training.json").write_text(json.dumps(record, indent=1) + "\n")
    print(f"wrote {out}: trained in {record['training_seconds']:.0f} s")
    return record


# What OpenBLAS reads for its thread count, first found first.
BLAS_THREAD_VARS = ("OPENBLAS_NUM_THREADS", "GOTO_NUM_THREADS", "OMP_NUM_THREADS")


def _blas_threads(environ=os.environ) -> str | None:
    """The thread count OpenBLAS was told (the trained weights depend on it), None where it picks its own."""
    return next((environ[v] for v in BLAS_THREAD_VARS if v in environ), None)


def pinned_environment(environ: dict[str, str], *, linux: bool, openblas_exists: bool) -> dict[str, str] | None:
    """The environment to start again in, None where `environ` already is it: the system OpenBLAS preloaded
    (`batchjob.openblas`) and one BLAS thread unless told otherwise. The weights depend on the thread count, so a
    shell that already preloads OpenBLAS (scripts/env.sh) must train the same model as a fresh one; and a second
    BLAS thread spins beside the data worker on a 2-core machine and slows every step. `BATCHJOB_NO_OPENBLAS=1`
    leaves the environment alone."""
    from batchjob import openblas

    if environ.get(openblas.NO_PRELOAD_ENV) == "1":
        return None
    env = openblas.with_openblas(environ, linux=linux, openblas_exists=openblas_exists)
    if _blas_threads(env) is None:
        env["OMP_NUM_THREADS"] = "1"
    if env == dict(environ):
        return None
    env[openblas.NO_PRELOAD_ENV] = "1"        # never loop
    return env


def _reexec_pinned() -> None:
    """Both settings are read when the process starts (OpenBLAS is preloaded), hence a re-exec."""
    from batchjob.openblas import OPENBLAS

    env = pinned_environment(dict(os.environ), linux=sys.platform.startswith("linux"),
                             openblas_exists=os.path.exists(OPENBLAS))
    if env is not None:
        os.execve(sys.executable, [sys.executable, *sys.argv], env)


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    _reexec_pinned()
    raise SystemExit(main())
