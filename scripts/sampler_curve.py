#!/usr/bin/env python
"""The sampler curve: accuracy per question kind and decode ms per clip, per loader, over GOP lengths from
0.5 s to the whole clip, with a trained demo model (the demo's default unless `--model-type` names another), on
720p clips.

    scripts/sampler_curve.py                      # the README's table (first run encodes the clips, then cached)
    scripts/sampler_curve.py --small              # a seconds-long smoke run (tests)
    scripts/sampler_curve.py --loaders pyav_keyframes pyav_burst:burst_step=2 opencv
    scripts/sampler_curve.py --model-type qwen2_5_vl   # the Qwen2.5-VL demo model, on its own scenes

Scenes from `batchjob.synthetic.scenes` (the demo's kind, drawn with the motion the model was trained on)
rendered at 1280x720 and encoded once per GOP length (H.264, 2 B-frames, fresh sensor noise per frame; see
benchlib/scene_gops.py), cached under --cache. Every clip is decoded by every loader with the model's frames per
clip, loaders taking turns clip by clip so a busy machine slows them alike, and the frames are answered by the
packaged demo model (`batchjob.engine.Classifier`, the engine a job runs). Decode ms is the loader's call
alone, in this process: a diagnostic of the decoders (the median per clip), not a whole-job benchmark. Ratios
are against pyav_keyframes' decode ms and opencv's accuracy on the same clips in the same run; "motion" pools
the direction and order questions.
"""
from __future__ import annotations

import argparse
import sys
import time
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LOADERS = ("pyav_keyframes", "pyav_burst", "pyav_burst:burst_step=2", "pyav_burst:burst_step=8",
           "pyav_adaptive:max_decoded_frames=32", "pyav_adaptive", "opencv")
KINDS = ("colour", "count", "direction", "order")
MOTION = ("direction", "order")
BASE_COST, BASE_ACCURACY = "pyav_keyframes", "opencv"


def parse_loader(spec: str) -> tuple[str, dict]:
    """`name` or `name:key=value,key=value` (integers, floats, true/false)."""
    name, _, rest = spec.partition(":")
    kwargs = {}
    for item in filter(None, rest.split(",")):
        key, _, value = item.partition("=")
        low = value.lower()
        kwargs[key] = (low == "true") if low in ("true", "false") else (int(value) if value.lstrip("-").isdigit()
                                                                         else float(value))
    return name, kwargs


def summarise(right: dict, decode_ms: dict, loaders: list[str], gops: list[str]) -> list[dict]:
    """One row per loader and GOP: accuracy per kind (and motion), questions, median decode ms, and the ratios."""
    import numpy as np

    def acc(loader, gop, kinds):
        got = [x for k in kinds for x in right.get((loader, gop, k), [])]
        return (sum(got) / len(got) if got else None), len(got)

    rows = []
    for gop in gops:
        for loader in loaders:
            row = {"loader": loader, "gop": gop, "clips": len(decode_ms[(loader, gop)]),
                   "decode_ms": float(np.median(decode_ms[(loader, gop)]))}
            for kind in KINDS:
                row[kind], row[f"{kind}_n"] = acc(loader, gop, (kind,))
            row["motion"], row["motion_n"] = acc(loader, gop, MOTION)
            rows.append(row)
        base = {r["loader"]: r for r in rows if r["gop"] == gop}
        for row in rows[-len(loaders):]:
            cost, good = base.get(BASE_COST), base.get(BASE_ACCURACY)
            row["ms_vs_keyframes"] = row["decode_ms"] / cost["decode_ms"] if cost else None
            for kind in MOTION + ("motion",):
                ok = good and good[kind] and row[kind] is not None
                row[f"{kind}_vs_opencv"] = row[kind] / good[kind] if ok else None
    return rows


def table(rows: list[dict]) -> str:
    def f(x, fmt="{:.2f}"):
        return "-" if x is None else fmt.format(x)

    lines = ["| GOP | loader | colour | count | direction | order | direction vs opencv | order vs opencv "
             "| decode ms/clip | ms vs keyframes |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['gop']} | {r['loader']} | {f(r['colour'])} | {f(r['count'])} | {f(r['direction'])} | "
                     f"{f(r['order'])} | {f(r['direction_vs_opencv'])} | {f(r['order_vs_opencv'])} | "
                     f"{r['decode_ms']:.1f} | {f(r['ms_vs_keyframes'], '{:.1f}x')} |")
    return "\n".join(lines)


def reprint(path: Path) -> int:
    """The table of a results file, with the model and command that made it (the README's table)."""
    import json

    report = json.loads(path.read_text())
    model = report.get("model_type") or report.get("model")
    print(f"{path.name}: {report['command']} (the {model} demo model)")
    print(table(report["rows"]))
    return 0


