"""A test engine plugin (`model.engine: canary_faults:FaultyMlxEngine`): the MLX engine, fed frames that went
wrong on their way from the file, for the accuracy canary (tests/pipeline/test_demo_canary.py).

The fault is named by the clip's folder (`clean/`, `reversed/`, `channels/`, `shuffled/`), so one job (one Ray
start, one model load) answers the same questions through every fault. The engine prepares clips itself
(no decoder-side preparation), so the fault is applied to the decoded frames, before preprocessing.
"""
from __future__ import annotations

import dataclasses
import zlib
from pathlib import Path

import numpy as np

from batchjob.pipeline.mlx_engine import MlxEngine

FAULTS = ("clean", "reversed", "channels", "shuffled")


def apply_fault(fault: str, frames: np.ndarray, seed: int) -> np.ndarray:
    """The frames as a broken decoder or loader would hand them over (metadata unchanged)."""
    if fault == "clean":
        return frames
    if fault == "reversed":          # time runs backwards
        return frames[::-1]
    if fault == "channels":          # RGB read as BGR
        return frames[..., ::-1]
    if fault == "shuffled":          # frames out of order (their timestamps then lie)
        order = np.random.default_rng(seed).permutation(len(frames))
        return frames[order]
    raise ValueError(f"unknown fault {fault!r}")


class FaultyMlxEngine(MlxEngine):
    @classmethod
    def input_preparer(cls, model):
        return None                  # frames reach answer(): the fault goes in before preprocessing

    def answer(self, clips):
        faulty = []
        for c in clips:
            fault = Path(c.job.video).parent.name
            frames = apply_fault(fault, np.asarray(c.payload), zlib.crc32(c.job.video.encode()))
            faulty.append(dataclasses.replace(c, payload=np.ascontiguousarray(frames)))
        return super().answer(faulty)
