"""Our CUDA kernels compiled by NVRTC directly, header-free, for `mx.fast.precompiled_cuda_kernel`.

Why: `mx.fast.cuda_kernel` compiles its source in every process that first runs it (MLX keeps no disk cache for
custom kernels), with MLX's device headers in front of it; on an H100 that costs over a second of each engine's
start. A source that needs no header compiles in a small fraction of that. NVRTC is the library MLX's CUDA
backend itself links, so it is already loaded in any process where MLX runs on CUDA; it is found there
(/proc/self/maps) rather than searched for. Without NVRTC or a driver, `compiler()` says why instead of giving
a Compiler; a source NVRTC refuses (an architecture it cannot target, an error) raises NvrtcError with its log.
Either way the caller keeps MLX's own build.
"""
from __future__ import annotations

import ctypes
import functools
import hashlib
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from .kernel_cache import KERNEL_CACHE_ENV

CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR = 75
CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR = 76
NVRTC_NAMES = ("libnvrtc.so.13", "libnvrtc.so.12", "libnvrtc.so")


class NvrtcError(RuntimeError):
    """A compile that failed: NVRTC's message and the program's log."""


def loaded_library(fragment: str, maps: str = "/proc/self/maps") -> str | None:
    """Path of a shared library this process has mapped whose file name contains `fragment`, or None."""
    try:
        text = Path(maps).read_text()
    except OSError:
        return None
    for line in text.splitlines():
        fields = line.split(maxsplit=5)   # address, perms, offset, device, inode, then the path if any
        path = fields[5] if len(fields) == 6 else ""
        if path.startswith("/") and fragment in Path(path).name:
            return path
    return None


def load_nvrtc(load: Callable[[str], Any] = ctypes.CDLL) -> Any | None:
    """The NVRTC library MLX loaded (else the first of NVRTC_NAMES that opens), or None."""
    for name in filter(None, (loaded_library("libnvrtc.so"), *NVRTC_NAMES)):
        try:
            return load(name)
        except OSError:
            continue
    return None


@dataclass(frozen=True)
class Target:
    """What to compile for: `sm_XY` code for the device's compute capability."""

    major: int
    minor: int

    @property
    def arch(self) -> str:
        return f"sm_{self.major}{self.minor}"


def device_target(device: int = 0, load: Callable[[str], Any] = ctypes.CDLL) -> Target | None:
    """The compute capability of CUDA device `device` from the driver, or None without one."""
    try:
        driver = load("libcuda.so.1")
        value, dev = ctypes.c_int(), ctypes.c_int()
        if driver.cuInit(0) != 0 or driver.cuDeviceGet(ctypes.byref(dev), device) != 0:
            return None
        attrs = []
        for attr in (CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR):
            if driver.cuDeviceGetAttribute(ctypes.byref(value), attr, dev) != 0:
                return None
            attrs.append(value.value)
    except (OSError, AttributeError):
        return None
    return Target(*attrs)


def _check(nvrtc, status: int, what: str, log_text: str = "") -> None:
    if status != 0:
        nvrtc.nvrtcGetErrorString.restype = ctypes.c_char_p
        message = nvrtc.nvrtcGetErrorString(status)
        message = message.decode() if isinstance(message, bytes) else str(status)
        raise NvrtcError(f"{what}: {message}" + (f"\n{log_text}" if log_text else ""))


def compile_cubin(nvrtc, source: str, name: str, target: Target) -> bytes:
    """`source` compiled for `target` into a cubin (NvrtcError on failure, with the compiler's log)."""
    prog = ctypes.c_void_p()
    _check(nvrtc, nvrtc.nvrtcCreateProgram(ctypes.byref(prog), source.encode(), f"{name}.cu".encode(), 0, None, None),
           "nvrtcCreateProgram")
    try:
        options = [f"--gpu-architecture={target.arch}".encode(), b"--std=c++17"]
        status = nvrtc.nvrtcCompileProgram(prog, len(options), (ctypes.c_char_p * len(options))(*options))
        size = ctypes.c_size_t()
        text = ""
        if status != 0 and nvrtc.nvrtcGetProgramLogSize(prog, ctypes.byref(size)) == 0:
            buf = ctypes.create_string_buffer(size.value)
            nvrtc.nvrtcGetProgramLog(prog, buf)
            text = buf.value.decode(errors="replace")
        _check(nvrtc, status, f"compiling {name} for {target.arch}", text)
        _check(nvrtc, nvrtc.nvrtcGetCUBINSize(prog, ctypes.byref(size)), "nvrtcGetCUBINSize")
        buf = ctypes.create_string_buffer(size.value)
        _check(nvrtc, nvrtc.nvrtcGetCUBIN(prog, buf), "nvrtcGetCUBIN")
        return buf.raw
    finally:
        nvrtc.nvrtcDestroyProgram(ctypes.byref(prog))


def nvrtc_version(nvrtc) -> str:
    """NVRTC's version, e.g. "12.9" (part of a cached cubin's key)."""
    major, minor = ctypes.c_int(), ctypes.c_int()
    if nvrtc.nvrtcVersion(ctypes.byref(major), ctypes.byref(minor)) != 0:
        return "unknown"
    return f"{major.value}.{minor.value}"


@dataclass(frozen=True)
class Compiler:
    """NVRTC bound to the device's target. Its caller builds each kernel once per process
    (`cuda_fused.precompiled_kernel`, `cuda_attention.HopperKernel`); across processes the cubins are kept in
    `cache_dir` (the user's kernel cache, beside MLX's), keyed by source, architecture and NVRTC's version, so a
    start finds them instead of compiling. `arch` overrides the target's (`sm_90a` for Hopper's `wgmma`)."""

    nvrtc: Any
    target: Target
    cache_dir: Path | None = None

    def cubin(self, name: str, source: str, arch: str | None = None) -> bytes:
        target = _Arch(arch) if arch else self.target
        cached = None
        if self.cache_dir is not None:
            key = hashlib.sha256(f"{target.arch}\0{nvrtc_version(self.nvrtc)}\0{source}".encode()).hexdigest()
            cached = self.cache_dir / f"batchjob-{name}-{key[:24]}.cubin"
            try:
                return cached.read_bytes()
            except OSError:
                pass
        binary = compile_cubin(self.nvrtc, source, name, target)
        if cached is not None:
            try:   # written whole, then renamed: a concurrent start reads either nothing or the whole cubin
                partial = cached.with_suffix(f".{os.getpid()}.tmp")
                partial.write_bytes(binary)
                partial.replace(cached)
            except OSError:   # an unwritable cache costs only the compile
                pass
        return binary


@dataclass(frozen=True)
class _Arch:
    arch: str


@functools.lru_cache(maxsize=1)
def compiler() -> Compiler | str:
    """This process's Compiler, or why there is none."""
    nvrtc = load_nvrtc()
    if nvrtc is None:
        return "no NVRTC library in this process"
    target = device_target()
    if target is None:
        return "no CUDA driver or device to read the compute capability from"
    cache = os.environ.get(KERNEL_CACHE_ENV)   # set by device.activate (keep_compiled_kernels)
    return Compiler(nvrtc, target, Path(cache) if cache else None)
