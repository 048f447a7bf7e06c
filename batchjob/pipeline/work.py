"""Pure logic of the pipeline: what a unit of work is and how results become output rows.

Kept free of Ray and of the engine so it can be tested with plain data.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from datetime import datetime
from collections import deque
from typing import Any, Sequence

from batchjob.datasets import Row


@dataclass(frozen=True)
class Answer:
    """What an engine returns for one question (the pipeline's view of engine.ClassifyResult)."""
    row_id: str
    choice: int | None
    probs: list[float]
    prompt_tokens: int = 0
    cached_tokens: int = 0
    error: str | None = None


@dataclass
class ClipWork:
    """One clip and every question about it: decoded once, classified in one engine call."""
    video: str
    media_id: str
    rows: list[Row]
    attempts: int = 0                      # decode attempts (an actor crash retries once)
    decode: dict[str, Any] = field(default_factory=dict)   # status from the decode actor
    solo: bool = False                     # its multi-clip engine batch failed: retry it alone to find the culprit

    def questions(self) -> list[tuple[str, str, tuple[str, ...]]]:
        return [(r.row_id, r.question, r.options) for r in self.rows]


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
    groups: dict[str, ClipWork] = {}
    for r in rows:
        if r.row_id in skip:
            continue
        if r.video not in groups:
            groups[r.video] = ClipWork(r.video, media_id(r.video, loader, num_frames, loader_kwargs), [])
        groups[r.video].rows.append(r)
    return list(groups.values())


def result_row(row: Row, answer: Answer | None, *, labels: Sequence[str], loader: str, num_frames: int,
               decode: dict[str, Any], engine_ms: float | None, model: str, run_id: str,
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
        "correct": None if row.answer is None else (choice == row.answer),
        "loader": loader, "num_frames": num_frames,
        "frame_indices": decode.get("frames_indices"), "decode_ms": decode.get("decode_ms"),
        "engine_ms": engine_ms,
        "prompt_tokens": answer.prompt_tokens if answer and not err else None,
        "cached_tokens": answer.cached_tokens if answer and not err else None,
        "error": err, "model": model, "decode_node": decode.get("node"),
        "run_id": run_id, "run_started_at": run_started_at, "finished_at": finished_at,
    }
