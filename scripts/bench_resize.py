#!/usr/bin/env python
"""Decoder-side preparation benchmark: the frame resize per clip, and a decoder process's start-up and memory.

    python scripts/bench_resize.py [--runs 5] [--clip-dir .cache/bench_resize] [--json out.json]
    python scripts/bench_resize.py --process-only --tree /path/to/other/checkout   # a decoder of another tree

1. Resize, ms per clip of 16 real decoded frames (H.264 clips built once with batchjob.synthetic, decoded by
   pyav_keyframes): 1080p and 720p down to Qwen2.5-VL grids, and 640x360 up. Methods, all single-threaded
   (torch.set_num_threads(1), numpy's BLAS capped at 1 thread), taking turns within each round: `numpy`
   (resize_gemm, the default), `torch` (PyTorch's kernel, BATCHJOB_RESIZE=torch) and `reference` (the
   one-tap-at-a-time numpy path that was the fallback before). Medians over --runs rounds; every method's
   bytes are checked equal to torch's in the same run.
2. A decoder process as Ray starts one: a fresh interpreter that imports the Decoder, builds it with the MLX
   engine's input preparer (warm-up included), then decodes and prepares one 1080p clip. Reported: start-up
   (import + warm-up), the clip's time, the process's own peak resident memory (VmHWM), and whether torch or
   transformers ended up imported. Ray itself is left out (its node id is stubbed): the figure is the
   decoder's own. --tree runs that process against another checkout (e.g. the commit before this change).
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

CASES = [  # (clip, source size, resized size (h, w)): what preprocess_video plans for them
    ("1080p", (1920, 1080), (252, 448)),
    ("1080p", (1920, 1080), (308, 560)),     # max_pixels 200704 (configs/nextqa.yaml)
    ("720p", (1280, 720), (252, 448)),
    ("720p", (1280, 720), (308, 560)),
    ("360p", (640, 360), (504, 896)),        # an upscale: min_pixels above the frame's own
]

DECODER = r"""
import json, sys, time
t0 = time.perf_counter()
from batchjob.config import ModelConfig
from batchjob.pipeline import actors
from batchjob.pipeline.engines import input_preparer
actors._node_id = lambda: "bench"            # no Ray: the decoder's own cost
decoder = actors.Decoder("pyav_keyframes", 16, {}, input_preparer(ModelConfig(checkpoint=sys.argv[1], max_pixels=200704)))
t1 = time.perf_counter()
status, payload = decoder.decode(sys.argv[2])
t2 = time.perf_counter()
status_lines = open("/proc/self/status").read().splitlines()
hwm = next(int(line.split()[1]) for line in status_lines if line.startswith("VmHWM"))
print(json.dumps({"ok": status.ok, "error": status.error, "prepared": type(payload).__name__,
                  "startup_s": t1 - t0, "clip_s": t2 - t1, "vmhwm_mb": hwm / 1024,
                  "torch": "torch" in sys.modules, "transformers": "transformers" in sys.modules}))
