"""The checkpoint's weights read from disk while the job starts.

A night's first run often finds the checkpoint out of the page cache (other work filled it). An engine in an
actor cannot begin its load before Ray is up, but the disk can: while Ray starts, a thread reads the weight
files' uncached pages once, so the load then copies them from memory. The pages are the kernel's, not this
process's (one reused buffer), so Ray's fork of the driver stays cheap; where the files are cached already it
costs one probe per chunk. (An engine in the driver reads its weights itself from launch.)
"""
from __future__ import annotations

import os
import threading
from pathlib import Path

from batchjob.engine.shards import weight_files as engine_weight_files


def weight_files(checkpoint: str | os.PathLike) -> list[Path]:
    """The weight files the engine will read from a local checkpoint directory, in its order
    (`engine.shards.weight_files`); [] for a hub id or a missing folder."""
    folder = Path(checkpoint).expanduser()
    return engine_weight_files(folder) if folder.is_dir() else []


CHUNK = 16 * 2**20
_PROBE = bytearray(1)


def cached(fd: int, offset: int) -> bool:
    """Whether the page at `offset` is in the page cache (a read that may not wait: RWF_NOWAIT); False where
    the platform cannot say, so the chunk is read."""
    flag = getattr(os, "RWF_NOWAIT", None)
    if flag is None:
        return False
    try:
        return os.preadv(fd, [_PROBE], offset, flag) > 0
    except OSError:        # BlockingIOError: not cached; EOPNOTSUPP and the like: cannot tell
        return False


def warm_page_cache(files: list[Path]) -> threading.Thread | None:
    """Read `files` once on a thread, into one reused buffer, so the kernel's page cache holds them when the
    load comes (POSIX_FADV_WILLNEED alone proved unreliable: on the GPU machine's file system a cold load still
    read at disk speed). The thread waits in `preadv` (GIL released) and takes no lock Python's fork needs.
    None when there is nothing to read."""
    if not files:
        return None

    def read_all() -> None:
        buf = bytearray(CHUNK)
        for f in files:
            try:
                fd = os.open(f, os.O_RDONLY)
            except OSError:
                continue
            try:
                size, offset = os.fstat(fd).st_size, 0
                while offset < size:
                    if cached(fd, offset):   # a warm cache costs one probe per chunk, not a copy
                        offset += CHUNK
                        continue
                    n = os.preadv(fd, [buf], offset)
                    if n <= 0:
                        break
                    offset += n
            except OSError:
                pass
            finally:
                os.close(fd)

    thread = threading.Thread(target=read_all, name="weights-readahead", daemon=True)
    thread.start()
    return thread
