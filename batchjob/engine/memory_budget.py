"""The engine's memory budget, sized from the device the model runs on.

A budget taken from host RAM on a GPU machine oversubscribes the GPU: MLX's CUDA allocator then falls back to
managed memory, and the job runs on, many times slower, with no error. So the budget comes from what the device
itself reports (MLX's `device_info`, the one boundary faked in tests): the GPU's free memory after the weights
on CUDA, Metal's recommended working set on Apple silicon (shared with the host processes), RAM on a CPU.
An explicit `model.memory_budget_gb` larger than the device, or too small for the weights plus one request,
fails at start with the figures and the fix.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Mapping

BUDGET_KEY = "model.memory_budget_gb"
CUDA_HEADROOM = 0.05    # MLX's CUDA allocator caps itself at 95% of the GPU; stay inside it
METAL_SHARE = 0.9       # the working set also serves the decoders' frames and the OS
CPU_SHARE = 0.75        # RAM: the rest for decoders, Ray and the OS
GIB = 2**30
MIN_BUFFER_CACHE = GIB  # the smallest cache of freed buffers the engine leaves MLX (MemoryPlan.buffer_cache_bytes)


class MemoryBudgetError(ValueError):
    """The budget cannot hold the model, or asks for more than the device has."""


@dataclass(frozen=True)
class DeviceMemory:
    """What one device offers an engine, and where the figure came from (shown in the run summary)."""

    device: str                # "cuda" | "metal" | "cpu"
    name: str
    capacity_bytes: int        # the most an engine can use there
    free_bytes: int | None     # CUDA: free on the GPU now (all processes); None where the device does not say
    source: str


def host_ram_bytes() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def device_memory(device: str, info: Mapping[str, Any], host_ram: int) -> DeviceMemory:
    """`info` is MLX's `device_info()` for the device (empty for the CPU)."""
    name = str(info.get("device_name", device))
    if device == "cuda":
        total = int(info["total_memory"])
        free = info.get("free_memory")
        return DeviceMemory("cuda", name, total, None if free is None else int(free),
                            "GPU memory reported by the driver (mlx.core.device_info)")
    if device == "metal":
        return DeviceMemory("metal", name, int(info["max_recommended_working_set_size"]), None,
                            "Metal's recommended working set (unified memory, shared with host processes)")
    return DeviceMemory("cpu", name, host_ram, None, "physical RAM")


def nvidia_gpu_memory(load=None) -> DeviceMemory | None:
    """The smallest NVIDIA GPU on this machine, from NVML (the driver's library; no CUDA context, so the driver
    process can ask before any engine starts); None without one. `load` opens the library (tests fake it)."""
    import ctypes

    class Memory(ctypes.Structure):
        _fields_ = [("total", ctypes.c_ulonglong), ("free", ctypes.c_ulonglong), ("used", ctypes.c_ulonglong)]

    try:
        nvml = (load or ctypes.CDLL)("libnvidia-ml.so.1")
        if nvml.nvmlInit_v2() != 0:
            return None
        count = ctypes.c_uint()
        if nvml.nvmlDeviceGetCount_v2(ctypes.byref(count)) != 0 or count.value == 0:
            return None
        found = []
        for i in range(count.value):
            handle, mem, name = ctypes.c_void_p(), Memory(), ctypes.create_string_buffer(96)
            if nvml.nvmlDeviceGetHandleByIndex_v2(i, ctypes.byref(handle)) != 0:
                continue
            if nvml.nvmlDeviceGetMemoryInfo(handle, ctypes.byref(mem)) != 0:
                continue
            nvml.nvmlDeviceGetName(handle, name, 96)
            found.append((mem.total, mem.free, name.value.decode(errors="replace")))
    except (OSError, AttributeError):
        return None
    if not found:
        return None
    total, free, name = min(found)
    return DeviceMemory("cuda", name, int(total), int(free), "GPU memory reported by the driver (NVML)")


def local_device_memory(device_setting: str, *, gpu=nvidia_gpu_memory, platform: str | None = None,
                        host_ram: int | None = None) -> DeviceMemory | None:
    """What the engine's device will offer on this machine, as far as it can be known without starting it
    (`model.device` auto | gpu | cpu); None where only the engine can tell (Apple's working set, a GPU that
    NVML does not see)."""
    import sys

    ram = host_ram if host_ram is not None else host_ram_bytes()
    if device_setting == "cpu":
        return DeviceMemory("cpu", "cpu", ram, None, "physical RAM")
    found = gpu()
    if found is not None:
        return found
    if (platform or sys.platform) == "darwin" or device_setting == "gpu":
        return None
    return DeviceMemory("cpu", "cpu", ram, None, "physical RAM")


def read_device_memory(device: str) -> DeviceMemory:
    """The boundary: what MLX reports for `device` now."""
    import mlx.core as mx

    info = mx.device_info(mx.gpu) if device in ("cuda", "metal") else {}
    return device_memory(device, info, host_ram_bytes())


