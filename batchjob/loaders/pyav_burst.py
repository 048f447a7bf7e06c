"""`pyav_burst`: the keyframe loader's frames, with each repeated keyframe replaced by the frames right after it.

Exact uniform frames inside a long GOP cost a forward decode from its keyframe, up to the whole GOP per
frame: on a clip with one keyframe, the whole clip. Keyframes alone are cheap, but when a clip has fewer
keyframes than frames asked for, `pyav_keyframes` repeats them, and Qwen-VL models, which fold consecutive
frames two by two into one temporal patch, then see patches of two identical pictures: no motion. This
loader keeps `pyav_keyframes`' layout (the same keyframes, the same spread over the clip, the same pairing
into patches, which is what order-of-events questions need) and replaces each repeat of a keyframe by a
picture of its GOP. By default (`burst_step=0`) those are the pictures decoded right after the keyframe
(`picks.decode_order_bursts`): m distinct frames for m pictures decoded, the fewest possible (with B-frames
they are not the next frames shown: the first is the one the B-frames wait for, a few frames later).
`burst_step=N` takes frames N apart in presentation order instead (`picks.burst_targets`), which also decodes
the B-frames in between. Bursts instead of the keyframes' layout (a few anchors, each with its own run) lost
order-of-events accuracy with the demo model; see the README's sampler curve.

What it cannot see: what happens between keyframes (order of events inside one long GOP; the end of a
clip after its last keyframe), nor motion slower than its few pictures show. A clip with one keyframe shows
only its first `num_frames` pictures in decode order (or `num_frames * burst_step` frames). When that matters
more than decode time, use `pyav_adaptive` (exact uniform frames).
Frame indices and timestamps in the metadata are those of the frames returned (every frame is decoded
exactly, forward from its keyframe). How many frames: as vLLM's uniform loader counts them (request.py).
"""

from __future__ import annotations

import os

import numpy as np

from batchjob.loaders.errors import InvalidArgument
from batchjob.loaders.keyframes import USE_INDEX_OPTION, KeyframeListing
from batchjob.loaders.media import Source, describe
from batchjob.loaders.picks import burst_targets, decode_order_bursts
from batchjob.loaders.registry import VIDEO_LOADER_REGISTRY, LoaderOption
from batchjob.loaders.request import FPS_OPTION, FrameRequest
from batchjob.loaders.sampling import keyframes_or_exact
from batchjob.loaders.vllm_bridge import register_with_vllm

NAME = "pyav_burst"
DECODE_ORDER = 0        # burst_step 0: the pictures decoded right after the keyframe (`picks.decode_order_bursts`)
# The same answers as frames 2 apart from the demo model on 720p clips, for fewer pictures decoded (README).
DEFAULT_BURST_STEP = DECODE_ORDER


def load_burst(source: Source, num_frames: int = 16, *, fps: float = -1, frame_recovery: bool = False,
               burst_step: int = DEFAULT_BURST_STEP, burst_pictures: int = 0, use_index: bool = True,
               **_ignored) -> tuple[np.ndarray, dict]:
    label = describe(source)
    request = FrameRequest.parse(label, NAME, num_frames, fps, frame_recovery)
    if isinstance(burst_step, bool) or not isinstance(burst_step, (int, np.integer)) or burst_step < 0:
        raise InvalidArgument(label, f"burst_step must be 0 (the pictures decoded right after each keyframe) or a "
                                     f"positive integer (frames between a keyframe and the frames after it), "
                                     f"got {burst_step!r}")
    if isinstance(burst_pictures, bool) or not isinstance(burst_pictures, (int, np.integer)) or burst_pictures < 0:
        raise InvalidArgument(label, f"burst_pictures must be 0 (as many as the keyframe's repeats) or a positive "
                                     f"integer (pictures decoded per keyframe, the keyframe included), "
                                     f"got {burst_pictures!r}")
    if burst_pictures and burst_step != DECODE_ORDER:
        raise InvalidArgument(label, "burst_pictures caps the pictures decoded right after each keyframe "
                                     "(burst_step=0); drop one of burst_pictures and burst_step")
    step, most = int(burst_step), int(burst_pictures) or None

    def targets(listing: KeyframeListing, n: int) -> list[int]:
        indices = [k.index for k in listing.keyframes]
        if step == DECODE_ORDER:
            order = {pts: i for i, pts in enumerate(listing.sorted_pts)}
            return decode_order_bursts(indices, [k.decode_position for k in listing.keyframes],
                                       [order[pts] for pts in listing.decode_pts], n, most)
        return burst_targets(indices, listing.total_num_frames, n, step)

    return keyframes_or_exact(source, label, NAME, request, use_index=use_index, mode_key="burst_mode",
                              fill_mode="bursts", fill_extra={"burst_step": step, "burst_pictures": most or 0},
                              one_thread=True, targets=targets)


@VIDEO_LOADER_REGISTRY.register(NAME)
class PyAVBurstLoader:
    """Keyframes spread over the clip; where a keyframe would repeat, the frames right after it instead
    (motion inside each temporal patch) at close to keyframe cost."""

    options = {"fps": FPS_OPTION,
               "burst_step": LoaderOption(int, "frames between a keyframe and each frame that replaces a repeat of "
                                               "it; 0: the pictures decoded right after the keyframe", minimum=0),
               "burst_pictures": LoaderOption(int, "with burst_step 0: the most pictures decoded per keyframe (the "
                                                   "last one repeats); 0: one per repeat of the keyframe", minimum=0),
               "use_index": USE_INDEX_OPTION}

    reads_file_objects = True   # URLs arrive as seekable range-reading files (batchjob.loaders.remote)

    @classmethod
    def load_bytes(cls, data: bytes, *, num_frames: int = 16, **kwargs) -> tuple[np.ndarray, dict]:
        return load_burst(data, num_frames, **kwargs)

    @classmethod
    def load_path(cls, path: str | os.PathLike, *, num_frames: int = 16, **kwargs) -> tuple[np.ndarray, dict]:
        return load_burst(os.fspath(path), num_frames, **kwargs)


register_with_vllm(NAME, PyAVBurstLoader)