"""


def build_clips(folder: Path) -> dict[str, Path]:
    from batchjob.synthetic.clips import make_clip

    folder.mkdir(parents=True, exist_ok=True)
    clips = {}
    for name, (w, h), _ in CASES:
        path = folder / f"{name}.mp4"
        if not path.exists():
            make_clip(path, width=w, height=h, seconds=8.0, gop_seconds=0.5, pattern="motion", seed=7)
        clips[name] = path
    return clips


def time_resizes(clips: dict[str, Path], runs: int) -> list[dict]:
    import torch

    from batchjob.engine.resize import resize_frames
    from batchjob.loaders import load_video

    torch.set_num_threads(1)
    rows = []
    for name, _, (h, w) in CASES:
        frames, _ = load_video(str(clips[name]), backend="pyav_keyframes", num_frames=16)
        methods = ("numpy", "torch", "reference")
        want = resize_frames(frames, h, w, backend="torch")
        same = {m: bool(np.array_equal(resize_frames(frames, h, w, backend=m), want)) for m in methods}
        samples: dict[str, list[float]] = {m: [] for m in methods}
        for _ in range(runs):
            for m in methods:
                start = time.perf_counter()
                resize_frames(frames, h, w, backend=m)
                samples[m].append((time.perf_counter() - start) * 1000)
        ms = {m: statistics.median(v) for m, v in samples.items()}
        rows.append({"clip": name, "frames": list(frames.shape), "to": [h, w], "ms": ms, "equal_to_torch": same,
                     "numpy_vs_torch": ms["numpy"] / ms["torch"], "reference_vs_numpy": ms["reference"] / ms["numpy"]})
    return rows


def decoder_process(checkpoint: Path, clip: Path, tree: Path, resize: str | None) -> dict:
    env = {**os.environ, "PYTHONPATH": str(tree)}
    env.pop("BATCHJOB_RESIZE", None)
    if resize:
        env["BATCHJOB_RESIZE"] = resize
    proc = subprocess.run([sys.executable, "-c", DECODER, str(checkpoint), str(clip)], capture_output=True,
                          text=True, env=env, timeout=600, cwd=tree)
    if proc.returncode:
        raise RuntimeError(f"decoder process failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--clip-dir", default=".cache/bench_resize")
    parser.add_argument("--tree", default=str(Path(__file__).resolve().parents[1]),
                        help="checkout whose decoder the process part runs (default: this one)")
    parser.add_argument("--process-only", action="store_true", help="skip the resize timings")
    parser.add_argument("--json", help="write the figures here")
    args = parser.parse_args()

    from batchjob.synthetic.tiny_model import write_tiny_checkpoint

    folder = Path(args.clip_dir)
    clips = build_clips(folder)
    checkpoint = folder / "tiny-qwen25vl"
    if not (checkpoint / "config.json").exists():
        write_tiny_checkpoint(checkpoint)
    report: dict = {"machine": f"{os.cpu_count()} CPUs", "runs": args.runs}
    if not args.process_only:
        report["resize"] = time_resizes(clips, args.runs)
        print(f"\nResize, ms per clip of 16 decoded frames, single-threaded, median of {args.runs}")
        print(f"| clip | to | numpy (new) | torch | reference (old numpy) | numpy / torch | old / new | "
              "bytes equal to torch (new, old) |")
        print("|---|---|---|---|---|---|---|---|")
        for r in report["resize"]:
            print(f"| {r['clip']} | {r['to'][0]}x{r['to'][1]} | {r['ms']['numpy']:.0f} | {r['ms']['torch']:.0f} | "
                  f"{r['ms']['reference']:.0f} | {r['numpy_vs_torch']:.1f}x | {r['reference_vs_numpy']:.1f}x | "
                  f"{r['equal_to_torch']['numpy']}, {r['equal_to_torch']['reference']} |")
    tree = Path(args.tree).resolve()
    report["decoder_process"] = {}
    for label, resize in (("default", None), ("BATCHJOB_RESIZE=torch", "torch")):
        runs = [decoder_process(checkpoint, clips["1080p"], tree, resize) for _ in range(3)]
        report["decoder_process"][label] = runs
    print(f"\nDecoder process ({tree}), one 1080p clip of 16 frames, median of 3 fresh processes")
    print("| resize | start-up s (import + warm-up) | clip s | VmHWM MB | torch imported | transformers imported |")
    print("|---|---|---|---|---|---|")
    for label, runs in report["decoder_process"].items():
        med = {k: statistics.median(r[k] for r in runs) for k in ("startup_s", "clip_s", "vmhwm_mb")}
        print(f"| {label} | {med['startup_s']:.2f} | {med['clip_s']:.2f} | {med['vmhwm_mb']:.0f} | "
              f"{runs[0]['torch']} | {runs[0]['transformers']} |")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