@dataclass(frozen=True)
class MemoryPlan:
    """The budget chosen at start and what it buys: recorded in the summary, stats JSON and Parquet metadata."""

    device: DeviceMemory
    budget_bytes: int
    source: str                # BUDGET_KEY, or how the device's figure became the budget
    weights_bytes: int
    activation_bytes: int
    kv_block_bytes: int
    kv_blocks: int
    block_size: int
    reused_bytes: int = 0      # one layer's buffers at the token budget (token_budget.reused_bytes_per_token); 0:
    # the whole forward's activations

    @property
    def kv_bytes(self) -> int:
        return self.kv_blocks * self.kv_block_bytes

    @property
    def buffer_cache_bytes(self) -> int:
        """How many freed device buffers MLX may keep for reuse: one layer's buffers (`reused_bytes`), never more
        than the forward's activations. The runner keeps only a few layers in flight (`runner.LAYER_LAG`) and
        every layer of a pass allocates the same sizes, so a layer's buffers come back out of this cache for the
        layers after it; a larger cache only keeps memory idle. MLX's own default is its whole memory limit;
        with the weights and the KV pool resident, a cache that large fills the device, and then every
        allocation the cache cannot serve first frees cached buffers, which slowed a Qwen3-VL-8B engine on an
        H100 more and more over a job."""
        reused = self.reused_bytes or self.activation_bytes
        return max(min(reused, self.activation_bytes), MIN_BUFFER_CACHE)

    def as_dict(self) -> dict[str, Any]:
        return {"budget_gb": round(self.budget_bytes / GIB, 2), "budget_source": self.source,
                "device": self.device.device, "device_name": self.device.name,
                "device_memory_gb": round(self.device.capacity_bytes / GIB, 2), "device_memory_source":
                self.device.source, "weights_gb": round(self.weights_bytes / GIB, 2),
                "activations_gb": round(self.activation_bytes / GIB, 2), "kv_blocks": self.kv_blocks,
                "kv_tokens": self.kv_blocks * self.block_size, "kv_gb": round(self.kv_bytes / GIB, 2),
                "buffer_cache_gb": round(self.buffer_cache_bytes / GIB, 2),
                "budget_bytes": self.budget_bytes, "weights_bytes": self.weights_bytes, "kv_bytes": self.kv_bytes}


def _gib(n: int) -> str:
    return f"{n / GIB:.1f} GiB"


def choose_budget(device: DeviceMemory, requested_gb: float | None, weights_bytes: int,
                  host_reserved: int = 0) -> tuple[int, str]:
    """(budget bytes, where it came from). `weights_bytes` are already resident when the device's free
    memory was read, so on CUDA they are added back to what is free. `host_reserved`: what the job's other
    processes hold (decoders, Ray's object store); it shares the device's memory on Apple silicon and on a CPU,
    so it comes off the default budget there (a GPU's own memory is not theirs)."""
    capacity = device.capacity_bytes
    if requested_gb is not None:
        budget = int(requested_gb * GIB)
        if budget > capacity:
            raise MemoryBudgetError(
                f"{BUDGET_KEY}: {requested_gb:g} GiB is more than the {device.device} device ({device.name}) holds: "
                f"{_gib(capacity)} ({device.source}); the weights take {_gib(weights_bytes)}. Set it to at most "
                f"{int(capacity / GIB)}, or to null to size it from the device")
        return budget, BUDGET_KEY
    if device.device == "cuda":
        if device.free_bytes is None:
            return int(capacity * (1 - CUDA_HEADROOM)), f"auto: {1 - CUDA_HEADROOM:.0%} of the GPU's memory"
        free = max(0, device.free_bytes - int(capacity * CUDA_HEADROOM))
        return weights_bytes + free, (f"auto: the weights + the GPU's free memory after them, less "
                                      f"{CUDA_HEADROOM:.0%} of the GPU")
    less = f", less {_gib(host_reserved)} for the job's other processes" if host_reserved else ""
    if device.device == "metal":
        return (max(0, int(capacity * METAL_SHARE) - host_reserved),
                f"auto: {METAL_SHARE:.0%} of Metal's recommended working set{less}")
    return max(0, int(capacity * CPU_SHARE) - host_reserved), f"auto: {CPU_SHARE:.0%} of RAM{less}"


def plan_memory(*, device: DeviceMemory, requested_gb: float | None, weights_bytes: int, activation: int,
                kv_block_bytes: int, block_size: int, blocks_per_request: int, max_blocks: int,
                host_reserved: int = 0, reused: int = 0) -> MemoryPlan:
    """The budget and the KV blocks it holds (at most `max_blocks`); MemoryBudgetError when it cannot hold the
    weights, one forward's activations and one maximum-length request. `reused`: one layer's buffers
    (`MemoryPlan.reused_bytes`)."""
    budget, source = choose_budget(device, requested_gb, weights_bytes, host_reserved)
    need = weights_bytes + activation + blocks_per_request * kv_block_bytes
    if budget < need:
        fix = (f"raise {BUDGET_KEY}" if requested_gb is not None else
               f"free memory on the {device.device} device ({device.name}: {_gib(device.capacity_bytes)}"
               + (f", {_gib(device.free_bytes)} free after the weights" if device.free_bytes is not None else "")
               + "), use a smaller or quantized checkpoint")
        raise MemoryBudgetError(
            f"memory budget {_gib(budget)} ({source}) cannot hold the weights ({_gib(weights_bytes)}), one "
            f"forward's activations ({_gib(activation)}) and the KV cache of one maximum-length request "
            f"({blocks_per_request} blocks, {_gib(blocks_per_request * kv_block_bytes)}); need {_gib(need)}. "
            f"{fix[0].upper() + fix[1:]}, or lower model.max_model_len / model.max_num_batched_tokens")
    blocks = min((budget - weights_bytes - activation) // kv_block_bytes, max_blocks)
    return MemoryPlan(device, budget, source, weights_bytes, activation, kv_block_bytes, int(blocks), block_size,
                      reused)
