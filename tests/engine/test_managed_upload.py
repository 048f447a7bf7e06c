"""The managed-memory prefetch that sends a clip's host bytes to the GPU ahead of the kernel reading them: what
it asks the CUDA driver (against a stand-in driver; CI has no GPU), when it asks nothing, and that the engine's
pixels are the same with it as without."""
from __future__ import annotations

import ctypes

import mlx.core as mx
import numpy as np
import pytest

from batchjob.engine import managed_upload
from batchjob.engine.managed_upload import (CU_MEM_LOCATION_TYPE_DEVICE, CU_STREAM_PER_THREAD, Prefetcher,
                                            buffer_address, load_prefetcher)


class FakeDriver:
    """cuCtxGetCurrent and cuMemPrefetchAsync_v2 as the driver exports them, recording each prefetch."""

    def __init__(self, context: int | None = 0x1234, status: int = 0, primary: int | None = 0x5678):
        self.context, self.status, self.primary, self.calls = context, status, primary, []

    def cuCtxGetCurrent(self, ref) -> int:
        ref._obj.value = self.context
        return 0

    def cuDeviceGet(self, ref, ordinal) -> int:
        ref._obj.value = 100 + ordinal.value           # a handle, not the ordinal itself
        return 0

    def cuDevicePrimaryCtxRetain(self, ref, device) -> int:
        assert device.value >= 100, "the primary context is asked for by device handle"
        ref._obj.value = self.primary
        return 0 if self.primary else 201          # CUDA_ERROR_INVALID_CONTEXT

    def cuCtxSetCurrent(self, context) -> int:
        self.context = context.value
        return 0

    def cuMemPrefetchAsync_v2(self, address, nbytes, location, flags, stream) -> int:
        self.calls.append((address.value, nbytes.value, location.type, location.id, flags.value, stream.value))
        return self.status


def test_prefetch_asks_for_the_arrays_bytes_on_the_device(rng):
    data = rng.integers(0, 256, int(rng.integers(1, 5000)), dtype=np.uint8)
    array = mx.array(data)
    mx.eval(array)
    address = buffer_address(array)
    # the address is the array's own bytes
    assert bytes((ctypes.c_uint8 * data.size).from_address(address)) == data.tobytes()
    driver = FakeDriver()
    device = int(rng.integers(0, 8))
    assert Prefetcher(driver, device)(address, array.nbytes)
    assert driver.calls == [(address, data.size, CU_MEM_LOCATION_TYPE_DEVICE, device, 0, CU_STREAM_PER_THREAD)]


def test_a_thread_without_a_context_gets_the_primary_one_and_a_refusal_stops_asking():
    fresh = FakeDriver(context=None)           # a thread where MLX never called the runtime
    assert Prefetcher(fresh)(0x1000, 1 << 20) and fresh.context == 0x5678 and len(fresh.calls) == 1
    none = FakeDriver(context=None, primary=None)
    prefetcher = Prefetcher(none)
    assert not prefetcher(0x1000, 1 << 20) and none.calls == [] and "no CUDA context" in prefetcher.failed
    refusing = FakeDriver(status=1)          # CUDA_ERROR_INVALID_VALUE: not managed memory, say
    prefetcher = Prefetcher(refusing)
    assert not prefetcher(0x1000, 1 << 20) and not prefetcher(0x2000, 1 << 20)
    assert len(refusing.calls) == 1 and "returned 1" in prefetcher.failed


def test_no_driver_no_prefetcher():
    def missing(name):
        raise OSError(f"{name}: cannot open shared object file")

    class Old:                 # a driver older than the entry point
        cuCtxGetCurrent = staticmethod(lambda ref: 0)
        cuDevicePrimaryCtxRetain = cuCtxSetCurrent = cuDeviceGet = staticmethod(lambda *a: 0)

    assert load_prefetcher(missing) is None
    assert load_prefetcher(lambda name: Old()) is None
    assert isinstance(load_prefetcher(lambda name: FakeDriver()), Prefetcher)


def test_off_the_gpu_or_small_nothing_is_asked(rng, monkeypatch):
    driver = FakeDriver()
    big = mx.array(rng.integers(0, 256, managed_upload.MIN_PREFETCH_BYTES, dtype=np.uint8))
    # this CPU default device: no prefetch, whatever the array
    assert not managed_upload.prefetch_to_gpu(big, Prefetcher(driver))
    monkeypatch.setattr(mx, "default_device", lambda: mx.gpu)
    small = mx.array(rng.integers(0, 256, managed_upload.MIN_PREFETCH_BYTES - 1, dtype=np.uint8))
    assert not managed_upload.prefetch_to_gpu(small, Prefetcher(driver)) and driver.calls == []
    assert managed_upload.prefetch_to_gpu(big, Prefetcher(driver)) and len(driver.calls) == 1


@pytest.mark.parametrize("prefetch", [False, True])
def test_device_pixels_are_the_same_with_the_prefetch(rng, monkeypatch, prefetch):
    """normalize_on_device with the prefetch queued (a stand-in driver: the bytes stay where they are) gives
    exactly normalize_bytes' values."""
    from batchjob.engine.patchify import normalize_bytes, normalize_on_device, normalize_table

    driver = FakeDriver()
    if prefetch:
        monkeypatch.setattr(managed_upload, "MIN_PREFETCH_BYTES", 1)
        monkeypatch.setattr(managed_upload, "_cuda_prefetcher", lambda: Prefetcher(driver))
        monkeypatch.setattr(mx, "default_device", lambda: mx.gpu)
    table = normalize_table((0.48, 0.46, 0.41), (0.27, 0.26, 0.28))
    patches = rng.integers(0, 256, (int(rng.integers(1, 40)), 3 * 2 * 14 * 14), dtype=np.uint8)
    with mx.stream(mx.cpu):
        got = np.array(normalize_on_device(patches, table))
    np.testing.assert_array_equal(got, normalize_bytes(patches, table))
    assert len(driver.calls) == int(prefetch)
