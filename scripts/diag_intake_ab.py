#!/usr/bin/env python3
"""The 64 x 4 job of bench_gpu.py in one `classify` call, with the call's host work a step ahead of the device
(engine/intake.py, the engine as it is) against other forms of it, alternated on one model in one process:
`up_front`, every prompt built up front and each step starting its own towers (the engine before intake.py);
`at_queued`, the work ahead of a step done only once the pass before it is queued (the twenty-first session's);
`step_by_step`, each pass done and its logits read before the next step is scheduled (the twenty-second session's:
no pass queued behind the one before, `classifier.OVERLAP_PASSES`). The first two are step by step as well.

    python3 scripts/diag_intake_ab.py --model qwen2_5_vl qwen3_vl --against step_by_step at_queued --json F

Prints per model the median wall time of each variant, their ratios, and how far their answers agree (the same
prompts, scheduled alike; on a GPU in bf16, a pass's rows may round differently)."""
from __future__ import annotations

import argparse
import time
from contextlib import contextmanager, nullcontext
from unittest import mock

import numpy as np

from benchlib.ceilings import median
from benchlib.workload import (add_job_diag_arguments, agreement, fresh, job_diag_engine, make_workload,
                               run_job_diag)


def step_by_step():
    """The engine as it is, each pass done and read before the next step is scheduled."""
    from batchjob.engine import classifier

    return mock.patch.object(classifier, "OVERLAP_PASSES", False)


@contextmanager
def up_front():
    """The engine before intake.py: towers of the first step, then every prompt; no look-ahead (its first step's
    towers now include the clip the step's end cuts, which that engine left to the step)."""
    from batchjob.engine.intake import CallIntake, StepAhead

    def start_all(self):
        self.start_towers(self.budget)
        self.admit(float("inf"))

    # nothing ahead: every prompt is in, and no tower is started before the step that reads it
    with mock.patch.multiple(CallIntake, start=start_all, ahead=lambda self, batch: StepAhead(self, 0)), \
            step_by_step():
        yield


@contextmanager
def at_queued():
    """The twenty-first session's intake: two steps' prompts built before the first step, and the work ahead of
    each later step done once its pass is wholly queued, none at the waits between its layers."""
    from batchjob.engine.intake import ADMIT_STEPS, CallIntake, StepAhead

    ahead = CallIntake.ahead

    class QueuedOnly(StepAhead):
        def piece(self):
            return False

        def finish(self):
            while StepAhead.piece(self):
                pass

    def start_two(self):
        self.start_towers(self.budget)
        self.admit(ADMIT_STEPS * self.budget)

    def queued_only(self, batch):
        return QueuedOnly(self, ahead(self, batch).tower_budget)

    with mock.patch.multiple(CallIntake, start=start_two, ahead=queued_only), step_by_step():
        yield


VARIANTS = {"ahead": nullcontext, "step_by_step": step_by_step, "up_front": up_front, "at_queued": at_queued}


def run_model(model_type: str, args) -> dict:
    diag = job_diag_engine(model_type, args, "intake", args.max_num_batched_tokens)
    clf = diag.bench.classifier
    workload = make_workload(diag.bench, np.random.default_rng(0), args.clips, args.questions, diag.frames, diag.size,
                             "w")
    variants = ["ahead"] + [v for v in args.against if v != "ahead"]
    times: dict[str, list[float]] = {v: [] for v in variants}
    answers: dict[str, list] = {}
    for round_ in range(args.rounds + 1):   # round 0 warms every variant (kernels, shapes) and is not counted
        for variant in variants[round_ % len(variants):] + variants[:round_ % len(variants)]:
            requests = fresh(workload, f"{variant}{round_}")
            with VARIANTS[variant]():
                t0 = time.perf_counter()
                results = clf.classify(requests)
                seconds = time.perf_counter() - t0
            assert all(r.error is None for r in results), [r.error for r in results if r.error][:3]
            answers.setdefault(variant, results)
            if round_:
                times[variant].append(seconds)
    row = {"model_type": model_type, "layers": diag.bench.layers, "vision_layers": diag.bench.vision_layers,
           "requests": len(workload), "steps_tokens": clf.max_num_batched_tokens, "seconds": times,
           "ahead_s": median(times["ahead"])}
    summary = []
    for variant in variants[1:]:
        agree = agreement(answers["ahead"], answers[variant])
        same, prob_diff = agree["choices_agree"], agree["max_prob_diff"]
        row[f"{variant}_s"] = median(times[variant])
        row[f"{variant}_vs_ahead"] = row[f"{variant}_s"] / row["ahead_s"]
        if variant == variants[1]:   # the first comparison keeps the keys of earlier results files
            row["choices_agree"], row["max_prob_diff"] = same, prob_diff
        row[f"{variant}_choices_agree"], row[f"{variant}_max_prob_diff"] = same, prob_diff
        summary.append(f"{variant} {row[f'{variant}_s']:.3f} s = {row[f'{variant}_vs_ahead']:.3f}x ahead's "
                       f"(choices agree {same:.3f}, probabilities within {prob_diff:.2e})")
    print(f"[{model_type}] {len(workload)} requests: ahead {row['ahead_s']:.3f} s (medians of {args.rounds}); "
          + "; ".join(summary), flush=True)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_job_diag_arguments(parser, rounds=5)
    parser.add_argument("--against", nargs="+", default=["up_front"], choices=sorted(VARIANTS),
                        help="the variants timed against the engine as it is (`ahead`)")
    parser.add_argument("--max-num-batched-tokens", default="auto", type=lambda v: v if v == "auto" else int(v))
    run_job_diag(parser.parse_args(), run_model)


if __name__ == "__main__":
    main()
