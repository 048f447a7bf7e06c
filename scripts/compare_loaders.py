"""The product's trade-off, measured with the demo model: accuracy per question kind x GOP kind, and decode ms
per clip, for each loader.

    scripts/compare_loaders.py                         # 48 clips, seed 0, the three loaders
    scripts/compare_loaders.py --clips 96 --seed 3 --json out.json

Fresh demo clips (`batchjob.demo.build_scene_clips`: short GOPs and single-keyframe clips), each decoded by every
loader with the demo's 8 frames and answered by the trained demo model (`batchjob.engine.Classifier`, the
engine a job runs) on this machine's CPU. Decode ms is the loader's call alone, in this process (medians per
clip; a diagnostic of the decoders, not a whole-job benchmark). Keyframe-only decoding sees colour and count
anywhere, motion only where keyframes are spread over the clip.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LOADERS = ("pyav_keyframes", "pyav_adaptive", "opencv")
KINDS = ("colour", "count", "direction", "order")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--clips", type=int, default=48)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--loaders", nargs="+", default=list(LOADERS))
    parser.add_argument("--json", type=Path, help="also write the table here")
    args = parser.parse_args(argv)

    import numpy as np

    from batchjob.demo import build_scene_clips
    from batchjob.demo_model import RECIPES, packaged_model_dir
    from batchjob.engine import Classifier, ClassifyRequest, Clip
    from batchjob.loaders import load_video

    recipe = RECIPES["qwen2_5_vl"]
    classifier = Classifier.from_pretrained(packaged_model_dir("qwen2_5_vl"), recipe.engine_config)
    with tempfile.TemporaryDirectory() as tmp:
        records = build_scene_clips(Path(tmp), args.clips, seed=args.seed)
        by_clip: dict[str, list[dict]] = defaultdict(list)
        for r in records:
            by_clip[r["video"]].append(r)
        right: dict[tuple, list[bool]] = defaultdict(list)
        decode_ms: dict[tuple, list[float]] = defaultdict(list)
        for loader in args.loaders:
            for video, questions in by_clip.items():
                gop = questions[0]["gop"]
                t0 = time.perf_counter()
                frames, meta = load_video(str(Path(tmp) / video), backend=loader, num_frames=recipe.num_frames)
                decode_ms[(loader, gop)].append((time.perf_counter() - t0) * 1000)
                clip = Clip(frames, meta, f"{loader}:{video}")
                answers = classifier.classify([ClassifyRequest(q["id"], clip, q["question"], q["options"])
                                               for q in questions])
                for q, a in zip(questions, answers):
                    right[(loader, gop, q["category"])].append(a.choice == q["answer"])
    rows = []
    for loader in args.loaders:
        for gop in sorted({k[1] for k in decode_ms}):
            row = {"loader": loader, "gop": gop, "clips": len(decode_ms[(loader, gop)]),
                   "decode_ms": float(np.median(decode_ms[(loader, gop)]))}
            for kind in KINDS:
                got = right.get((loader, gop, kind), [])
                row[kind] = (sum(got) / len(got)) if got else None
                row[f"{kind}_n"] = len(got)
            rows.append(row)
    print(f"{args.clips} clips (seed {args.seed}), {recipe.num_frames} frames, the demo model; accuracy (questions)")
    print("| loader | GOP | " + " | ".join(KINDS) + " | decode ms per clip (median) |")
    print("|---|---|" + "---|" * len(KINDS) + "---|")
    for row in rows:
        cells = [f"{row[k]:.2f} ({row[k + '_n']})" if row[k] is not None else "-" for k in KINDS]
        print(f"| {row['loader']} | {row['gop']} | " + " | ".join(cells) + f" | {row['decode_ms']:.1f} |")
    if args.json:
        args.json.write_text(json.dumps({"clips": args.clips, "seed": args.seed, "rows": rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    raise SystemExit(main())
