"""Assets for `batchjob demo`: a tiny checkpoint, synthetic clips and a manifest, built locally.

The demo must work on a fresh machine with no network, so nothing is downloaded: the checkpoint is
random weights in Hugging Face layout and the clips are encoded with PyAV. The questions have known
answers (the clip generator decides direction and colour), so the report shows a real accuracy (of a
random model: chance level).
"""
from __future__ import annotations

import json
import os
import shutil
from importlib import resources
from pathlib import Path

COLOURS = {"red": (220, 40, 40), "green": (40, 200, 60), "blue": (40, 80, 230), "yellow": (230, 210, 40)}


def demo_dir(cache: str | os.PathLike | None = None) -> Path:
    base = Path(cache) if cache else Path(os.environ.get("BATCHJOB_CACHE", Path.home() / ".cache" / "batchjob"))
    return (base / "demo").expanduser().resolve()


def demo_questions(clip: str, direction: str, colour: str) -> list[dict]:
    """Three questions per clip, answers known from how the clip was drawn."""
    return [
        {"video": clip, "question": "Which way does the square move?", "options": ["left", "right"],
         "answer": direction, "category": "direction"},
        {"video": clip, "question": "What colour is the moving square?", "options": list(COLOURS),
         "answer": colour, "category": "colour"},
        {"video": clip, "question": "How many squares are in the video?", "options": ["one", "two", "three"],
         "answer": "one", "category": "count"},
    ]


def build_clips(root: Path, num_clips: int) -> list[dict]:
    """Encode `num_clips` motion clips (cycling direction and colour) and return their manifest records."""
    from batchjob.synthetic.clips import make_motion_clip

    root.mkdir(parents=True, exist_ok=True)
    names = list(COLOURS)
    records = []
    for i in range(num_clips):
        direction = ("left", "right")[i % 2]
        colour = names[(i // 2) % len(names)]
        name = f"clip{i:03d}.mp4"
        if not (root / name).exists():
            tmp = root / f".{name}"
            make_motion_clip(tmp, direction=direction, color=COLOURS[colour], seed=i)
            tmp.rename(root / name)
        for q, rec in enumerate(demo_questions(name, direction, colour)):
            records.append({"id": f"clip{i:03d}-q{q}", **rec})
    return records


def ensure_tiny_checkpoint(model: Path, model_type: str = "qwen2_5_vl") -> Path:
    """Build the default tiny checkpoint at `model` unless a complete one is there already.

    A half-written checkpoint from an interrupted build has no `.complete` marker and is rebuilt.
    """
    from batchjob.synthetic.tiny_model import TinyModelSpec, write_tiny_checkpoint

    if not (model / ".complete").exists():
        shutil.rmtree(model, ignore_errors=True)
        write_tiny_checkpoint(model, TinyModelSpec(model_type=model_type))
        (model / ".complete").touch()
    return model


def build_demo(cache: str | os.PathLike | None = None, num_clips: int = 12, model_type: str = "qwen2_5_vl") -> Path:
    """Build (or reuse) the demo assets and return the path of the demo's job config.

    `model_type` picks the tiny model's family (qwen2_5_vl, qwen3_vl, qwen3_vl_moe); only the checkpoint
    path (and, for Qwen3-VL, the pixel budget, which bounds the whole clip there) differ in the config."""
    root = demo_dir(cache)
    root.mkdir(parents=True, exist_ok=True)
    model = "model" if model_type == "qwen2_5_vl" else f"model-{model_type}"
    ensure_tiny_checkpoint(root / model, model_type)
    records = build_clips(root / "clips", num_clips)
    (root / "manifest.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    text = resources.files("batchjob").joinpath("assets/demo.yaml").read_text()
    if model_type != "qwen2_5_vl":
        text = text.replace("  checkpoint: model\n", f"  checkpoint: {model}\n").replace(
            "max_pixels: 12544 ", "max_pixels: 65536 ").replace("job: demo\n", f"job: demo-{model_type}\n").replace(
            "directory: output\n", f"directory: output-{model_type}\n")
    config = root / ("demo.yaml" if model_type == "qwen2_5_vl" else f"demo-{model_type}.yaml")
    config.write_text(text)
    return config


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
