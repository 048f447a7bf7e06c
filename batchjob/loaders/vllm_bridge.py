"""Our loaders in vLLM's own `VIDEO_LOADER_REGISTRY`, when vLLM is installed.

Two ways in: importing a loader module registers that loader (a user's own vLLM code), and the
`vllm.general_plugins` entry point `register_all` registers every loader in each vLLM process, which is
how `vllm serve --media-io-kwargs '{"video": {"video_backend": "pyav_keyframes"}}'` finds them without
importing batchjob. vLLM calls `load_bytes(data, num_frames=N, **media_io_kwargs["video"])`; the bridge
hands everything to our loader (which reads `fps` and refuses `frame_recovery` itself) and returns only
the metadata keys vLLM's loaders return. Without vLLM nothing here imports it.
"""

from __future__ import annotations

import importlib.util
import logging
import os
from typing import Any, Mapping

log = logging.getLogger(__name__)

# The metadata keys vLLM's own loaders return. Our extras (keyframe_source, per-frame timestamps, ...) stay
# on our side: vLLM hands the dict to Hugging Face processors, whose metadata classes reject unknown keys.
VLLM_METADATA_KEYS = ("total_num_frames", "fps", "duration", "video_backend", "frames_indices", "do_sample_frames")


def vllm_metadata(metadata: Mapping[str, Any]) -> dict[str, Any]:
    """The part of a batchjob loader's metadata that vLLM accepts (also for engines handing frames to vLLM)."""
    return {key: metadata[key] for key in VLLM_METADATA_KEYS}


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
        kwargs.pop("video_backend", None)
        frames, metadata = loader.load_bytes(data, num_frames=num_frames, **kwargs)
        return frames, vllm_metadata(metadata)

    bridge = type(f"Batchjob{loader.__name__}", (video.VideoLoader,),
                  {"load_bytes": classmethod(load_bytes), "__doc__": f"batchjob's {name} loader."})
    video.VIDEO_LOADER_REGISTRY.register(name)(bridge)
    return True


def register_all() -> None:
    """The `vllm.general_plugins` entry point: importing the loaders registers each of them."""
    import batchjob.loaders  # noqa: F401
