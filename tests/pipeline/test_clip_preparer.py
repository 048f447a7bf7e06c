"""The MLX engine's decoder-side preparation: what the driver ships to decoders and what they make."""
from __future__ import annotations

import pickle

import numpy as np
import pytest

from batchjob.config import ModelConfig
from batchjob.engine import load_vision_settings, preprocess_video
from batchjob.engine.patchify import normalize_bytes, normalize_table
from batchjob.contract import ClipMetadata
from batchjob.pipeline import engines
from batchjob.pipeline.engines import input_preparer as clip_preparer
from batchjob.pipeline.mlx_engine import MlxClipPreparer
from batchjob.synthetic.tiny_model import write_tiny_checkpoint


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return write_tiny_checkpoint(tmp_path_factory.mktemp("tiny"))


def test_preparer_uses_the_checkpoints_settings_and_overrides(checkpoint, np_rng):
    rng = np_rng
    max_pixels = 28 * 28 * int(rng.integers(4, 30))
    prep = clip_preparer(ModelConfig(checkpoint=str(checkpoint), max_pixels=max_pixels))
    assert isinstance(prep, MlxClipPreparer)
    assert prep.settings == load_vision_settings(checkpoint, None, max_pixels)
    frames = rng.integers(0, 256, (int(rng.integers(1, 6)), int(rng.integers(40, 200)), int(rng.integers(40, 200)), 3),
                          dtype=np.uint8)
    meta = {"fps": 30.0, "frames_indices": list(range(0, 10 * len(frames), 10))}
    shipped = pickle.loads(pickle.dumps(prep))           # what a decoder receives
    assert shipped.settings == prep.settings
    shipped.warm_up()
    made, expected = shipped(frames, ClipMetadata.from_loader(meta)), preprocess_video(frames, meta, prep.settings)
    assert made.grid_thw == expected.grid_thw and made.settings == expected.settings
    assert made.pixel_values.dtype == np.uint8          # patch bytes: the engine normalises them on its device
    table = normalize_table(prep.settings.image_mean, prep.settings.image_std)
    np.testing.assert_array_equal(normalize_bytes(made.pixel_values, table), expected.pixel_values)


def test_preparer_carries_the_temporal_step_rule(checkpoint):
    """Decoders must plan the clip's temporal step with the job's rule, or their inputs would disagree with
    the engine's (which rejects inputs made with other settings)."""
    meta = {"fps": 30.0, "frames_indices": [0, 10, 40, 90], "total_num_frames": 300}
    frames = np.zeros((4, 56, 56, 3), np.uint8)
    steps = {}
    for rule in ("nominal", "actual"):
        prep = clip_preparer(ModelConfig(checkpoint=str(checkpoint), temporal_step=rule))
        assert prep.settings == load_vision_settings(checkpoint, None, None, rule)
        steps[rule] = prep(frames, ClipMetadata.from_loader(meta)).second_per_grid_t
    assert steps["nominal"] == pytest.approx(2 / (4 / 300 * 30.0))
    assert steps["actual"] == pytest.approx(2 / (3 * 30.0 / 90))


def test_no_preparer_when_the_engine_must_find_the_checkpoint_itself(checkpoint, tmp_path, monkeypatch):
    assert clip_preparer(ModelConfig(checkpoint="Qwen/Qwen2.5-VL-7B-Instruct")) is None   # a hub id
    bare = tmp_path / "no-processor"
    bare.mkdir()
    (bare / "config.json").write_text((checkpoint / "config.json").read_text())
    assert clip_preparer(ModelConfig(checkpoint=str(bare))) is None   # the engine's load reports it
    monkeypatch.setitem(engines.ENGINES, "frames-only", "batchjob.contract:EngineBase")   # offers no preparer
    assert clip_preparer(ModelConfig(checkpoint=str(checkpoint), engine="frames-only")) is None


@pytest.mark.parametrize("timestamps", ["actual", "nominal"])
def test_preparer_settings_equal_the_engines(checkpoint, timestamps):
    """Whatever the job's timestamps rule (used by Qwen3-VL only), decoder-side settings equal the engine's,
    or every prepared clip would be refused."""
    import json

    from batchjob.engine import EngineConfig
    from batchjob.engine.families import family_for

    prep = clip_preparer(ModelConfig(checkpoint=str(checkpoint), timestamps=timestamps, temporal_step="actual"))
    family = family_for(json.loads((checkpoint / "config.json").read_text()), checkpoint)
    assert prep.settings == family.vision_settings(EngineConfig(timestamps=timestamps, temporal_step="actual"))


DECODER = """
import json, sys
import numpy as np
from batchjob.config import ModelConfig
from batchjob.pipeline import actors
from batchjob.pipeline.engines import input_preparer
actors._node_id = lambda: "test"          # the Decoder class as Ray runs it, minus Ray
decoder = actors.Decoder("pyav_keyframes", 4, {}, input_preparer(ModelConfig(checkpoint=sys.argv[1], max_pixels=28 * 28 * 8)))
status, payload = decoder.decode(sys.argv[2])
np.save(sys.argv[3], payload.pixel_values)
hwm = next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith("VmHWM"))
print(json.dumps({"ok": status.ok, "error": status.error, "prepared": decoder.prepare is not None,
                  "grid": list(payload.grid_thw), "torch": "torch" in sys.modules,
                  "transformers": "transformers" in sys.modules, "vmhwm_mb": hwm / 1024}))
"""


def _decoder_process(checkpoint, clip, out, resize=None) -> dict:
    import json
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "BATCHJOB_RESIZE"}
    if resize:
        env["BATCHJOB_RESIZE"] = resize
    proc = subprocess.run([sys.executable, "-c", DECODER, str(checkpoint), str(clip), str(out)], capture_output=True,
                          text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["ok"] and result["prepared"], result
    return result


def test_decoders_import_neither_torch_nor_transformers(checkpoint, tmp_path, rng):
    """A decoder (fresh process, as Ray starts one) with the MLX engine's preparer decodes and prepares a clip
    without importing torch or transformers, and its pixel values are those of PyTorch's resize, which
    `BATCHJOB_RESIZE=torch` still selects where torch is installed."""
    from batchjob.synthetic.clips import make_clip

    clip = tmp_path / "clip.mp4"
    make_clip(clip, width=320, height=240, seconds=2.0, pattern="motion", seed=rng.randrange(1000))
    plain = _decoder_process(checkpoint, clip, tmp_path / "numpy.npy")
    assert not plain["torch"] and not plain["transformers"], plain
    assert plain["grid"][1] * 14 < 240                                   # it did resize
    pytest.importorskip("torch")
    with_torch = _decoder_process(checkpoint, clip, tmp_path / "torch.npy", resize="torch")
    assert with_torch["torch"] and not with_torch["transformers"], with_torch
    np.testing.assert_array_equal(np.load(tmp_path / "numpy.npy"), np.load(tmp_path / "torch.npy"))
