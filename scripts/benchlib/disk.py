"""Files on disk as the kernel's page cache holds them: evicting a folder, reading it cold, counting its files."""
from __future__ import annotations

import os
import time
from pathlib import Path


def evict_from_page_cache(folder: Path) -> int:
    """Ask the kernel to drop `folder`'s files from the page cache (no root needed); bytes asked for."""
    total = 0
    for f in folder.rglob("*"):
        if f.is_file():
            fd = os.open(f, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                total += f.stat().st_size
            finally:
                os.close(fd)
    return total


def count_files(folder: Path) -> int:
    return sum(1 for f in folder.rglob("*") if f.is_file()) if folder.is_dir() else 0


def timed_read(folder: Path) -> tuple[float, int]:
    """Seconds and bytes to read `folder`'s files once, sequentially, in 16 MiB chunks (evicted first)."""
    evict_from_page_cache(folder)
    t0, total = time.perf_counter(), 0
    for f in sorted(folder.rglob("*")):
        if f.is_file():
            with open(f, "rb", buffering=0) as fh:
                while chunk := fh.read(16 * 2**20):
                    total += len(chunk)
    return time.perf_counter() - t0, total

