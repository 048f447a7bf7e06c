"""A remote object as a seekable binary file that PyAV reads through, fetching only the ranges it touches.

FFmpeg reads a container in small buffers (PyAV's default is 32 KiB) and seeks between the index and the packets
it needs. Each read that misses the cache fetches a range: after a seek, `read_ahead_bytes` (a keyframe's packet
and the few packets after it that the loader walks); while reads continue where the last fetch ended, the
read-ahead doubles up to `max_read_ahead_bytes`, so a sequential pass (the moov at a file's end, a demux sweep)
costs a handful of requests instead of thousands. Fetched ranges are kept, least recently used first out, within
`cache_bytes`. A failed fetch is remembered: FFmpeg may swallow a read error and report a damaged file instead,
so the caller asks `failure` what really happened.
"""
from __future__ import annotations

import errno
import io
from collections import OrderedDict

from batchjob.loaders.errors import LoaderError
from batchjob.loaders.transport import RemoteObject


class RangeFile(io.RawIOBase):
    def __init__(self, obj: RemoteObject):
        super().__init__()
        self.obj = obj
        self.size = obj.size
        self.name = self.source_label = obj.label   # what error messages name (see media.describe)
        self.failure: LoaderError | None = None
        self._pos = 0
        self._extents: OrderedDict[int, bytes] = OrderedDict()   # start -> bytes, least recently used first
        self._cached = 0
        self._last_end = -1            # where the last fetch ended (sequential reads continue there)
        self._ahead = obj.options.read_ahead_bytes
        if obj.head:                   # opening the object fetched its first bytes already
            self._store(0, obj.head)
            self._last_end = len(obj.head)

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self.size}.get(whence)
        if base is None:
            raise ValueError(f"invalid whence {whence}")
        pos = base + offset
        if pos < 0:
            raise OSError(errno.EINVAL, f"negative seek position {pos}")
        self._pos = pos
        return pos

    def readinto(self, buffer) -> int:
        view = memoryview(buffer).cast("B")
        want = min(len(view), self.size - self._pos)
        done = 0
        while done < want:
            chunk = self._read_at(self._pos + done, want - done)
            view[done:done + len(chunk)] = chunk
            done += len(chunk)
        self._pos += done
        return done

    def _read_at(self, pos: int, n: int) -> bytes:
        hit = self._lookup(pos)
        if hit is not None:
            start, data = hit
            return data[pos - start:pos - start + n]
        if self.failure is not None:   # the transport already gave up on this clip: do not start again
            raise self.failure
        ahead = min(2 * self._ahead, self.obj.options.max_read_ahead_bytes) if pos == self._last_end \
            else self.obj.options.read_ahead_bytes
        end = min(self.size, pos + max(n, ahead), self._next_cached_start(pos))
        try:
            data = self.obj.fetch(pos, end)
        except LoaderError as err:
            self.failure = err
            raise
        self._ahead, self._last_end = ahead, end
        self._store(pos, data)
        return data[:n]

    def _lookup(self, pos: int) -> tuple[int, bytes] | None:
        for start, data in self._extents.items():
            if start <= pos < start + len(data):
                self._extents.move_to_end(start)
                return start, data
        return None

    def _next_cached_start(self, pos: int) -> int:
        """Stop a fetch where cached bytes begin: nothing is fetched twice while it is still held."""
        return min((s for s in self._extents if s > pos), default=self.size)

    def _store(self, start: int, data: bytes) -> None:
        self._extents[start] = data
        self._cached += len(data)
        limit = self.obj.options.cache_bytes
        while self._cached > limit and len(self._extents) > 1:
            _, old = self._extents.popitem(last=False)
            self._cached -= len(old)
