#!/usr/bin/env python3
"""The step size swept: bench_gpu.py's 64 x 4 job and its 8 distinct clips, each in one `classify` call, under
several token budgets per forward (`max_num_batched_tokens`) on one model in one process, budgets alternated
round by round so drift falls on all alike.

    python3 scripts/diag_step_size.py --model qwen3_vl --budgets 8192 16384 32768 --cupti --json F

Prints per model and budget the median wall time of each workload, its steps, and the ratio against the engine's
own budget (`auto`, measured in the same rounds); with --cupti, one more traced run of the job per budget: the GPU's
busy and idle time, the idle charged to the host's phase, and the kernels that took the most time."""
from __future__ import annotations

import argparse
import time

import numpy as np

from benchlib.ceilings import median
from benchlib.steps import step_timeline
from benchlib.workload import (add_job_diag_arguments, agreement, fresh, job_diag_engine, make_workload,
                               run_job_diag)

AUTO = "auto"


def timed_call(clf, requests, budget) -> tuple[float, int, list]:
    """One call under `budget`: (seconds, forward passes, results)."""
    clf.config.max_num_batched_tokens = budget
    with step_timeline(clf) as log:
        t0 = time.perf_counter()
        results = clf.classify(requests)
        seconds = time.perf_counter() - t0
    assert all(r.error is None for r in results), [r.error for r in results if r.error][:3]
    return seconds, len(log["forward_s"]), results


def traced(clf, requests, budget, kernels: int) -> dict:
    """One run under CUPTI: wall, GPU busy, idle by host phase, the `kernels` costliest kernels."""
    from benchlib.cupti import engine_phases, traced_idle

    clf.config.max_num_batched_tokens = budget
    (row,) = traced_idle(lambda: clf.classify(requests), engine_phases(clf, (clf, "classify")), kernels=kernels)
    return row


def run_model(model_type: str, args) -> dict:
    diag = job_diag_engine(model_type, args, "steps")
    clf = diag.bench.classifier
    auto_tokens = clf.max_num_batched_tokens
    rng = np.random.default_rng(0)
    workloads = {"job": make_workload(diag.bench, rng, args.clips, args.questions, diag.frames, diag.size, "j"),
                 "distinct8": make_workload(diag.bench, rng, 8, 1, diag.frames, diag.size, "d")}
    budgets = [AUTO] + [b for b in args.budgets if b != auto_tokens]
    seconds = {str(b): {w: [] for w in workloads} for b in budgets}
    steps: dict[str, dict[str, int]] = {str(b): {} for b in budgets}
    answers: dict[str, dict[str, list]] = {str(b): {} for b in budgets}
    for round_ in range(args.rounds + 1):   # round 0 warms every budget's shapes and is not counted
        order = budgets[round_ % len(budgets):] + budgets[:round_ % len(budgets)]
        for budget in order:
            for name, workload in workloads.items():
                s, n, results = timed_call(clf, fresh(workload, f"{budget}-{round_}"), budget)
                steps[str(budget)][name] = n
                answers[str(budget)].setdefault(name, results)
                if round_:
                    seconds[str(budget)][name].append(s)
    rows = []
    for budget in budgets:
        key = str(budget)
        row = {"budget": auto_tokens if budget == AUTO else budget, "auto": budget == AUTO}
        for name in workloads:
            s = median(seconds[key][name])
            base = median(seconds[AUTO][name])
            computed = sum(r.prompt_tokens - r.cached_tokens for r in answers[key][name])
            row[name] = {"seconds": seconds[key][name], "median_s": s, "steps": steps[key][name],
                         "computed_tokens": computed,
                         "auto_over_this": base / s, **agreement(answers[key][name], answers[AUTO][name])}
        if args.cupti:
            row["job_cupti"] = traced(clf, fresh(workloads["job"], f"{budget}-cupti"), budget, args.kernels)
        rows.append(row)
        print(f"[{model_type}] budget {row['budget']:>6}{' (auto)' if row['auto'] else '       '}: "
              + "; ".join(f"{n} {row[n]['median_s']:.3f} s in {row[n]['steps']} steps, "
                          f"{row[n]['auto_over_this']:.3f}x auto" for n in workloads)
              + (f"; traced: GPU busy {row['job_cupti']['gpu_busy_ms']:.0f} of {row['job_cupti']['wall_ms']:.0f} ms"
                 if args.cupti else ""), flush=True)
    clf.config.max_num_batched_tokens = AUTO
    return {"model_type": model_type, "layers": diag.bench.layers, "vision_layers": diag.bench.vision_layers,
            "auto_tokens": auto_tokens, "requests": {n: len(w) for n, w in workloads.items()}, "budgets": rows}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_job_diag_arguments(parser, rounds=3)
    parser.add_argument("--budgets", type=int, nargs="+", default=[4096, 8192, 12288, 16384, 24576, 32768])
    parser.add_argument("--cupti", action="store_true", help="one more traced job run per budget (torch.profiler)")
    parser.add_argument("--kernels", type=int, default=8, help="with --cupti: how many of the costliest kernels")
    run_job_diag(parser.parse_args(), run_model)


if __name__ == "__main__":
    main()
