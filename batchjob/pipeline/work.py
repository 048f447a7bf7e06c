"""Pure logic of the pipeline: what a unit of work is and how results become output rows.

Kept free of Ray and of the engine so it can be tested with plain data.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import datetime
from collections import deque
from typing import Any, Sequence

from batchjob.contract import Answer, ClipJob, DecodeStatus, Question
from batchjob.datasets import Row


@dataclass
class ClipWork:
    """The driver's bookkeeping for one clip (never leaves the driver): its job, its dataset rows, and how
    its decode went. What crosses to actors is `job` and, from them, the frozen `DecodeStatus`."""
    job: ClipJob
    rows: list[Row]
    attempts: int = 0                      # decode attempts (an actor crash retries once)
    status: DecodeStatus | None = None     # from the decode actor; None until it reports (or when it died)
    timed_out: bool = False                # killed by the driver's decode timeout
    solo: bool = False                     # its multi-clip engine batch failed: retry it alone to find the culprit

    @property
    def video(self) -> str:
        return self.job.video

    @property
    def media_id(self) -> str:
        return self.job.media_id


def take_batch(decoded: deque, clips_per_batch: int) -> list:
    """The next engine batch from the front of `decoded` (pairs whose first item is a ClipWork).

    Up to `clips_per_batch` clips, so their questions pack into one call; but a clip marked solo (its
    multi-clip batch failed) goes alone and no batch takes one along, so a clip that always makes the
    engine fail is isolated instead of resubmitted with the same companions forever.
    """
    batch = [decoded.popleft()]
    while (not batch[0][0].solo and len(batch) < clips_per_batch and decoded
           and not decoded[0][0].solo):
        batch.append(decoded.popleft())
    return batch


def media_id(video: str, loader: str, num_frames: int, loader_kwargs: dict[str, Any]) -> str:
    """Identity of a decoded clip: the same file decoded another way is different media for the KV cache."""
    return f"{video}|{loader}|{num_frames}|{json.dumps(loader_kwargs, sort_keys=True, default=str)}"


def group_by_clip(rows: Sequence[Row], skip: set[str], loader: str, num_frames: int,
                  loader_kwargs: dict[str, Any]) -> list[ClipWork]:
    """Pending rows grouped by video, in first-appearance order, so every clip is decoded once."""
    groups: dict[str, list[Row]] = {}
    for r in rows:
        if r.row_id not in skip:
            groups.setdefault(r.video, []).append(r)
    return [ClipWork(ClipJob(video, media_id(video, loader, num_frames, loader_kwargs),
                             tuple(Question(r.row_id, r.question, tuple(r.options)) for r in group)), group)
            for video, group in groups.items()]


def score(choice: int | None, answer: int | None) -> bool | None:
    """Whether a prediction is correct: None when the dataset has no answer; a missing prediction (an error
    row) is wrong, so lost clips never flatter the accuracy."""
    return None if answer is None else choice == answer


def result_row(row: Row, answer: Answer | None, *, labels: Sequence[str], loader: str, num_frames: int,
               decode: DecodeStatus | None, engine_ms: float | None, model: str, run_id: str,
               run_started_at: datetime, finished_at: datetime, error: str | None = None) -> dict[str, Any]:
    """One output row. An error (decode or engine) leaves the prediction null and counts as incorrect."""
    err = error or (answer.error if answer else "no answer from engine")
    choice = None if err else answer.choice
    if choice is not None and not 0 <= choice < len(row.options):
        err, choice = f"engine returned option {choice} for {len(row.options)} options", None
    return {
        "row_id": row.row_id, "video": row.video, "question": row.question, "options": list(row.options),
        "answer": row.answer, "category": row.category,
        "pred_index": choice, "pred_letter": labels[choice] if choice is not None else None,
        "probs": list(answer.probs) if answer and not err else None,
        "correct": score(choice, row.answer),
        "loader": loader, "num_frames": num_frames,
        "frame_indices": decode.frames_indices if decode else None, "decode_ms": decode.decode_ms if decode else None,
        "engine_ms": engine_ms,
        "prompt_tokens": answer.prompt_tokens if answer and not err else None,
        "cached_tokens": answer.cached_tokens if answer and not err else None,
        "error": err, "model": model, "decode_node": decode.node if decode else None,
        "run_id": run_id, "run_started_at": run_started_at, "finished_at": finished_at,
    }
