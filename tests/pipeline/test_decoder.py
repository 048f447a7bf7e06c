"""The decode actor's work, in-process: decode, then the engine's input preparation, failures per clip."""
from __future__ import annotations


import numpy as np
import pytest

from batchjob.loaders import load_video
from batchjob.pipeline import actors


@pytest.fixture
def decoder_cls(monkeypatch):
    monkeypatch.setattr(actors, "_node_id", lambda: "node-under-test")   # no Ray here
    return actors.Decoder


class Recorder:
    """A preparer that records what it was given and returns a marked copy."""

    def __init__(self, fail_on: str | None = None, fail_warm_up: bool = False):
        self.fail_on, self.fail_warm_up, self.warm, self.seen = fail_on, fail_warm_up, False, []

    def warm_up(self):
        if self.fail_warm_up:
            raise ImportError("no transformers on this node")
        self.warm = True

    def __call__(self, frames, metadata):
        if self.fail_on and self.fail_on in (metadata.video_backend or "") + str(len(frames)):
            raise ValueError("aspect ratio too extreme")
        self.seen.append((frames.shape, list(metadata.frames_indices)))
        return {"prepared": frames[:, ::2, ::2].copy()}


def test_prepared_payload_replaces_frames(decoder_cls, synthetic, rng):
    manifest, clips = synthetic
    video = str(manifest.parent / "clips" / rng.choice(clips)["video"])
    frames, meta = load_video(video, backend="pyav_keyframes", num_frames=4)
    prep = Recorder()
    dec = decoder_cls("pyav_keyframes", 4, {}, prep)
    assert prep.warm
    status, payload = dec.decode(video)
    assert status.ok and status.node == "node-under-test"
    assert status.busy_ms >= status.decode_ms > 0
    assert status.frames_indices == [int(i) for i in meta["frames_indices"]]
    # vLLM's six keys in their fields, the loader's others kept aside
    assert status.metadata.standard().keys() == {"total_num_frames", "fps", "duration", "video_backend",
                                                  "frames_indices", "do_sample_frames"}
    assert status.metadata.as_dict().keys() == {k for k, v in meta.items() if v is not None}
    np.testing.assert_array_equal(payload["prepared"], frames[:, ::2, ::2])
    assert prep.seen == [(frames.shape, status.frames_indices)]


def test_preparation_failure_is_this_clips_error(decoder_cls, synthetic):
    manifest, clips = synthetic
    video = str(manifest.parent / "clips" / clips[0]["video"])
    dec = decoder_cls("pyav_keyframes", 3, {}, Recorder(fail_on="3"))
    status, payload = dec.decode(video)
    assert payload is None and not status.ok
    assert status.error.startswith("preparing the frames failed: ValueError: aspect ratio too extreme")
    status, payload = dec.decode(str(manifest.parent / "clips" / "missing.mp4"))
    assert payload is None and status.error.startswith("decode failed")


def test_unavailable_preparation_falls_back_to_frames(decoder_cls, synthetic):
    manifest, clips = synthetic
    video = str(manifest.parent / "clips" / clips[-1]["video"])
    dec = decoder_cls("pyav_keyframes", 2, {}, Recorder(fail_warm_up=True))
    status, payload = dec.decode(video)
    frames, _ = load_video(video, backend="pyav_keyframes", num_frames=2)
    assert status.ok and dec.prepare is None
    np.testing.assert_array_equal(payload, frames)
