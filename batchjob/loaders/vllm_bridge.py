"""Registering a batchjob loader in vLLM's own `VIDEO_LOADER_REGISTRY` when vLLM is installed.

vLLM looks loaders up by the `video_backend` media kwarg and calls the class's `load_bytes(data,
num_frames=-1, **kwargs)`, forwarding every other media kwarg. The bridge class is a `VideoLoader`
subclass whose `load_bytes` calls ours, so both registries serve the same code.
"""

from __future__ import annotations

import importlib.util
import logging
import os

log = logging.getLogger(__name__)

# vLLM's VideoMediaIO samples 32 frames unless told otherwise; -1 ("all frames") has no keyframe meaning
# that is safe for memory on long clips, so it gets the same default.
VLLM_DEFAULT_NUM_FRAMES = 32
# The metadata keys vLLM's own loaders return; our extras (keyframe_source, ...) stay on our side, since
# vLLM hands the dict on to Hugging Face processors that may not accept unknown fields.
VLLM_METADATA_KEYS = ("total_num_frames", "fps", "duration", "video_backend", "frames_indices", "do_sample_frames")


def _vllm_video_module():
    if os.environ.get("BATCHJOB_VLLM_BRIDGE", "1") == "0":
        return None
    try:
        if importlib.util.find_spec("vllm") is None:
            return None
        import vllm.multimodal.video as video  # heavy (torch); only reached when vLLM is installed
    except Exception as err:  # a broken vLLM install must not break batchjob's own loaders
        log.warning("vLLM is installed but vllm.multimodal.video failed to import (%s); "
                    "batchjob loaders are not registered with vLLM", err)
        return None
    return video


def register_with_vllm(name: str, loader: type) -> bool:
    """Register `loader` under `name` in vLLM's registry; False when vLLM is absent or unusable."""
    video = _vllm_video_module()
    if video is None:
        return False

    def load_bytes(cls, data: bytes, num_frames: int = -1, **kwargs):
        if num_frames is None or num_frames <= 0:
            num_frames = VLLM_DEFAULT_NUM_FRAMES
        kwargs.pop("video_backend", None)
        frames, metadata = loader.load_bytes(data, num_frames=num_frames, **kwargs)
        return frames, {key: metadata[key] for key in VLLM_METADATA_KEYS}

    bridge = type(f"Batchjob{loader.__name__}", (video.VideoLoader,),
                  {"load_bytes": classmethod(load_bytes), "__doc__": f"batchjob's {name} loader."})
    video.VIDEO_LOADER_REGISTRY.register(name)(bridge)
    return True
