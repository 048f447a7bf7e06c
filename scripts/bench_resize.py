#!/usr/bin/env python
"""Decoder-side preparation benchmark: resize and whole preparation per clip, and a decoder process's memory.

    python scripts/bench_resize.py [--runs 7] [--clip-dir .cache/bench_resize] [--json out.json]
                                   [--baseline-tree /path/to/checkout/before/the/change]

Sizes are what the shipped config plans: configs/nextqa.yaml's min/max_pixels (16 frames, pyav_keyframes)
through a Qwen2.5-VL checkpoint's processor settings, for 720p and 1080p clips; a 360p clip with min_pixels
forcing an upscale is a diagnostic row. Clips are real H.264 files built once with batchjob.synthetic and
decoded by pyav_keyframes. Everything is single-threaded (torch.set_num_threads(1), numpy's BLAS at one
thread), as a decoder runs (Ray gives each one CPU). Methods take turns within each round; medians over --runs.

1. Resize, ms per clip: `numpy` (resize_gemm, the default), `torch` (PyTorch's kernel, BATCHJOB_RESIZE=torch)
   and `reference` (the one-tap-at-a-time numpy statement, which was the torch-less fallback before).
2. Whole preparation (resize + rescale + normalise + patchify), ms per clip: `bytes` (what decoders run:
   preprocess_video(normalise=False), uint8 patches the engine normalises on its device), `numpy` (the same
   with float32 values made on the host), `torch` (`numpy` with BATCHJOB_RESIZE=torch) and `before` (what
   decoders ran before this change: PyTorch's resize, then transformers' Qwen2-VL PIL image processor). Every
   method's pixel values (bytes: after the engine's lookup) are checked bit-identical to `before`'s in the
   same run.
3. A decoder process as Ray starts one: a fresh interpreter that imports the Decoder, builds it with the MLX
   engine's input preparer (warm-up included), then decodes and prepares one 720p clip. Reported: start-up
   (import + warm-up), the clip's time, the process's own peak resident memory (VmHWM), and whether torch or
   transformers got imported. Ray itself is left out (its node id is stubbed): the figure is the decoder's
   own. --baseline-tree adds a row for another checkout's decoder (e.g. `git archive` of the commit before).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")   # before numpy's BLAS starts: single-threaded, as torch below

ROOT = Path(__file__).resolve().parents[1]
SOURCES = {"720p": (1280, 720), "1080p": (1920, 1080), "360p": (640, 360)}
UPSCALE_MIN_PIXELS = 2 * 200704    # the diagnostic row: min_pixels above a 360p frame's own

DECODER = r"""
import json, sys, time
t0 = time.perf_counter()
from batchjob.config import ModelConfig
from batchjob.pipeline import actors
from batchjob.pipeline.engines import input_preparer
actors._node_id = lambda: "bench"            # no Ray: the decoder's own cost
model = ModelConfig(checkpoint=sys.argv[1], max_pixels=int(sys.argv[3]))
decoder = actors.Decoder("pyav_keyframes", 16, {}, input_preparer(model))
t1 = time.perf_counter()
status, payload = decoder.decode(sys.argv[2])
t2 = time.perf_counter()
hwm = next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith("VmHWM"))
print(json.dumps({"ok": status.ok, "error": status.error, "prepared": type(payload).__name__,
                  "module": actors.__file__, "startup_s": t1 - t0, "clip_s": t2 - t1, "vmhwm_mb": hwm / 1024,
                  "torch": "torch" in sys.modules, "transformers": "transformers" in sys.modules}))