def main(argv: list[str] | None = None) -> int:
    sys.path.insert(0, str(ROOT / "scripts"))
    from batchjob.cache_home import cache_home
    from benchlib.demo_models import add_model_type_argument, demo_model, told_as

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_model_type_argument(parser)
    parser.add_argument("--checkpoint", type=Path, default=None,
                        help="a checkpoint trained to the model type's recipe (default: the packaged one)")
    parser.add_argument("--scenes", type=int, default=24, help="scenes, each encoded at every GOP length")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--seconds", type=float, default=12.0)
    parser.add_argument("--fps", type=int, default=24)
    parser.add_argument("--size", default="1280x720")
    parser.add_argument("--gops", type=float, nargs="+", default=[0.5, 2, 5, 10, 0],
                        help="GOP lengths in seconds; 0 = a single keyframe")
    parser.add_argument("--loaders", nargs="+", default=list(LOADERS), help="name or name:key=value,...")
    parser.add_argument("--cache", type=Path, default=cache_home() / "sampler_clips")
    parser.add_argument("--workers", type=int, default=1, help="processes encoding scenes (first run only)")
    parser.add_argument("--model-seconds", type=float, default=4.0,
                        help="the clip duration the model is told (its training range: 2-6 s); 0: the true one")
    parser.add_argument("--small", action="store_true", help="smoke run: 2 scenes of 3 s at 320x180")
    parser.add_argument("--json", type=Path, help="results file (default benchmarks/results/sampler-curve-...)")
    parser.add_argument("--table", type=Path, help="only print the table of this results file")
    args = parser.parse_args(argv)
    if args.table:
        return reprint(args.table)
    if args.small:
        args.scenes, args.seconds, args.size, args.gops = 2, 3.0, "320x180", [0.5, 0]
    width, height = (int(v) for v in args.size.split("x"))

    from benchlib.env import environment, results_path, save_json
    from benchlib.scene_gops import ScenePlan, build_scene_set, gop_label

    from batchjob.engine import ClassifyRequest, Clip
    from batchjob.loaders import load_video

    model = demo_model(args.model_type, args.checkpoint)
    plan = ScenePlan(width, height, args.seconds, args.fps, tuple(args.gops), args.seed)
    t0 = time.perf_counter()
    records = build_scene_set(args.cache, plan, args.scenes, args.workers, motion=model.motion)
    encode_s = time.perf_counter() - t0
    classifier = model.classifier()
    loaders = [parse_loader(s) for s in args.loaders]
    by_clip: dict[str, list[dict]] = defaultdict(list)
    for r in records:
        by_clip[r["video"]].append(r)
    right: dict[tuple, list[bool]] = defaultdict(list)
    decode_ms: dict[tuple, list[float]] = defaultdict(list)
    first = args.cache / next(iter(by_clip))
    for name, kwargs in loaders:   # warm-up (imports, first-call set-up), untimed
        load_video(str(first), backend=name, num_frames=model.num_frames, **kwargs)
    t0 = time.perf_counter()
    for video, questions in by_clip.items():
        gop = questions[0]["gop"]
        for spec, (name, kwargs) in zip(args.loaders, loaders):
            start = time.perf_counter()
            frames, meta = load_video(str(args.cache / video), backend=name, num_frames=model.num_frames, **kwargs)
            decode_ms[(spec, gop)].append((time.perf_counter() - start) * 1000)
            clip = Clip(frames, told_as(meta, args.model_seconds), f"{spec}:{video}")
            answers = classifier.classify([ClassifyRequest(q["id"], clip, q["question"], q["options"])
                                           for q in questions])
            for q, a in zip(questions, answers):
                right[(spec, gop, q["category"])].append(a.choice == q["answer"])
    measure_s = time.perf_counter() - t0
    rows = summarise(right, decode_ms, list(args.loaders), [gop_label(g) for g in args.gops])
    print(f"{args.scenes} scenes x {len(args.gops)} GOP lengths, {width}x{height}, {args.seconds:g} s at "
          f"{args.fps} fps (told as {args.model_seconds:g} s), {model.num_frames} frames, {model.label}; "
          "accuracy per kind, median decode ms per clip")
    print(table(rows))
    print(f"encode {encode_s:.0f} s (0 when cached), decode + answer {measure_s:.0f} s")
    env = environment(("mlx.core", "av", "cv2"))
    report = {"benchmark": "sampler_curve", **env, "scenes": args.scenes, "seed": args.seed, "seconds": args.seconds,
              "fps": args.fps, "size": [width, height], "gops": args.gops, "num_frames": model.num_frames,
              "model_type": model.model_type, "model": model.describe(),
              "model_seconds": args.model_seconds, "encode_s": encode_s, "measure_s": measure_s, "rows": rows}
    path = args.json or results_path(ROOT / "benchmarks" / "results", env, "sampler-curve",
                                     f"-{model.model_type}" + ("-small" if args.small else ""))
    save_json(report, path)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    raise SystemExit(main())
