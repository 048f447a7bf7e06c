"""Assets for `batchjob demo`: the trained demo model, synthetic clips and a manifest, built locally.

The demo must work on a fresh machine with no network, so nothing is downloaded: the model is the tiny
checkpoint trained on synthetic scenes that ships with the package (`batchjob.demo_model`), and the clips
are scenes of the same kind (`batchjob.synthetic.scenes`) encoded with PyAV. Every question's answer is known
from how its scene was drawn, so the report's accuracy per question kind (colour, count, direction, order) is
the model's real accuracy. Half the clips have short GOPs (a keyframe every 0.5 s), half a single keyframe:
keyframe-only decoding sees colour and count on both, motion only on the first.
"""
from __future__ import annotations

import json
import os
import re
import shutil
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from batchjob.cache_home import cache_home
from batchjob.demo_model import DEFAULT_MODEL_TYPE

# Clip layout shared with the training data (`batchjob.synthetic.trainer`): size, frame rate, lengths.
GOP_KINDS = {"gop0.5s": {"gop_seconds": 0.5}, "1key": {"single_keyframe": True}}


def demo_dir(cache: str | os.PathLike | None = None) -> Path:
    base = Path(cache) if cache else cache_home()
    return (base / "demo").expanduser().resolve()


def build_scene_clips(root: Path, num_clips: int, seed: int = 0,
                      gop_kinds: tuple[str, ...] = tuple(GOP_KINDS), motion: str | None = None) -> list[dict]:
    """Encode `num_clips` scenes (GOP kinds in turn by pairs, every other clip with two or more movers) under `root`
    and return the manifest records: one per question the scene supports, `category` = the question kind,
    `gop` = the clip's GOP kind, `motion` = how its movers move. Clips already there (same name) are kept: names
    carry the seed and a digest of the scene and its encoding, so a cache made by another version's scenes is never
    reused. `motion`: how the movers move (`scenes.MOTIONS`; draw them as the model answering was trained,
    `demo_model.trained_motion`)."""
    import numpy as np

    from batchjob.synthetic.clips import make_scene_clip
    from batchjob.synthetic.scenes import MOTION, clip_digest, questions_for, random_scene
    from batchjob.synthetic.trainer import CLIP_SIZE, FPS, SECONDS

    root.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    width, height = CLIP_SIZE
    records = []
    for i in range(num_clips):
        gop = gop_kinds[(i // 2) % len(gop_kinds)]     # every GOP kind gets clips with and without order
        scene = random_scene(rng, width / height, order=bool(i % 2), motion=motion)
        seconds = round(float(rng.uniform(*SECONDS)) * FPS) / FPS
        clip_seed = int(rng.integers(2**31))
        digest = clip_digest(scene, seconds, FPS, width, height, clip_seed, GOP_KINDS[gop])
        name = f"s{seed}-clip{i:03d}-{gop}-{digest}.mp4"
        if not (root / name).exists():
            tmp = root / f".{name}"
            make_scene_clip(tmp, scene, seconds=seconds, fps=FPS, width=width, height=height, seed=clip_seed,
                            **GOP_KINDS[gop])
            tmp.rename(root / name)
        for q in questions_for(scene):
            records.append({"id": f"s{seed}-clip{i:03d}-{q.kind}", "video": name, "question": q.text,
                            "options": list(q.options), "answer": q.answer, "category": q.kind, "gop": gop,
                            "motion": motion or MOTION})
    return records


def ensure_demo_checkpoint(model: Path, model_type: str = DEFAULT_MODEL_TYPE) -> Path:
    """The packaged trained checkpoint copied to `model` (again when the package's differs), or, for a family
    with no trained checkpoint, a random one (its answers are chance).

    A half-written copy has no `.complete` marker and is rebuilt."""
    from batchjob.demo_model import RECORD, packaged_model_dir

    source = packaged_model_dir(model_type)
    marker = model / ".complete"
    if (source / RECORD).is_file():
        stamp = (source / RECORD).read_text()
        if not marker.exists() or marker.read_text() != stamp:
            shutil.rmtree(model, ignore_errors=True)
            shutil.copytree(source, model)
            marker.write_text(stamp)
        return model
    from batchjob.synthetic.tiny_model import TinyModelSpec, write_tiny_checkpoint

    if not marker.exists() or marker.read_text() != "random":
        shutil.rmtree(model, ignore_errors=True)
        write_tiny_checkpoint(model, TinyModelSpec(model_type=model_type))
        marker.write_text("random")
    return model


def is_trained(model_type: str) -> bool:
    from batchjob.demo_model import RECORD, packaged_model_dir

    return (packaged_model_dir(model_type) / RECORD).is_file()


@dataclass(frozen=True)
class DemoNames:
    """Where a model type's demo lives under the demo directory: the default model's plain names, another's
    suffixed, so demos of several families share the clips' cache and never each other's output."""
    checkpoint: str
    config: str
    output: str
    job: str


def demo_names(model_type: str) -> DemoNames:
    suffix = "" if model_type == DEFAULT_MODEL_TYPE else f"-{model_type}"
    return DemoNames(f"model{suffix}", f"demo{suffix}.yaml", f"output{suffix}", f"demo{suffix}")


def demo_config_text(model_type: str) -> str:
    """The packaged demo config (`assets/demo.yaml`, written for the default model) for `model_type`: its
    names, and what its model was trained with (pixel budget, frames); a random-weight family gets a budget
    of its own. The packaged file must hold the default model's recipe (a RuntimeError says what differs)."""
    from batchjob.demo_model import RECIPES

    names = demo_names(model_type)
    trained = is_trained(model_type)
    recipe = RECIPES[model_type] if trained else RECIPES[DEFAULT_MODEL_TYPE]
    budget = recipe.max_pixels if trained else 65536
    text = resources.files("batchjob").joinpath("assets/demo.yaml").read_text()
    packaged = re.search(r"^  max_pixels: (\d+)", text, flags=re.M)
    if not packaged or int(packaged.group(1)) != RECIPES[DEFAULT_MODEL_TYPE].max_pixels:
        raise RuntimeError(f"batchjob/assets/demo.yaml: model.max_pixels must be the {DEFAULT_MODEL_TYPE} demo "
                           f"model's {RECIPES[DEFAULT_MODEL_TYPE].max_pixels} (its recipe, demo_model.RECIPES)")
    what = f"what the {model_type} demo model was trained with" if trained else "random weights: chance anyway"
    budget_line = packaged.group(0) if model_type == DEFAULT_MODEL_TYPE else f"  max_pixels: {budget}  # {what}"
    for pattern, line in ((r"^job: \S+", f"job: {names.job}"),
                          (r"^  checkpoint: \S+", f"  checkpoint: {names.checkpoint}"),
                          (r"^  max_pixels: \d+" + ("" if model_type == DEFAULT_MODEL_TYPE else ".*$"), budget_line),
                          (r"^  num_frames: \d+", f"  num_frames: {recipe.num_frames}"),
                          (r"^  directory: \S+", f"  directory: {names.output}")):
        text, found = re.subn(pattern, line, text, count=1, flags=re.M)
        if not found:
            raise RuntimeError(f"batchjob/assets/demo.yaml has no line matching {pattern!r}: restore it from git")
    return text


def build_demo(cache: str | os.PathLike | None = None, num_clips: int = 16, model_type: str = DEFAULT_MODEL_TYPE,
               seed: int = 0) -> Path:
    """Build (or reuse) the demo assets and return the path of the demo's job config.

    `model_type` picks the tiny model's family (`demo_model.DEMO_MODEL_TYPES`); the clips are drawn as the
    checkpoint the config names was trained (its recorded motion), and the config differs only in names, the
    pixel budget and frames (`demo_config_text`)."""
    from batchjob.demo_model import check_demo_model_type, recorded_motion

    check_demo_model_type(model_type)
    names = demo_names(model_type)
    root = demo_dir(cache)
    root.mkdir(parents=True, exist_ok=True)
    checkpoint = ensure_demo_checkpoint(root / names.checkpoint, model_type)
    records = build_scene_clips(root / "clips", num_clips, seed, motion=recorded_motion(checkpoint))
    (root / "manifest.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    config = root / names.config
    config.write_text(demo_config_text(model_type))
    return config


def check_demo_accuracy(config: Path, model_type: str = DEFAULT_MODEL_TYPE):
    """The demo run's accuracy per question kind against the bar of the checkpoint that answered
    (`batchjob.demo_accuracy`, from its training record); None for a random-weight family (chance is all it
    has)."""
    from batchjob.config import load_config
    from batchjob.demo_accuracy import chance_per_kind, check_kinds
    from batchjob.demo_model import RECORD
    from batchjob.pipeline.report import summarize

    cfg = load_config(config)
    record = Path(cfg.model.checkpoint) / RECORD
    if not is_trained(model_type) or not record.is_file():
        return None
    records = [json.loads(line) for line in (Path(config).parent / "manifest.jsonl").read_text().splitlines()
               if line.strip()]
    summary = summarize(cfg.output.directory)
    return check_kinds(summary["per_category"], json.loads(record.read_text())["accuracy"],
                       chance_per_kind(records))


def compare_demo_loaders(config: Path, model_type: str = DEFAULT_MODEL_TYPE,
                         loaders: tuple[str, ...] | None = None):
    """The demo's clips decoded by each loader and answered by the demo model in this process
    (`batchjob.loader_comparison`); the table and (with plotly installed) its page are written into the demo
    job's output directory. Returns the rows."""
    from batchjob.config import load_config
    from batchjob.demo_model import RECIPES
    from batchjob.engine import Classifier
    from batchjob.loader_comparison import LOADERS, STEM, compare_loaders, html_page, to_json

    cfg = load_config(config)
    root = Path(config).parent
    records = [json.loads(line) for line in (root / "manifest.jsonl").read_text().splitlines() if line.strip()]
    if model_type not in RECIPES or not is_trained(model_type):
        raise ValueError(f"{model_type}: no trained demo model, so a loader comparison would compare chance; "
                         f"use one of {', '.join(RECIPES)}")
    classifier = Classifier.from_pretrained(cfg.model.checkpoint, RECIPES[model_type].engine_config)
    rows = compare_loaders(root / "clips", records, classifier, cfg.loader.num_frames, loaders or LOADERS)
    out = Path(cfg.output.directory)
    out.mkdir(parents=True, exist_ok=True)
    clips = len({r["video"] for r in records})
    about = f"{clips} demo clips, {cfg.loader.num_frames} frames, the {model_type} demo model (in process, this machine)"
    (out / f"{STEM}.json").write_text(to_json(rows, about=about, model_type=model_type))
    try:
        (out / f"{STEM}.html").write_text(html_page(rows, "batchjob demo: loaders side by side", about))
    except ImportError:           # plotly is the report extra's
        pass
    return rows


def build_synthetic_dataset(root: str | os.PathLike, *, num_clips: int, questions_per_clip: int = 3,
                            seconds: tuple[float, float] = (1.0, 4.0), widths: tuple[int, ...] = (64, 96, 128),
                            fps: float = 10.0, gop_seconds: float = 1.0,
                            seed: int = 0) -> tuple[Path, list[dict]]:
    """Clips of mixed lengths and sizes plus a JSONL manifest with random 5-option questions.

    For tests and benchmarks: returns the manifest path and one record per clip (name, width, height,
    frames) so a test can check that the right frames reached the right questions.
    """
    import numpy as np

    from batchjob.synthetic.clips import make_clip

    root = Path(root)
    (root / "clips").mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    clips, records = [], []
    for i in range(num_clips):
        width = int(widths[i % len(widths)])
        height = width * 3 // 4 // 2 * 2
        name = f"clip{i:04d}.mp4"
        info = make_clip(root / "clips" / name, seconds=float(rng.uniform(*seconds)), fps=fps, width=width,
                         height=height, gop_seconds=gop_seconds, bframes=2, seed=i)
        clips.append({"video": name, "width": width, "height": height, "frames": info.num_frames})
        for q in range(questions_per_clip):
            records.append({"id": f"c{i:04d}q{q}", "video": name, "question": f"Question {q} about clip {i}?",
                            "options": [f"option {k}" for k in range(5)], "answer": int(rng.integers(0, 5)),
                            "category": f"cat{q % 2}"})
    manifest = root / "manifest.jsonl"
    manifest.write_text("".join(json.dumps(r) + "\n" for r in records))
    return manifest, clips