"""


def shipped_settings(checkpoint: Path):
    """The vision settings a `batchjob run configs/nextqa.yaml` decoder uses with this checkpoint."""
    import yaml

    from batchjob.engine.preprocess import load_vision_settings

    model = yaml.safe_load((ROOT / "configs" / "nextqa.yaml").read_text())["model"]
    return load_vision_settings(checkpoint, model.get("min_pixels"), model.get("max_pixels"))


def build_clips(folder: Path) -> dict[str, Path]:
    from batchjob.synthetic.clips import make_clip

    folder.mkdir(parents=True, exist_ok=True)
    clips = {}
    for name, (w, h) in SOURCES.items():
        path = folder / f"{name}.mp4"
        if not path.exists():
            make_clip(path, width=w, height=h, seconds=8.0, gop_seconds=0.5, pattern="motion", seed=7)
        clips[name] = path
    return clips


def before_prepare(frames: np.ndarray, settings, plan) -> np.ndarray:
    """What decoders ran before this change (the baseline): PyTorch's resize, then transformers' Qwen2-VL PIL
    image processor held to the planned size, its per-image patches regrouped in time."""
    from transformers.image_utils import SizeDict
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    from batchjob.engine.resize import resize_frames

    p, tp = settings.patch_size, settings.temporal_patch_size
    size = (plan.grid_thw[1] * p, plan.grid_thw[2] * p)

    class FixedSize(Qwen2VLImageProcessorPil):
        def resize(self, image, size=None, resample=None, factor=None, **kwargs):
            return super(Qwen2VLImageProcessorPil, self).resize(
                image=image, size=SizeDict(height=fixed[0], width=fixed[1]), resample=resample)

    fixed = size
    proc = FixedSize(min_pixels=settings.min_pixels, max_pixels=settings.max_pixels, patch_size=p,
                     temporal_patch_size=tp, merge_size=settings.merge_size,
                     image_mean=list(settings.image_mean), image_std=list(settings.image_std))
    frames = resize_frames(frames, *size, backend="torch")
    per_frame = np.asarray(proc(list(frames), return_tensors="np")["pixel_values"], np.float32)
    n, gt = plan.grid_thw[1] * plan.grid_thw[2], len(frames) // tp
    per_frame = per_frame.reshape(len(frames), n, 3, tp, p, p)[:, :, :, 0]
    return np.ascontiguousarray(per_frame.reshape(gt, tp, n, 3, p, p).transpose(0, 2, 3, 1, 4, 5).reshape(gt * n, -1))


def _timed(fn, samples: list[float]):
    start = time.perf_counter()
    out = fn()
    samples.append((time.perf_counter() - start) * 1000)
    return out


def time_clips(clips: dict[str, Path], checkpoint: Path, runs: int) -> tuple[list[dict], list[dict]]:
    import dataclasses

    import torch

    from batchjob.engine.patchify import normalize_bytes, normalize_table
    from batchjob.engine.preprocess import plan_video, preprocess_video
    from batchjob.engine.resize import ENV, resize_frames
    from batchjob.loaders import load_video

    torch.set_num_threads(1)
    shipped = shipped_settings(checkpoint)
    cases = [("720p", shipped, "shipped"), ("1080p", shipped, "shipped"),
             ("360p", dataclasses.replace(shipped, min_pixels=UPSCALE_MIN_PIXELS,
                                          max_pixels=2 * UPSCALE_MIN_PIXELS), "diagnostic (upscale)")]
    resize_rows, prepare_rows = [], []
    for name, settings, label in cases:
        frames, meta = load_video(str(clips[name]), backend="pyav_keyframes", num_frames=16)
        plan = plan_video(frames.shape, meta, settings)
        h, w = plan.grid_thw[1] * settings.patch_size, plan.grid_thw[2] * settings.patch_size

        def prepare(backend: str, normalise: bool = True):
            os.environ[ENV] = backend
            try:
                return preprocess_video(frames, meta, settings, normalise=normalise).pixel_values
            finally:
                os.environ.pop(ENV)

        resizers = {m: (lambda m=m: resize_frames(frames, h, w, backend=m)) for m in ("numpy", "torch", "reference")}
        preparers = {"bytes": lambda: prepare("numpy", normalise=False), "numpy": lambda: prepare("numpy"),
                     "torch": lambda: prepare("torch"), "before": lambda: before_prepare(frames, settings, plan)}
        table = normalize_table(settings.image_mean, settings.image_std)
        for methods, rows, base in ((resizers, resize_rows, "torch"), (preparers, prepare_rows, "before")):
            samples: dict[str, list[float]] = {m: [] for m in methods}
            outputs = {m: fn() for m, fn in methods.items()}             # warm-up, and the values compared
            megabytes = {m: o.nbytes / 1e6 for m, o in outputs.items()}
            if "bytes" in outputs:                                       # as the engine will see them
                outputs["bytes"] = normalize_bytes(outputs["bytes"], table)
            for _ in range(runs):
                for m, fn in methods.items():
                    _timed(fn, samples[m])
            ms = {m: statistics.median(v) for m, v in samples.items()}
            rows.append({"clip": name, "case": label, "frames": list(frames.shape), "to": [h, w], "ms": ms,
                         "payload_mb": megabytes,
                         "identical_to_" + base: {m: bool(np.array_equal(o, outputs[base])) for m, o in outputs.items()},
                         "ratios": {f"{m} / {b}": ms[m] / ms[b] for m in ms for b in {"torch", base} if m != b}})
    return resize_rows, prepare_rows


def decoder_process(checkpoint: Path, clip: Path, tree: Path, max_pixels: int, resize: str | None) -> dict:
    env = {**os.environ, "PYTHONPATH": str(tree)}
    env.pop("BATCHJOB_RESIZE", None)
    if resize:
        env["BATCHJOB_RESIZE"] = resize
    proc = subprocess.run([sys.executable, "-c", DECODER, str(checkpoint), str(clip), str(max_pixels)],
                          capture_output=True, text=True, env=env, timeout=600, cwd=tree)
    if proc.returncode:
        raise RuntimeError(f"decoder process ({tree}) failed:\n{proc.stderr[-3000:]}")
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    if not out["ok"] or out["prepared"] != "VideoInputs" or not out["module"].startswith(str(tree)):
        raise RuntimeError(f"decoder process ({tree}) did not prepare the clip: {out}")
    return out


def _print_table(title: str, rows: list[dict], methods: tuple[str, ...], base: str) -> None:
    print(f"\n{title}")
    ratios = ("torch",) if base == "torch" else ("torch", base)
    first = methods[0]
    print("| clip | case | to (h x w) | " + " | ".join(f"{m} ms" for m in methods)
          + "".join(f" | {first} / {b}" for b in ratios) + f" | bit-identical to {base} |")
    print("|---" * (len(methods) + len(ratios) + 4) + "|")
    for r in rows:
        same = ", ".join(m for m, ok in r["identical_to_" + base].items() if ok)
        print(f"| {r['clip']} | {r['case']} | {r['to'][0]}x{r['to'][1]} | "
              + " | ".join(f"{r['ms'][m]:.0f}" for m in methods)
              + "".join(f" | {r['ms'][first] / r['ms'][b]:.2f}x" for b in ratios) + f" | {same} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=7)
    parser.add_argument("--processes", type=int, default=3, help="fresh decoder processes per row")
    parser.add_argument("--clip-dir", default=".cache/bench_resize")
    parser.add_argument("--baseline-tree", help="another checkout whose decoder gets a row in the process table")
    parser.add_argument("--process-only", action="store_true", help="skip the per-clip timings")
    parser.add_argument("--json", help="write the figures here")
    args = parser.parse_args()

    from batchjob.synthetic.tiny_model import write_tiny_checkpoint

    folder = Path(args.clip_dir).resolve()   # absolute: the decoder processes run in their own tree
    clips = build_clips(folder)
    checkpoint = folder / "tiny-qwen25vl"
    if not (checkpoint / "config.json").exists():
        write_tiny_checkpoint(checkpoint)
    report: dict = {"machine": f"{os.cpu_count()} CPUs", "runs": args.runs}
    if not args.process_only:
        report["resize"], report["prepare"] = time_clips(clips, checkpoint, args.runs)
        _print_table(f"Resize, ms per clip of 16 decoded frames, single-threaded, median of {args.runs}",
                     report["resize"], ("numpy", "torch", "reference"), "torch")
        _print_table("Whole preparation (resize + normalise + patchify), ms per clip, median of "
                     f"{args.runs}; before = PyTorch resize + transformers' processor", report["prepare"],
                     ("bytes", "numpy", "torch", "before"), "before")
        print("bytes: what decoders run (uint8 patch bytes, normalised on the engine's device), "
              + ", ".join(f"{r['clip']} {r['payload_mb']['bytes']:.1f} MB per clip against "
                          f"{r['payload_mb']['numpy']:.1f} MB of float32" for r in report["prepare"]))
    max_pixels = shipped_settings(checkpoint).max_pixels
    trees = [("this tree, default (numpy)", ROOT, None), ("this tree, BATCHJOB_RESIZE=torch", ROOT, "torch")]
    if args.baseline_tree:
        trees.append((f"baseline {args.baseline_tree}", Path(args.baseline_tree).resolve(), None))
    report["decoder_process"] = {}
    for label, tree, resize in trees:
        report["decoder_process"][label] = [decoder_process(checkpoint, clips["720p"], tree, max_pixels, resize)
                                            for _ in range(args.processes)]
    print(f"\nDecoder process, one 720p clip of 16 frames at the shipped max_pixels, median of {args.processes} "
          "fresh processes")
    print("| decoder | start-up s (import + warm-up) | clip s | VmHWM MB | torch imported | transformers imported |")
    print("|---|---|---|---|---|---|")
    for label, runs in report["decoder_process"].items():
        med = {k: statistics.median(r[k] for r in runs) for k in ("startup_s", "clip_s", "vmhwm_mb")}
        print(f"| {label} | {med['startup_s']:.2f} | {med['clip_s']:.2f} | {med['vmhwm_mb']:.0f} | "
              f"{runs[0]['torch']} | {runs[0]['transformers']} |")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
