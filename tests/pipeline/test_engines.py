"""The engine registry and contract: plugins are checked against `Engine`, built-ins resolve lazily."""
from __future__ import annotations

import pickle
import sys
import types

import numpy as np
import pytest

from batchjob.config import ConfigError
from batchjob.contract import Answer, ClipJob, ClipMetadata, DecodeStatus, EngineBase, EngineClip, Question
from batchjob.pipeline.engines import resolve_engine


class NotAnEngine:
    def __init__(self, model, prompt):
        pass

    def answer(self, clips):
        return []


def test_plugins_must_implement_the_contract(monkeypatch):
    mod = types.ModuleType("site_engines")
    mod.NotAnEngine, mod.Good = NotAnEngine, type("Good", (EngineBase,), {})
    monkeypatch.setitem(sys.modules, "site_engines", mod)
    with pytest.raises(ConfigError, match=r"missing: load, input_preparer, check, describe, hides_torch"):
        resolve_engine("site_engines:NotAnEngine")
    assert resolve_engine("site_engines:Good") is mod.Good
    with pytest.raises(ConfigError, match="unknown engine 'tensorrt'; valid: mlx, vllm"):
        resolve_engine("tensorrt")
    with pytest.raises(ConfigError, match="cannot import engine 'nowhere:Engine'"):
        resolve_engine("nowhere:Engine")


def test_contract_values_survive_pickling_and_keep_vllms_keys_apart():
    raw = {"fps": np.float64(29.97), "total_num_frames": np.int64(300), "frames_indices": np.arange(0, 300, 75),
           "duration": 10.01, "video_backend": "pyav_keyframes", "do_sample_frames": False,
           "keyframe_source": "index", "rotation": 90}
    meta = ClipMetadata.from_loader(raw)
    assert meta.standard() == {"fps": 29.97, "total_num_frames": 300, "frames_indices": [0, 75, 150, 225],
                               "duration": 10.01, "video_backend": "pyav_keyframes", "do_sample_frames": False}
    assert meta.extra == {"keyframe_source": "index", "rotation": 90}
    assert meta.as_dict() == {**{k: v.tolist() if hasattr(v, "tolist") else v for k, v in raw.items()}}
    job = ClipJob("v.mp4", "v|m", (Question("r1", "q?", ("a", "b")),))
    for value in (meta, job, DecodeStatus("n", 1.0, 2.0, meta), EngineClip(job, meta, np.zeros((1, 2, 2, 3), np.uint8)),
                  Answer("r1", 1, [0.25, 0.75], 10, 4)):
        back = pickle.loads(pickle.dumps(value))
        assert type(back) is type(value) and repr(back) == repr(value)
    assert Answer("r", 0, [1.0]).probs == (1.0,)          # probabilities become a tuple: answers are frozen
    with pytest.raises(AttributeError):
        job.video = "other.mp4"
