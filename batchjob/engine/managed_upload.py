"""Host data on an MLX CUDA device: its pages sent to the GPU before the kernel that reads them.

MLX's CUDA backend keeps arrays made from host data (`mx.array(numpy)`, how a clip's patch bytes reach the
engine) in managed memory, and the first kernel that reads one faults its pages over to the GPU on demand:
slower than a copy, and that kernel stalls meanwhile (`scripts/diag_upload.py`). Asking the driver to prefetch
the pages as soon as the array exists turns that into an asynchronous copy ahead of the kernel. A prefetch is
a hint: the bytes and what they mean do not change, and where the driver, its entry point or a current context
is missing, or it refuses, nothing is done and the pages move on demand as before.
`BATCHJOB_MANAGED_PREFETCH=0` turns it off (for comparisons, or a driver that misbehaves).
"""
from __future__ import annotations

import ctypes
import functools
import logging
import os
from dataclasses import dataclass
from typing import Any

import numpy as np

log = logging.getLogger(__name__)

CU_MEM_LOCATION_TYPE_DEVICE = 1
CU_STREAM_PER_THREAD = 2        # the calling thread's default stream: blocks no other stream
# Below this a prefetch costs about what it saves (a driver call against a few pages faulted in).
MIN_PREFETCH_BYTES = 1 << 20
OFF_ENV = "BATCHJOB_MANAGED_PREFETCH"


class MemLocation(ctypes.Structure):
    """The driver's `CUmemLocation`, passed by value."""

    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


@dataclass
class Prefetcher:
    """`cuMemPrefetchAsync_v2` of the CUDA driver, bound to one device; stops asking after its first refusal."""

    driver: Any                 # the loaded driver library (tests pass a stand-in)
    device: int = 0
    failed: str | None = None      # why it stopped asking

    def __call__(self, address: int, nbytes: int) -> bool:
        """Prefetch `nbytes` of managed memory at `address` to the GPU; True when the driver took the request."""
        if self.failed is not None:
            return False
        if not self._context_current():
            return False
        status = self.driver.cuMemPrefetchAsync_v2(
            ctypes.c_uint64(address), ctypes.c_size_t(nbytes), MemLocation(CU_MEM_LOCATION_TYPE_DEVICE, self.device),
            ctypes.c_uint(0), ctypes.c_void_p(CU_STREAM_PER_THREAD))
        if status != 0:
            self.failed = f"cuMemPrefetchAsync_v2 returned {status}"
            log.info("managed-memory prefetch off: %s; host data reaches the GPU on demand", self.failed)
            return False
        return True

    def _context_current(self) -> bool:
        """The device's primary context (the one MLX's runtime uses) current on this thread: a thread where MLX
        has not called the runtime itself has none yet."""
        context = ctypes.c_void_p()
        if self.driver.cuCtxGetCurrent(ctypes.byref(context)) == 0 and context.value:
            return True
        device = ctypes.c_int()
        if self.driver.cuDeviceGet(ctypes.byref(device), ctypes.c_int(self.device)) != 0 \
                or self.driver.cuDevicePrimaryCtxRetain(ctypes.byref(context), device) != 0 \
                or not context.value or self.driver.cuCtxSetCurrent(context) != 0:
            self.failed = "no CUDA context for this thread"
            return False
        return True


def load_prefetcher(load=ctypes.CDLL, device: int = 0) -> Prefetcher | None:
    """A Prefetcher over the CUDA driver (`load` opens the library; tests fake it), None without one."""
    try:
        driver = load("libcuda.so.1")
        prefetch, current = driver.cuMemPrefetchAsync_v2, driver.cuCtxGetCurrent
        retain, make_current, get_device = driver.cuDevicePrimaryCtxRetain, driver.cuCtxSetCurrent, driver.cuDeviceGet
    except (OSError, AttributeError):
        return None
    if isinstance(prefetch, ctypes._CFuncPtr):      # the real library: declare the by-value struct
        prefetch.argtypes = [ctypes.c_uint64, ctypes.c_size_t, MemLocation, ctypes.c_uint, ctypes.c_void_p]
        current.argtypes = [ctypes.POINTER(ctypes.c_void_p)]
        retain.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_int]
        make_current.argtypes = [ctypes.c_void_p]
        get_device.argtypes = [ctypes.POINTER(ctypes.c_int), ctypes.c_int]
        for fn in (prefetch, current, retain, make_current, get_device):
            fn.restype = ctypes.c_int
    return Prefetcher(driver, device)


def buffer_address(array) -> int:
    """Where an evaluated array's bytes start (its buffer; for an MLX CUDA array made from host data, managed
    memory that host and GPU share)."""
    return int(np.frombuffer(memoryview(array), dtype=np.uint8).__array_interface__["data"][0])


@functools.lru_cache(maxsize=1)
def _cuda_prefetcher() -> Prefetcher | None:
    from .device import gpu_kind

    if os.environ.get(OFF_ENV) == "0" or gpu_kind() != "cuda":
        return None
    return load_prefetcher()


def prefetch_to_gpu(array, prefetcher: Prefetcher | None = None) -> bool:
    """Send `array`'s pages (host data just handed to MLX) to the GPU ahead of its first reader, when the
    default device is an NVIDIA GPU and the array is large enough to matter; True when a prefetch was queued."""
    import mlx.core as mx

    if array.nbytes < MIN_PREFETCH_BYTES or mx.default_device() != mx.gpu:
        return False
    prefetcher = prefetcher or _cuda_prefetcher()
    if prefetcher is None:
        return False
    # No mx.eval: an array made from host data is available as made, and reading its buffer's address touches
    # no stream, so a thread other than the engine's may upload (patchify.upload_bytes).
    return prefetcher(buffer_address(array), array.nbytes)
