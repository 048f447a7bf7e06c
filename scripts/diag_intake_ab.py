#!/usr/bin/env python3
"""The 64 x 4 job of bench_gpu.py in one `classify` call, with the call's host work a step ahead of the device
(engine/intake.py, the engine as it is) against the same engine with every prompt built up front and each step
starting its own towers (the engine before intake.py), alternated on one model in one process.

    python3 scripts/diag_intake_ab.py --model qwen2_5_vl qwen3_vl --layers 28 --vision-layers 32 --json F

Prints per model the median wall time of each variant, their ratio, and how far their answers agree (the same
prompts, scheduled alike; on a GPU in bf16, a pass's rows may round differently)."""
from __future__ import annotations

import argparse
import json
import time
from contextlib import contextmanager, nullcontext
from pathlib import Path

import numpy as np

import benchlib.env
from benchlib.ceilings import median
from benchlib.workload import diag_engine, fresh, make_workload
from batchjob.synthetic.random_engine import SHAPES


@contextmanager
def up_front():
    """The engine before intake.py: towers of the first step, then every prompt; no look-ahead (its first step's
    towers now include the clip the step's end cuts, which that engine left to the step)."""
    from batchjob.engine.intake import CallIntake

    start, look_ahead = CallIntake.start, CallIntake.look_ahead

    def start_all(self):
        self.start_towers(self.budget)
        self.admit(float("inf"))

    CallIntake.start, CallIntake.look_ahead = start_all, lambda self, batch: None
    try:
        yield
    finally:
        CallIntake.start, CallIntake.look_ahead = start, look_ahead


def run_model(model_type: str, args) -> dict:
    qwen3 = model_type == "qwen3_vl"
    diag = diag_engine(model_type, smoke=args.smoke, layers=args.qwen3_layers if qwen3 else args.layers,
                       vision_layers=args.qwen3_vision_layers if qwen3 else args.vision_layers, buckets=None,
                       tag="intake", max_num_batched_tokens=args.max_num_batched_tokens)
    clf = diag.bench.classifier
    workload = make_workload(diag.bench, np.random.default_rng(0), args.clips, args.questions, diag.frames, diag.size,
                             "w")
    times: dict[str, list[float]] = {"ahead": [], "up_front": []}
    answers: dict[str, list] = {}
    for round_ in range(args.rounds + 1):   # round 0 warms both variants (kernels, shapes) and is not counted
        for variant in ("ahead", "up_front") if round_ % 2 else ("up_front", "ahead"):
            requests = fresh(workload, f"{variant}{round_}")
            with up_front() if variant == "up_front" else nullcontext():
                t0 = time.perf_counter()
                results = clf.classify(requests)
                seconds = time.perf_counter() - t0
            assert all(r.error is None for r in results), [r.error for r in results if r.error][:3]
            answers.setdefault(variant, results)
            if round_:
                times[variant].append(seconds)
    pairs = list(zip(answers["ahead"], answers["up_front"]))
    same = float(np.mean([a.choice == b.choice for a, b in pairs]))
    prob_diff = max(float(np.max(np.abs(np.subtract(a.probs, b.probs)))) for a, b in pairs)
    row = {"model_type": model_type, "layers": diag.bench.layers, "vision_layers": diag.bench.vision_layers,
           "requests": len(workload), "steps_tokens": clf.max_num_batched_tokens, "seconds": times,
           "choices_agree": same, "max_prob_diff": prob_diff, "ahead_s": median(times["ahead"]),
           "up_front_s": median(times["up_front"])}
    row["up_front_vs_ahead"] = row["up_front_s"] / row["ahead_s"]
    print(f"[{model_type}] {len(workload)} requests: ahead {row['ahead_s']:.3f} s, up front {row['up_front_s']:.3f} s "
          f"(medians of {args.rounds}): the look-ahead {row['up_front_vs_ahead']:.3f}x; choices agree {same:.3f}, "
          f"probabilities within {prob_diff:.2e}", flush=True)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", nargs="+", default=["qwen2_5_vl"], choices=sorted(SHAPES))
    parser.add_argument("--layers", type=int)
    parser.add_argument("--vision-layers", type=int)
    parser.add_argument("--qwen3-layers", type=int)
    parser.add_argument("--qwen3-vision-layers", type=int)
    parser.add_argument("--clips", type=int, default=64)
    parser.add_argument("--questions", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--max-num-batched-tokens", default="auto", type=lambda v: v if v == "auto" else int(v))
    parser.add_argument("--json")
    parser.add_argument("--smoke", action="store_true", help="tiny dims, fp32, 4 frames at 56x56, on any device")
    args = parser.parse_args()
    report = {"environment": benchlib.env.environment(("mlx.core",)), "args": vars(args), "models": []}
    for model_type in args.model:
        report["models"].append(run_model(model_type, args))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
