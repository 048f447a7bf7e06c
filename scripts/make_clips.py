#!/usr/bin/env python
"""Build synthetic test clips with PyAV's encoders (see batchjob/synthetic/clips.py).

    python scripts/make_clips.py OUT_DIR                 # every clip of the test catalogue
    python scripts/make_clips.py OUT_DIR --only vp9_webm h264_single_keyframe
    python scripts/make_clips.py OUT_DIR --bench         # the two benchmark clips (30 s and 600 s)
    python scripts/make_clips.py OUT_DIR --demo 8        # small left/right motion clips for the demo

Nothing built here is committed; tests and benchmarks build what they need.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

from batchjob.synthetic.clips import CATALOGUE, make_clip, make_motion_clip

# The benchmark clips: H.264 with B-frames in MP4, as most user clips are.
BENCH_CLIPS = {
    "bench_30s_640x360_gop2s": dict(codec="h264", container="mp4", seconds=30, fps=30, width=640, height=360,
                                    gop_seconds=2, bframes=2),
    "bench_600s_320x180_gop10s": dict(codec="h264", container="mp4", seconds=600, fps=30, width=320, height=180,
                                      gop_seconds=10, bframes=2),
}


def build(out_dir: str, specs: dict[str, dict], *, reuse: bool = True) -> dict[str, str]:
    """name -> path; an existing file is reused (the 600 s clip takes a minute to encode)."""
    os.makedirs(out_dir, exist_ok=True)
    paths = {}
    for name, spec in specs.items():
        path = os.path.join(out_dir, f"{name}.{spec['container']}")
        if not (reuse and os.path.exists(path) and os.path.getsize(path) > 0):
            start = time.perf_counter()
            make_clip(path + ".part", **spec)  # renamed when complete: an interrupted run leaves no clip
            os.replace(path + ".part", path)
            print(f"built {path} in {time.perf_counter() - start:.1f} s", file=sys.stderr)
        paths[name] = path
    return paths


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out_dir")
    parser.add_argument("--only", nargs="+", choices=sorted(CATALOGUE), help="catalogue clips to build")
    parser.add_argument("--bench", action="store_true", help="build the benchmark clips instead")
    parser.add_argument("--demo", type=int, metavar="N", help="build N demo motion clips instead")
    parser.add_argument("--force", action="store_true", help="rebuild clips that already exist")
    args = parser.parse_args()
    if args.demo:
        os.makedirs(args.out_dir, exist_ok=True)
        for i in range(args.demo):
            direction = "right" if i % 2 == 0 else "left"
            info = make_motion_clip(os.path.join(args.out_dir, f"motion_{i:03d}_{direction}.mp4"),
                                    direction=direction, seed=i)
            print(info.path)
        return
    specs = BENCH_CLIPS if args.bench else {k: CATALOGUE[k] for k in (args.only or sorted(CATALOGUE))}
    for path in build(args.out_dir, specs, reuse=not args.force).values():
        print(path)


if __name__ == "__main__":
    main()
