"""Local copies of remote clips for loaders that can only open a file by name (OpenCV).

A clip is downloaded once, in ranges of `max_read_ahead_bytes` (a connection dropped mid-clip costs one range,
which is retried, not the whole download), into a folder of this process's own under the system's temporary
directory. The folder is bounded (`download_cache_bytes`: least recently used copies go first, a clip larger than
the bound is refused with the setting to raise) and cleans itself: removed at exit, and any such folder whose
process has died (a decoder killed by the decode timeout) is removed by the next process that starts one.
"""
from __future__ import annotations

import atexit
import hashlib
import os
import shutil
import tempfile
import threading
from collections import OrderedDict
from pathlib import Path

from batchjob.loaders.errors import RemoteReadError
from batchjob.loaders.transport import RemoteObject

PREFIX = "batchjob-downloads-"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def sweep_orphans(parent: Path) -> list[Path]:
    """Remove the download folders of processes that no longer exist; returns what was removed."""
    removed = []
    for folder in parent.glob(PREFIX + "*"):
        pid = folder.name[len(PREFIX):]
        if pid.isdigit() and int(pid) != os.getpid() and not _alive(int(pid)):
            shutil.rmtree(folder, ignore_errors=True)
            removed.append(folder)
    return removed


class DownloadCache:
    def __init__(self, max_bytes: int, parent: str | os.PathLike | None = None):
        self.max_bytes = max_bytes
        parent = Path(parent or tempfile.gettempdir())
        sweep_orphans(parent)
        self.folder = parent / f"{PREFIX}{os.getpid()}"
        self.folder.mkdir(parents=True, exist_ok=True)
        self._files: OrderedDict[str, int] = OrderedDict()   # key -> size, least recently used first
        self._lock = threading.Lock()
        atexit.register(self.close)

    def close(self) -> None:
        shutil.rmtree(self.folder, ignore_errors=True)
        self._files.clear()

    @staticmethod
    def key(obj: RemoteObject) -> str:
        """The same URL, size and version tag (ETag or modification time) is the same clip."""
        return hashlib.sha256(f"{obj.url}\0{obj.size}\0{obj.version}".encode()).hexdigest()[:32]

    def fetch(self, obj: RemoteObject) -> str:
        """A local path holding the whole object, downloading it unless a copy is already here."""
        key = self.key(obj)
        path = self.folder / f"{key}.video"
        with self._lock:
            if key in self._files and path.exists():
                self._files.move_to_end(key)
                return str(path)
            if obj.size > self.max_bytes:
                raise RemoteReadError(obj.label, f"{obj.size / 2**20:.0f} MiB is more than the download cache holds "
                                                 f"({self.max_bytes / 2**20:.0f} MiB) for this loader, which needs a "
                                                 "local file; raise runtime.remote.download_cache_mb or use a PyAV "
                                                 "loader, which reads ranges")
            self._evict(self.max_bytes - obj.size)
        tmp = path.with_suffix(".part")
        step = obj.options.max_read_ahead_bytes
        try:
            with open(tmp, "wb") as out:
                out.write(obj.head)   # the bytes opening the object already fetched
                for start in range(len(obj.head), obj.size, step):
                    out.write(obj.fetch(start, start + step))
            os.replace(tmp, path)
        finally:
            tmp.unlink(missing_ok=True)
        with self._lock:
            self._files[key] = obj.size
        return str(path)

    def _evict(self, room: int) -> None:
        while self._files and sum(self._files.values()) > room:
            old, _ = self._files.popitem(last=False)
            (self.folder / f"{old}.video").unlink(missing_ok=True)


_CACHE: list[DownloadCache] = []


def download_cache(max_bytes: int) -> DownloadCache:
    """This process's cache (one folder per process), bounded by the latest `max_bytes` asked for."""
    if not _CACHE or not _CACHE[0].folder.exists():
        _CACHE[:] = [DownloadCache(max_bytes)]
    _CACHE[0].max_bytes = max_bytes
    return _CACHE[0]
