"""Where an engine run's wall time goes, step by step: each scheduler step's forward (the device work, its
final sync included), the host time building the step's vision graphs, and what neither covers (scheduling,
results, Python between steps). Patches the classifier module's `forward` and the instance's `_video_rows`
for the duration of a `with` block only.

`between_steps_host_s` is the part of the rest during which the device has nothing queued: from the end of a
step's forward (which waits for all work queued before it) to the start of the next step's vision graphs."""
from __future__ import annotations

import time
from contextlib import contextmanager


@contextmanager
def step_timeline(clf):
    """Yields a dict filled while the block runs: per step `tokens`, `seqs`, `forward_s`, `vision_host_s`."""
    from batchjob.engine import classifier as classifier_module

    log: dict = {"tokens": [], "seqs": [], "forward_s": [], "vision_host_s": [], "forward_end": [], "rows_start": []}
    real_forward, real_rows = classifier_module.forward, clf._video_rows

    def forward(model, batch, *a, **k):
        t0 = time.perf_counter()
        out = real_forward(model, batch, *a, **k)
        end = time.perf_counter()
        log["forward_s"].append(end - t0)
        log["forward_end"].append(end)
        log["tokens"].append(sum(s.num_new for s in batch))
        log["seqs"].append(len(batch))
        return out

    def video_rows(*a, **k):
        t0 = time.perf_counter()
        log["rows_start"].append(t0)
        out = real_rows(*a, **k)
        log["vision_host_s"].append(time.perf_counter() - t0)
        return out

    classifier_module.forward, clf._video_rows = forward, video_rows
    try:
        yield log
    finally:
        classifier_module.forward = real_forward
        del clf._video_rows   # the instance attribute goes; the method shows through again


def summarize_steps(log: dict, wall_s: float) -> dict:
    """Totals of one run's timeline (`step_timeline`) against its wall time."""
    forward, vision = sum(log["forward_s"]), sum(log["vision_host_s"])
    between = [start - end for end, start in zip(log["forward_end"], log["rows_start"][1:])]
    return {"steps": len(log["forward_s"]), "wall_s": wall_s, "forward_s": forward, "vision_graph_host_s": vision,
            "other_host_s": wall_s - forward - vision, "between_steps_host_s": sum(between),
            "between_steps_host_s_per_step": [round(x, 4) for x in between], "tokens_per_step": log["tokens"],
            "seqs_per_step": log["seqs"], "forward_s_per_step": [round(x, 4) for x in log["forward_s"]]}
