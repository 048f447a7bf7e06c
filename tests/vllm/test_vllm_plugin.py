"""Our loaders inside a real vLLM (run by scripts/vllm_tests.sh in the vLLM environment).

The vLLM side runs in a fresh interpreter that imports only vLLM and calls `load_general_plugins()`, as
every vLLM process (`vllm serve` included) does: batchjob arrives through the entry point alone. Its
frames and metadata come back in an .npz and are checked here against `load_video` and against vLLM's
own uniform loader on the same clips.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
import textwrap

import numpy as np
import pytest

pytestmark = [pytest.mark.vllm,
              pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                                 reason="vLLM is not installed here; scripts/vllm_tests.sh runs these in the "
                                        "environment scripts/vllm_env.sh builds")]

OUR_LOADERS = {"pyav_keyframes": "pyav_keyframes", "pyav_adaptive": "pyav_adaptive", "pyav_burst": "pyav_burst",
               "batchjob_opencv": "opencv"}
CLIPS = ["h264_bframes_mp4", "hevc_bframes_mp4", "h264_bframes_mkv", "vp9_webm", "h264_single_keyframe"]
# (num_frames, fps) as vLLM passes them: its VideoMediaIO default is 32 frames; fps <= 0 means no limit.
CALLS = [(32, -1), (32, 1), (32, 2.5), (6, 0.5), (-1, 1), (100, -1), (1, -1), (8, 30)]

VLLM_SIDE = textwrap.dedent('''
    import json, sys
    import numpy as np
    from vllm.plugins import load_general_plugins
    from vllm.multimodal.media import ImageMediaIO, VideoMediaIO
    from vllm.multimodal.video import VIDEO_LOADER_REGISTRY

    def batchjob_modules():
        return [name for name in sys.modules if name == "batchjob" or name.startswith("batchjob.")]

    assert not batchjob_modules(), "importing vLLM alone imported batchjob"
    load_general_plugins()
    assert batchjob_modules(), "the vllm.general_plugins entry point did not load batchjob"
    job = json.loads(sys.argv[1])
    arrays, metas, errors = {}, {}, {}
    for i, (loader, path, num_frames, fps, extra) in enumerate(job["calls"]):
        data = open(path, "rb").read()
        try:
            if loader == "media_io":  # the path a request takes: media_io_kwargs={"video": {...}}
                io = VideoMediaIO(ImageMediaIO(), num_frames=num_frames, fps=fps, video_backend=job["media_io"])
                frames, meta = io.load_bytes(data)
            else:
                frames, meta = VIDEO_LOADER_REGISTRY.load(loader).load_bytes(
                    data, num_frames=num_frames, fps=fps, **{"max_duration": 300, **extra})
            arrays[str(i)] = np.asarray(frames)
            metas[str(i)] = meta
        except Exception as err:
            errors[str(i)] = [type(err).__name__, [c.__name__ for c in type(err).__mro__], str(err)]
    np.savez(job["out"], **arrays)
    json.dump({"metas": metas, "errors": errors,
               "registered": sorted(VIDEO_LOADER_REGISTRY.name2class)}, open(job["out"] + ".json", "w"))
''')


def run_vllm_side(tmp_path, calls, media_io="pyav_keyframes"):
    """calls: (loader, path, num_frames, fps[, extra kwargs]); runs them all in one plugin-only process."""
    out = str(tmp_path / "vllm_side.npz")
    calls = [list(call) + [{}] * (5 - len(call)) for call in calls]
    job = {"calls": calls, "out": out, "media_io": media_io}
    proc = subprocess.run([sys.executable, "-c", VLLM_SIDE, json.dumps(job)], capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    with np.load(out) as arrays:
        frames = {k: arrays[k] for k in arrays.files}
    side = json.load(open(out + ".json"))
    return frames, side["metas"], side["errors"], side["registered"]


@pytest.fixture(scope="module")
def vllm_results(clips, tmp_path_factory):
    """One vLLM process for every call: (loader, clip, num_frames, fps) -> frames, metadata."""
    calls = [(loader, clips(clip)[0], n, fps) for loader in [*OUR_LOADERS, "opencv"] for clip in CLIPS
             for n, fps in CALLS]
    # max_duration shorter than the clips: vLLM's uniform loader ignores it, and so must ours
    calls += [(loader, clips(clip)[0], 32, 2.5, {"max_duration": 1}) for loader in [*OUR_LOADERS, "opencv"]
              for clip in CLIPS]
    calls += [("media_io", clips(clip)[0], 6, 2) for clip in CLIPS]
    frames, metas, errors, registered = run_vllm_side(tmp_path_factory.mktemp("vllm"), calls)
    assert not errors, errors
    results = {}
    for i, (loader, path, n, fps, *extra) in enumerate(calls):
        results[(loader, path, n, fps, "short" if extra else "")] = (frames[str(i)], metas[str(i)])
    return results, registered


def test_plugin_registers_every_loader_without_touching_vllms_own(vllm_results):
    _, registered = vllm_results
    assert set(OUR_LOADERS) <= set(registered)
    from vllm.multimodal.video import VIDEO_LOADER_REGISTRY  # noqa: F401  (this process: batchjob imported)
    from vllm.plugins import load_general_plugins

    load_general_plugins()
    assert VIDEO_LOADER_REGISTRY.name2class["opencv"].__module__.startswith("vllm.")


@pytest.mark.parametrize("loader", list(OUR_LOADERS))
@pytest.mark.parametrize("clip", CLIPS)
def test_registry_frames_and_metadata_equal_load_video(vllm_results, clips, loader, clip):
    from batchjob.loaders import load_video
    from batchjob.loaders.vllm_bridge import vllm_metadata

    results, _ = vllm_results
    path, _ = clips(clip)
    for n, fps in CALLS:
        frames, meta = results[(loader, path, n, fps, "")]
        expected, expected_meta = load_video(path, backend=OUR_LOADERS[loader], num_frames=n, fps=fps)
        np.testing.assert_array_equal(frames, expected)
        assert meta == json.loads(json.dumps(vllm_metadata(expected_meta)))


@pytest.mark.parametrize("loader", list(OUR_LOADERS))
@pytest.mark.parametrize("clip", CLIPS)
def test_fps_gives_the_frame_counts_of_vllms_own_loader(vllm_results, clips, loader, clip):
    results, _ = vllm_results
    path, _ = clips(clip)
    for n, fps in CALLS:
        if loader == "pyav_keyframes" and n == -1:
            continue  # -1 is every keyframe there, by design (README, "Using the loader from vLLM")
        ours, ours_meta = results[(loader, path, n, fps, "")]
        theirs, theirs_meta = results[("opencv", path, n, fps, "")]
        assert len(ours) == len(theirs), (n, fps)
        assert ours_meta["total_num_frames"] == theirs_meta["total_num_frames"]
        if loader == "batchjob_opencv":  # the lossless uniform loader: the very same frames
            assert ours_meta["frames_indices"] == theirs_meta["frames_indices"]
    ours, _ = results[(loader, path, 32, 2.5, "short")]
    theirs, _ = results[("opencv", path, 32, 2.5, "short")]
    assert len(ours) == len(theirs) == len(results[("opencv", path, 32, 2.5, "")][0])  # max_duration=1 ignored


@pytest.mark.parametrize("clip", CLIPS)
def test_media_io_kwargs_path(vllm_results, clips, clip):
    """VideoMediaIO(..., video_backend="pyav_keyframes", num_frames=6, fps=2): what a vLLM request runs."""
    from batchjob.loaders import load_video

    results, _ = vllm_results
    path, _ = clips(clip)
    frames, meta = results[("media_io", path, 6, 2, "")]
    expected, expected_meta = load_video(path, backend="pyav_keyframes", num_frames=6, fps=2)
    np.testing.assert_array_equal(frames, expected)
    assert meta["video_backend"] == "pyav_keyframes" and meta["frames_indices"] == expected_meta["frames_indices"]


def test_bad_media_is_a_value_error_in_vllm(tmp_path):
    """vLLM maps a loader's ValueError to HTTP 400; frame_recovery is refused the same way."""
    text = tmp_path / "notes.mp4"
    text.write_bytes(b"not a video\n" * 100)
    clip = str(tmp_path / "ok.mp4")
    from batchjob.synthetic.clips import make_clip

    make_clip(clip, seconds=1)
    calls = [(loader, str(text), 8, -1) for loader in OUR_LOADERS]
    calls += [(loader, clip, 8, -1, {"frame_recovery": True}) for loader in OUR_LOADERS]
    _, _, errors, _ = run_vllm_side(tmp_path, calls)
    assert len(errors) == len(calls)
    for i, (name, mro, message) in errors.items():
        assert "ValueError" in mro and "LoaderError" in mro, (name, message)
        if int(i) >= len(OUR_LOADERS):
            assert "frame_recovery is not supported" in message
