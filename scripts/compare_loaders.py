"""The product's trade-off, measured with the demo model: accuracy per question kind x GOP kind, and decode ms
per clip, for each loader.

    scripts/compare_loaders.py                         # 48 clips, seed 0, the three loaders, the default model
    scripts/compare_loaders.py --clips 96 --seed 3 --json out.json --html loaders.html
    scripts/compare_loaders.py --model-type qwen2_5_vl  # the Qwen2.5-VL demo model on its own scenes

Fresh demo clips (`batchjob.demo.build_scene_clips`: short GOPs and single-keyframe clips), each decoded by every
loader with the demo's 8 frames and answered by the trained demo model (`batchjob.engine.Classifier`, the
engine a job runs) on this machine's CPU. Decode ms is the loader's call alone, in this process (medians per
clip; a diagnostic of the decoders, not a whole-job benchmark). Keyframe-only decoding sees colour and count
anywhere, motion only where keyframes are spread over the clip.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def main(argv: list[str] | None = None) -> int:
    sys.path.insert(0, str(ROOT / "scripts"))
    from benchlib.demo_models import add_model_type_argument, demo_model

    from batchjob.loader_comparison import LOADERS

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--clips", type=int, default=48)
    parser.add_argument("--seed", type=int, default=0)
    add_model_type_argument(parser)
    parser.add_argument("--loaders", nargs="+", default=list(LOADERS))
    parser.add_argument("--json", type=Path, help="also write the table here")
    parser.add_argument("--html", type=Path, help="also write the table and its plot here (needs batchjob[report])")
    args = parser.parse_args(argv)

    from batchjob.demo import build_scene_clips
    from batchjob.loader_comparison import compare_loaders, html_page, markdown_table, to_json

    model = demo_model(args.model_type)
    classifier = model.classifier()
    with tempfile.TemporaryDirectory() as tmp:
        records = build_scene_clips(Path(tmp), args.clips, seed=args.seed, motion=model.motion)
        rows = compare_loaders(tmp, records, classifier, model.num_frames, args.loaders)
    about = f"{args.clips} clips (seed {args.seed}), {model.num_frames} frames, the {args.model_type} demo model"
    print(f"{about}; accuracy (questions)")
    print(markdown_table(rows))
    if args.json:
        args.json.write_text(to_json(rows, clips=args.clips, seed=args.seed, model_type=args.model_type,
                                     command=" ".join(["scripts/compare_loaders.py", *(argv or sys.argv[1:])])))
    if args.html:
        args.html.write_text(html_page(rows, "batchjob: loaders side by side", about))
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    raise SystemExit(main())
