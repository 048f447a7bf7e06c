"""The registry, the public entry point, and the bridge into vLLM's registry."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import types

import numpy as np
import pytest

import batchjob.loaders.vllm_bridge as bridge
from batchjob.loaders import VIDEO_LOADER_REGISTRY, InvalidArgument, get_loader, list_loaders, load_video
from batchjob.loaders.registry import VideoLoaderRegistry


def test_builtin_loaders_are_listed():
    assert {"pyav_keyframes", "pyav_adaptive", "pyav_burst", "opencv"} <= set(list_loaders())
    assert get_loader("pyav_keyframes") is VIDEO_LOADER_REGISTRY.load("pyav_keyframes")


def test_importing_the_module_registers_it():
    """The use case "import our loader into your own code": a fresh interpreter, one import."""
    code = ("import batchjob.loaders.pyav_keyframes as m; from batchjob.loaders import VIDEO_LOADER_REGISTRY as r; "
            "assert r.load('pyav_keyframes') is m.PyAVKeyframeLoader; print('ok')")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr


def test_register_decorator_and_errors():
    registry = VideoLoaderRegistry()

    @registry.register("fake")
    class Fake:
        @classmethod
        def load_bytes(cls, data, *, num_frames, **kwargs):
            return np.zeros((num_frames, 2, 2, 3), np.uint8), {"n": num_frames}

        @classmethod
        def load_path(cls, path, *, num_frames, **kwargs):
            return cls.load_bytes(b"", num_frames=num_frames)

    assert registry.load("fake") is Fake and registry.names() == ["fake"] and "fake" in registry
    with pytest.raises(InvalidArgument, match="fake"):
        registry.load("missing")
    with pytest.raises(TypeError, match="load_path"):
        @registry.register("half")
        class Half:
            @classmethod
            def load_bytes(cls, data, **kwargs):
                return None


def _fake_vllm(monkeypatch):
    """A stand-in for vllm.multimodal.video with the same registry shape (vLLM is not in .venv)."""
    video = types.ModuleType("vllm.multimodal.video")

    class VideoLoader:
        pass

    class Registry:
        def __init__(self):
            self.loaders = {}

        def register(self, name):
            def wrap(cls):
                assert issubclass(cls, VideoLoader)
                self.loaders[name] = cls
                return cls
            return wrap

    video.VideoLoader, video.VIDEO_LOADER_REGISTRY = VideoLoader, Registry()
    vllm = types.ModuleType("vllm")
    multimodal = types.ModuleType("vllm.multimodal")
    vllm.multimodal, multimodal.video = multimodal, video
    monkeypatch.setitem(sys.modules, "vllm", vllm)
    monkeypatch.setitem(sys.modules, "vllm.multimodal", multimodal)
    monkeypatch.setitem(sys.modules, "vllm.multimodal.video", video)
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: object() if name == "vllm" else None)
    return video


def test_bridge_serves_vllm_calls(monkeypatch, clips):
    from batchjob.loaders.pyav_keyframes import PyAVKeyframeLoader

    video = _fake_vllm(monkeypatch)
    assert bridge.register_with_vllm("pyav_keyframes", PyAVKeyframeLoader)
    path, _ = clips("h264_bframes_mp4")
    data = open(path, "rb").read()
    loader = video.VIDEO_LOADER_REGISTRY.loaders["pyav_keyframes"]
    frames, meta = loader.load_bytes(data, num_frames=6, video_backend="pyav_keyframes", fps=2, max_duration=300)
    expected, expected_meta = load_video(path, num_frames=6, fps=2)
    np.testing.assert_array_equal(frames, expected)
    assert meta == {key: expected_meta[key] for key in bridge.VLLM_METADATA_KEYS}
    assert len(frames) == 6 and "keyframe_source" in expected_meta and "keyframe_source" not in meta
    frames, meta = loader.load_bytes(data)  # vLLM's default num_frames=-1: every keyframe here
    assert meta["frames_indices"] == load_video(path, num_frames=-1)[1]["frames_indices"]
    assert len(frames) == 4  # a 4 s clip with a keyframe every second


def test_plugin_entry_point_registers_every_loader(monkeypatch):
    """`vllm.general_plugins` -> register_all: all four, ours under their own names, vLLM's opencv kept."""
    import importlib

    from batchjob.loaders import opencv, pyav_adaptive, pyav_burst, pyav_keyframes

    video = _fake_vllm(monkeypatch)
    video.VIDEO_LOADER_REGISTRY.loaders["opencv"] = "vLLM's own"
    for module in (pyav_keyframes, pyav_adaptive, pyav_burst, opencv):  # what importing them fresh in a vLLM process does
        importlib.reload(module)
    bridge.register_all()
    loaders = video.VIDEO_LOADER_REGISTRY.loaders
    assert {"pyav_keyframes", "pyav_adaptive", "pyav_burst", "batchjob_opencv"} <= set(loaders)
    assert loaders["opencv"] == "vLLM's own"


def test_entry_point_is_declared():
    """pip installs it from pyproject.toml; vLLM reads it from the installed metadata."""
    from pathlib import Path

    tomllib = pytest.importorskip("tomllib")  # Python 3.11+

    pyproject = tomllib.loads((Path(__file__).parents[2] / "pyproject.toml").read_text())
    plugins = pyproject["project"]["entry-points"]["vllm.general_plugins"]
    module, _, function = plugins["batchjob_loaders"].partition(":")
    assert getattr(importlib.import_module(module), function) is bridge.register_all


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="vLLM is installed here")
def test_without_vllm_nothing_is_imported_from_it():
    code = "import sys, batchjob.loaders; print(sorted(m for m in sys.modules if m.split('.')[0] == 'vllm'))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "[]", out.stderr


def test_bridge_is_off_without_vllm_or_when_disabled(monkeypatch):
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None)
    assert bridge.register_with_vllm("pyav_keyframes", object) is False
    _fake_vllm(monkeypatch)
    monkeypatch.setenv("BATCHJOB_VLLM_BRIDGE", "0")
    assert bridge.register_with_vllm("pyav_keyframes", object) is False


@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM not installed in this environment")
def test_real_vllm_registry_serves_our_loader(clips):
    from vllm.multimodal.video import VIDEO_LOADER_REGISTRY as vllm_registry

    import batchjob.loaders.pyav_keyframes  # noqa: F401

    path, _ = clips("h264_bframes_mp4")
    data = open(path, "rb").read()
    expected, expected_meta = load_video(path, num_frames=6)
    frames, meta = vllm_registry.load("pyav_keyframes").load_bytes(data, num_frames=6)
    np.testing.assert_array_equal(frames, expected)
    assert meta == {key: expected_meta[key] for key in bridge.VLLM_METADATA_KEYS}
    # the path users take: media_io_kwargs={"video": {"video_backend": "pyav_keyframes", ...}}
    try:
        from vllm.multimodal.media.image import ImageMediaIO
        from vllm.multimodal.media.video import VideoMediaIO
    except ImportError:  # older vLLM layout
        from vllm.multimodal.image import ImageMediaIO
        from vllm.multimodal.video import VideoMediaIO
    media_io = VideoMediaIO(ImageMediaIO(), num_frames=6, video_backend="pyav_keyframes", fps=2)
    loaded = media_io.load_bytes(data)
    frames, meta = getattr(loaded, "media", loaded)
    np.testing.assert_array_equal(frames, expected)
    assert meta["video_backend"] == "pyav_keyframes"
