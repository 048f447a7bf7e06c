"""The MLX engine's decoder-side preparation: what the driver ships to decoders and what they make."""
from __future__ import annotations

import pickle

import numpy as np
import pytest

from batchjob.config import ModelConfig
from batchjob.engine import load_vision_settings, preprocess_video
from batchjob.pipeline import engines
from batchjob.pipeline.engines import MlxClipPreparer, clip_preparer
from batchjob.synthetic.tiny_model import write_tiny_checkpoint


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return write_tiny_checkpoint(tmp_path_factory.mktemp("tiny"))


def test_preparer_uses_the_checkpoints_settings_and_overrides(checkpoint):
    rng = np.random.default_rng()
    max_pixels = 28 * 28 * int(rng.integers(4, 30))
    prep = clip_preparer(ModelConfig(checkpoint=str(checkpoint), max_pixels=max_pixels))
    assert isinstance(prep, MlxClipPreparer)
    assert prep.settings == load_vision_settings(checkpoint, None, max_pixels)
    frames = rng.integers(0, 256, (int(rng.integers(1, 6)), int(rng.integers(40, 200)), int(rng.integers(40, 200)), 3),
                          dtype=np.uint8)
    meta = {"fps": 30.0, "frames_indices": list(range(0, 10 * len(frames), 10))}
    shipped = pickle.loads(pickle.dumps(prep))           # what a decoder receives: settings, no processor
    assert shipped._processor is None and shipped.settings == prep.settings
    made, expected = shipped(frames, meta), preprocess_video(frames, meta, prep.settings)
    assert made.grid_thw == expected.grid_thw and made.settings == expected.settings
    np.testing.assert_array_equal(made.pixel_values, expected.pixel_values)
    assert pickle.loads(pickle.dumps(shipped))._processor is None   # never pickles the processor


def test_preparer_carries_the_temporal_step_rule(checkpoint):
    """Decoders must plan the clip's temporal step with the job's rule, or their inputs would disagree with
    the engine's (which rejects inputs made with other settings)."""
    meta = {"fps": 30.0, "frames_indices": [0, 10, 40, 90], "total_num_frames": 300}
    frames = np.zeros((4, 56, 56, 3), np.uint8)
    steps = {}
    for rule in ("nominal", "actual"):
        prep = clip_preparer(ModelConfig(checkpoint=str(checkpoint), temporal_step=rule))
        assert prep.settings == load_vision_settings(checkpoint, None, None, rule)
        steps[rule] = prep(frames, meta).second_per_grid_t
    assert steps["nominal"] == pytest.approx(2 / (4 / 300 * 30.0))
    assert steps["actual"] == pytest.approx(2 / (3 * 30.0 / 90))


def test_no_preparer_when_the_engine_must_find_the_checkpoint_itself(checkpoint, tmp_path, monkeypatch):
    assert clip_preparer(ModelConfig(checkpoint="Qwen/Qwen2.5-VL-7B-Instruct")) is None   # a hub id
    bare = tmp_path / "no-processor"
    bare.mkdir()
    (bare / "config.json").write_text((checkpoint / "config.json").read_text())
    assert clip_preparer(ModelConfig(checkpoint=str(bare))) is None   # the engine's load reports it
    monkeypatch.setitem(engines.ENGINES, "frames-only", lambda model, prompt: None)   # offers no preparer
    assert clip_preparer(ModelConfig(checkpoint=str(checkpoint), engine="frames-only")) is None
