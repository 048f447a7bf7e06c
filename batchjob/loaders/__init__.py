"""Video loaders: compressed clip in, uint8 RGB frames `[T, H, W, 3]` plus vLLM-style metadata out.

Backends (see each module): `pyav_keyframes` (keyframes only, the default), `pyav_adaptive` (keyframes,
or exact uniform frames when keyframes are too few), `pyav_burst` (keyframes, each repeat replaced by
the frame right after it: motion at close to keyframe cost), `opencv` (lossless uniform baseline, as vLLM's).
"""

from __future__ import annotations

import os

import numpy as np

from batchjob.location import is_url
from batchjob.loaders.errors import (CorruptVideo, InvalidArgument, LoaderError, MissingTimestamps,
                                     RemoteReadError, UnsupportedMedia, VideoNotFound)
from batchjob.loaders.media import Source
from batchjob.loaders.registry import VIDEO_LOADER_REGISTRY, get_loader, list_loaders
from batchjob.loaders.remote import load_url
from batchjob.loaders.transport import RemoteOptions
from batchjob.loaders import opencv, pyav_adaptive, pyav_burst, pyav_keyframes  # noqa: E402,F401  (registers built-ins)

__all__ = ["load_video", "LoaderError", "VideoNotFound", "UnsupportedMedia", "CorruptVideo", "MissingTimestamps",
           "InvalidArgument", "RemoteReadError", "RemoteOptions", "VIDEO_LOADER_REGISTRY", "get_loader", "list_loaders"]


def load_video(source: Source, *, backend: str = "pyav_keyframes", num_frames: int = 16,
               remote: RemoteOptions | None = None, **kwargs) -> tuple[np.ndarray, dict]:
    """Decode `num_frames` frames of `source` (path, URL, bytes or binary file object) with `backend`.

    Paths go to the loader's path entry so PyAV seeks in the file instead of reading it into memory. URLs
    (s3://, gs://, az://, https://, file://) are read through fsspec with ranged reads (`remote` sets retries,
    timeouts and read-ahead; see `batchjob.loaders.remote`), and their metadata says what they cost in bytes.
    Unknown keyword arguments are ignored, as vLLM forwards all its media kwargs to loaders.
    """
    loader = get_loader(backend)
    if isinstance(source, str) and is_url(source):
        return load_url(loader, source, num_frames=num_frames, options=remote, **kwargs)
    if isinstance(source, (str, os.PathLike)):
        return loader.load_path(os.fspath(source), num_frames=num_frames, **kwargs)
    return loader.load_bytes(source, num_frames=num_frames, **kwargs)
