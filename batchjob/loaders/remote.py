"""Loading a clip named by a URL: ranged reads for loaders that take a file object, a local copy for the others.

A loader class that sets `reads_file_objects = True` gets the clip as a seekable `RangeFile` through its
`load_bytes`, so PyAV fetches only the index and the packets it decodes. Any other loader (OpenCV, a site's own)
gets a path to a local copy from the download cache. Either way the metadata gains what the clip cost on the
network: `fetched_bytes`, `fetch_requests`, `fetch_retries` and `object_bytes`. file:// URLs are local paths.
"""
from __future__ import annotations

import numpy as np

from batchjob.location import is_remote, local_path, redact
from batchjob.loaders.download_cache import download_cache
from batchjob.loaders.errors import CorruptVideo, LoaderError
from batchjob.loaders.range_file import RangeFile
from batchjob.loaders.transport import RemoteObject, RemoteOptions


def load_url(loader: type, url: str, *, num_frames: int, options: RemoteOptions | None = None,
             **kwargs) -> tuple[np.ndarray, dict]:
    if not is_remote(url):
        from batchjob.loaders.transport import filesystem

        if url.lower().startswith("file:"):
            return loader.load_path(local_path(url), num_frames=num_frames, **kwargs)
        filesystem(url)   # raises InvalidArgument naming the unsupported scheme
    obj = RemoteObject(url, options)
    if obj.size == 0:
        raise CorruptVideo(obj.label, "the object is empty (0 bytes); the upload did not finish")
    if getattr(loader, "reads_file_objects", False):
        file = RangeFile(obj)
        try:
            frames, meta = loader.load_bytes(file, num_frames=num_frames, **kwargs)
        except LoaderError as err:
            if file.failure is not None and file.failure is not err:
                raise file.failure from err   # FFmpeg turned a failed read into "damaged file": say what failed
            raise
    else:
        path = download_cache(obj.options.download_cache_bytes).fetch(obj)
        frames, meta = loader.load_path(path, num_frames=num_frames, label=redact(url), **kwargs)
    return frames, {**meta, **obj.counter.as_metadata(obj.size)}
