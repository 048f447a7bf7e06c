#!/usr/bin/env python
"""Diagnostic: what reaching a frame d pictures after a keyframe costs, with every picture decoded and with
non-reference pictures skipped (`skip_frame = "NONREF"`), on the sampler curve's 720p single-keyframe scenes.

    scripts/diag_decode_cost.py                       # the README's figures (encodes one scene if not cached)
    scripts/diag_decode_cost.py --reach 0 3 36 120 --repeats 7

Why: a burst loader's budget is counted in pictures decoded. This measures one thread decoding forward from
the clip's keyframe until frame d has been fed (then drained), as `batchjob.loaders.decode.decode_run` does:
milliseconds (median of --repeats, ratio to the full decode of the same reach) and pictures that came out.
Not a loader benchmark (no seek, no colour conversion); the sampler curve measures the loaders.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def decode_to(path: str, reach: int, skip: str | None) -> tuple[float, int]:
    """(ms, pictures out) to decode from the first packet until the packet of presentation frame `reach` is sent."""
    import av

    with av.open(path) as container:
        stream = container.streams.video[0]
        codec = stream.codec_context
        codec.thread_count = 1
        if skip:
            codec.skip_frame = skip
        step = 1 / (stream.average_rate * stream.time_base)   # time-base ticks per frame
        out = 0
        start = time.perf_counter()
        for packet in container.demux(stream):
            out += len(codec.decode(packet))
            if packet.pts is not None and round(packet.pts / step) == reach:
                break
        out += len(codec.decode(None))
        return (time.perf_counter() - start) * 1000, out


def main(argv: list[str] | None = None) -> int:
    sys.path.insert(0, str(ROOT / "scripts"))
    from benchlib.ceilings import median
    from benchlib.demo_models import add_model_type_argument, demo_model
    from benchlib.env import environment, results_path, save_json
    from benchlib.scene_gops import SINGLE, ScenePlan, build_scene_set

    from batchjob.cache_home import cache_home

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_model_type_argument(parser)   # whose scenes (the motion they are drawn with)
    parser.add_argument("--reach", type=int, nargs="+", default=[0, 3, 36, 120, 240])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--cache", type=Path, default=cache_home() / "sampler_clips")
    parser.add_argument("--json", type=Path, help="results file (default benchmarks/results/diag-decode-cost-...)")
    args = parser.parse_args(argv)
    if args.repeats < 1 or min(args.reach) < 0:
        parser.error("--repeats must be >= 1 and --reach values >= 0")

    model = demo_model(args.model_type)
    plan = ScenePlan(1280, 720, 12.0, 24, (SINGLE,), 0)
    if max(args.reach) >= plan.seconds * plan.fps:
        parser.error(f"--reach must stay below the clip's {plan.seconds * plan.fps:g} frames")
    record = build_scene_set(args.cache, plan, 1, motion=model.motion)[0]
    path = str(args.cache / record["video"])
    rows = []
    for reach in args.reach:
        row = {"reach": reach}
        for skip in (None, "NONREF"):
            decode_to(path, reach, skip)   # warm the file cache
            runs = [decode_to(path, reach, skip) for _ in range(args.repeats)]
            row[skip or "all"] = {"ms": median([ms for ms, _ in runs]), "pictures": runs[0][1]}
        row["nonref_vs_all"] = row["NONREF"]["ms"] / row["all"]["ms"]
        rows.append(row)
    print(f"{record['video']} (scene drawn for the {model.model_type} demo model); one thread, "
          f"median of {args.repeats}")
    print("| reach (frames after the keyframe) | all pictures: ms | pictures | NONREF skipped: ms | pictures "
          "| NONREF vs all |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['reach']} | {r['all']['ms']:.1f} | {r['all']['pictures']} | {r['NONREF']['ms']:.1f} | "
              f"{r['NONREF']['pictures']} | {r['nonref_vs_all']:.2f}x |")
    env = environment(("av",))
    report = {"benchmark": "diag_decode_cost", **env, "clip": record["video"], "model_type": model.model_type,
              "repeats": args.repeats, "rows": rows}
    out = args.json or results_path(ROOT / "benchmarks" / "results", env, "diag-decode-cost")
    save_json(report, out)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    raise SystemExit(main())
