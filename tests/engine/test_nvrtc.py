"""Our CUDA kernels compiled header-free by NVRTC (engine/nvrtc.py; `cuda_fused.precompiled_source`,
`vision_rope.precompiled_source`).

NVRTC compiles without a GPU, so the source the engine hands it on an NVIDIA machine is compiled here for the
architectures we meet, every dtype pairing the engine can ask for; the loaders and the dispatch are checked with
stand-ins for the driver, NVRTC and MLX's precompiled-kernel call. What the kernel computes is checked on the GPU
at every start against the portable form (`check_qk_norm_rope`), and here through its NumPy statement
(test_cuda_fused.py).
"""
from __future__ import annotations

import importlib.util
from pathlib import Path

import mlx.core as mx
import pytest

from batchjob.engine import cuda_fused, nvrtc, vision_rope
from batchjob.engine.cuda_fused import precompiled_kernel, precompiled_source
from batchjob.engine.nvrtc import NvrtcError, Target, compile_cubin, load_nvrtc, loaded_library


PAIRS = [(mx.bfloat16, mx.bfloat16), (mx.bfloat16, mx.float32), (mx.float16, mx.float16), (mx.float16, mx.float32)]


@pytest.mark.parametrize("target", [Target(8, 0), Target(9, 0)])
@pytest.mark.parametrize("t,c", PAIRS)
def test_the_kernel_compiles_header_free_for_every_dtype_pairing(t, c, target, rng, wheel_nvrtc):
    lib = wheel_nvrtc
    hq, hk = int(rng.integers(1, 65)), int(rng.integers(1, 9))
    d = int(rng.choice([64, 128, 192, 256]))
    name = f"batchjob_qk_norm_rope_test_{hq}_{hk}_{d}"
    cubin = compile_cubin(lib, precompiled_source(name, t, c, hq, hk, d), name, target)
    # an ELF whose symbols hold the kernel under its unmangled name (what MLX asks the module for)
    assert cubin[:4] == b"\x7fELF" and b"\x00" + name.encode() + b"\x00" in cubin


@pytest.mark.parametrize("t,c", PAIRS)
def test_the_kernel_moves_rows_as_vectors_and_keeps_them_in_registers(t, c, rng, nvrtc_output):
    """What makes the kernel fast and that the start-up check cannot see: a lane's share of a head row (4
    elements at head size 128) is read and written as one 8-byte vector, several rows are read before any is
    reduced, and no array goes to local memory (an indexed register array would)."""
    hk = int(rng.integers(1, 9))
    hq = hk * int(rng.integers(1, 9))
    ptx = nvrtc_output(precompiled_source("batchjob_qk_test", t, c, hq, hk, 128),
                       ["--gpu-architecture=compute_90", "--std=c++17"], "ptx")
    loads, stores = ptx.count("ld.global.v4.u16"), ptx.count("st.global.v4.u16")
    assert loads >= 2 and stores >= 2, (loads, stores)
    assert ".local" not in ptx   # no local memory: no ld.local / st.local, no .local declaration


@pytest.mark.parametrize("target", [Target(8, 0), Target(9, 0)])
@pytest.mark.parametrize("t", [mx.bfloat16, mx.float16])
def test_the_towers_kernel_compiles_header_free(t, target, rng, wheel_nvrtc):
    heads, d = int(rng.integers(1, 33)), int(rng.choice([72, 80, 128]))
    name = f"batchjob_vision_rope_test_{heads}_{d}"
    cubin = compile_cubin(wheel_nvrtc, vision_rope.precompiled_source(name, t, heads, d), name, target)
    assert cubin[:4] == b"\x7fELF" and b"\x00" + name.encode() + b"\x00" in cubin


@pytest.mark.parametrize("t", [mx.bfloat16, mx.float16])
def test_the_towers_kernel_moves_quads_and_keeps_them_in_registers(t, rng, nvrtc_output):
    """Four pairs a thread: each half of q or k read as one 8-byte vector, the tables' halves as 16-byte vectors,
    no element-wise store, no local memory."""
    ptx = nvrtc_output(vision_rope.precompiled_source("batchjob_vision_test", t, int(rng.integers(1, 33)),
                                                      int(rng.choice([72, 80, 128]))),
                       ["--gpu-architecture=compute_90", "--std=c++17"], "ptx")
    assert ptx.count("ld.global.v4.u16") == 2 and ptx.count("ld.global.v4.f32") == 2, ptx
    assert "st.global.u16" not in ptx and ".local" not in ptx


def test_a_compile_error_carries_the_compilers_log(wheel_nvrtc):
    lib = wheel_nvrtc
    source = precompiled_source("k", mx.bfloat16, mx.bfloat16, 4, 2, 128).replace("rsqrtf", "no_such_function")
    with pytest.raises(NvrtcError, match="no_such_function"):
        compile_cubin(lib, source, "k", Target(9, 0))
    with pytest.raises(NvrtcError, match="sm_80 or higher"):   # bf16 conversions need Ampere
        compile_cubin(lib, precompiled_source("k", mx.bfloat16, mx.bfloat16, 4, 2, 128), "k", Target(7, 5))


def test_the_library_mlx_loaded_is_found_in_the_process_maps(tmp_path):
    maps = tmp_path / "maps"
    maps.write_text("7f0000-7f1000 r-xp 00000000 08:01 123 /opt/x/lib/libcudnn.so.9\n"
                    "7f2000-7f3000 r--p 00000000 00:00 0 \n"
                    "7f4000-7f5000 r-xp 00000000 08:01 456 /opt/site/nvidia/cu13/lib/libnvrtc.so.13\n")
    assert loaded_library("libnvrtc.so", str(maps)) == "/opt/site/nvidia/cu13/lib/libnvrtc.so.13"
    assert loaded_library("libnothing", str(maps)) is None
    assert loaded_library("libnvrtc.so", str(tmp_path / "absent")) is None


def test_load_nvrtc_tries_the_mapped_library_then_the_sonames(monkeypatch):
    tried = []

    def load(name):
        tried.append(name)
        if name != "libnvrtc.so.12":
            raise OSError(name)
        return "lib"

    monkeypatch.setattr(nvrtc, "loaded_library", lambda fragment: "/mapped/libnvrtc.so.13")
    assert load_nvrtc(load) == "lib" and tried == ["/mapped/libnvrtc.so.13", "libnvrtc.so.13", "libnvrtc.so.12"]
    monkeypatch.setattr(nvrtc, "loaded_library", lambda fragment: None)
    assert load_nvrtc(lambda name: (_ for _ in ()).throw(OSError(name))) is None


class _Driver:
    def __init__(self, major, minor, fail=None):
        self.values, self.fail = {75: major, 76: minor}, fail

    def cuInit(self, flags):
        return 100 if self.fail == "init" else 0

    def cuDeviceGet(self, dev, ordinal):
        return 0

    def cuDeviceGetAttribute(self, value, attr, dev):
        value._obj.value = self.values[attr]
        return 0


def test_the_target_is_the_devices_compute_capability():
    assert nvrtc.device_target(load=lambda name: _Driver(9, 0)) == Target(9, 0)
    assert nvrtc.device_target(load=lambda name: _Driver(8, 6)).arch == "sm_86"
    assert nvrtc.device_target(load=lambda name: _Driver(9, 0, fail="init")) is None
    assert nvrtc.device_target(load=lambda name: (_ for _ in ()).throw(OSError(name))) is None


def test_the_dispatch_compiles_once_per_template_and_falls_back_per_template(monkeypatch):
    compiled, ran, fell_back = [], [], []

    class Compiler:
        def cubin(self, name, source):
            compiled.append(name)
            if "_f16_" in name:
                raise NvrtcError("refused")
            assert f"void {name}(" in source
            return b"cubin-of-" + name.encode()

    def precompiled(**kw):
        ran.append(kw)
        return ["out"]

    def fallback():
        def kernel(**kw):
            fell_back.append(kw)
            return ["mlx-out"]
        return kernel

    monkeypatch.setattr(mx.fast, "precompiled_cuda_kernel", precompiled)
    kernel = precompiled_kernel(Compiler(), fallback)
    qkv = mx.zeros((7, 12, 128), dtype=mx.bfloat16)
    call = dict(grid=(7 * 10 * 32, 1, 1), threadgroup=(256, 1, 1), output_shapes=[(7, 10, 128)],
                output_dtypes=[mx.bfloat16])
    bf16 = [("T", mx.bfloat16), ("C", mx.float32), ("HQ", 8), ("HK", 2), ("D", 128)]
    for _ in range(3):
        assert kernel(inputs=[qkv] + [None] * 5, template=bf16, **call) == ["out"]
    assert compiled == ["batchjob_qk_norm_rope_bf16_f32_8_2_128"] and len(ran) == 3
    assert ran[0]["scalars"] == [7, 12] and ran[0]["compiled_source"] == b"cubin-of-" + compiled[0].encode()
    assert ran[0]["ensure_row_contiguous"] and ran[0]["grid"] == call["grid"]
    assert kernel.built_by == "NVRTC, header-free"
    f16 = [("T", mx.float16), ("C", mx.float16), ("HQ", 8), ("HK", 2), ("D", 128)]
    for _ in range(2):
        assert kernel(inputs=[qkv] + [None] * 5, template=f16, **call) == ["mlx-out"]
    assert compiled[1:] == ["batchjob_qk_norm_rope_f16_f16_8_2_128"] and len(fell_back) == 2
    assert fell_back[0]["template"] == f16
    assert kernel.built_by.startswith("MLX's cuda_kernel: NVRTC refused it (refused")


def test_the_runs_summary_says_how_the_kernel_was_built(monkeypatch):
    """select_fused_kernels on 'cuda' with stand-ins: the emulated kernel, dressed as each builder would leave it."""
    spec = importlib.util.spec_from_file_location("_fused_statement", Path(__file__).with_name("test_cuda_fused.py"))
    statement = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(statement)
    emulated_kernel = statement.emulated_kernel   # the kernel's NumPy statement

    def dressed(how):
        def build():
            kernel = emulated_kernel()
            kernel.built_by = how
            return kernel
        return build

    for how in ("NVRTC, header-free", "MLX's cuda_kernel: no NVRTC library in this process"):
        chosen = cuda_fused.select_fused_kernels("cuda", mx.bfloat16, build_qk_norm_rope=dressed(how))
        assert chosen.qk_norm_rope is not None and chosen.reason.endswith(f"; built by {how}"), chosen.reason
    plain = cuda_fused.select_fused_kernels("cuda", mx.bfloat16, build_qk_norm_rope=emulated_kernel)
    assert plain.reason == "the CUDA kernel matched the portable form at start"


def test_without_nvrtc_the_engine_keeps_mlxs_build(monkeypatch):
    monkeypatch.setattr(nvrtc, "compiler", lambda: "no NVRTC library in this process")
    monkeypatch.setattr(cuda_fused, "_mlx_qk_norm_rope_kernel", lambda: lambda **kw: ("mlx-kernel", kw))
    kernel = cuda_fused._qk_norm_rope_kernel()
    assert kernel(inputs=[1], template=[]) == ("mlx-kernel", {"inputs": [1], "template": []})
    assert kernel.built_by == "MLX's cuda_kernel: no NVRTC library in this process"


def test_compiled_kernels_are_kept_on_disk_by_source_and_architecture(tmp_path, monkeypatch):
    """A second process (a new Compiler) finds the cubin instead of compiling; another source or architecture
    compiles anew; an unwritable cache only costs the compile."""
    compiled = []

    def fake_compile(lib, source, name, target):
        compiled.append((name, target.arch))
        return f"cubin {name} {target.arch} {len(source)}".encode()

    monkeypatch.setattr(nvrtc, "compile_cubin", fake_compile)
    monkeypatch.setattr(nvrtc, "nvrtc_version", lambda lib: "12.9")
    first = nvrtc.Compiler(object(), Target(9, 0), tmp_path)
    assert first.cubin("k", "source one") == b"cubin k sm_90 10"
    assert nvrtc.Compiler(object(), Target(9, 0), tmp_path).cubin("k", "source one") == b"cubin k sm_90 10"
    assert compiled == [("k", "sm_90")]
    first.cubin("k", "source one", "sm_90a")
    first.cubin("k", "source two")
    assert compiled == [("k", "sm_90"), ("k", "sm_90a"), ("k", "sm_90")]
    assert len(list(tmp_path.glob("batchjob-k-*.cubin"))) == 3 and not list(tmp_path.glob("*.tmp"))
    monkeypatch.setattr(nvrtc, "nvrtc_version", lambda lib: "13.0")   # another NVRTC: compiled again
    first.cubin("k", "source one")
    assert len(compiled) == 4
    blocked = tmp_path / "not-a-dir"
    blocked.write_text("")
    assert nvrtc.Compiler(object(), Target(9, 0), blocked).cubin("k", "x") == b"cubin k sm_90 1"
    assert nvrtc.Compiler(object(), Target(9, 0)).cubin("k", "x") == b"cubin k sm_90 1"   # no cache at all



def test_the_towers_kernel_is_named_per_template_and_given_qkvs_dimensions(monkeypatch):
    compiled, ran = [], []

    class Compiler:
        def cubin(self, name, source):
            compiled.append(name)
            assert f"void {name}(" in source and "constexpr int H = 16;" in source and "constexpr int D = 80;" in source
            return b"cubin"

    monkeypatch.setattr(mx.fast, "precompiled_cuda_kernel", lambda **kw: ran.append(kw) or ["out"])
    kernel = vision_rope.precompiled_kernel(Compiler(), lambda: None)
    qkv = mx.zeros((9, 3 * 16 * 80), dtype=mx.float16)
    for _ in range(2):
        kernel(inputs=[qkv, None, None], template=[("T", mx.float16), ("H", 16), ("D", 80)], grid=(9 * 16 * 20, 1, 1),
               threadgroup=(256, 1, 1), output_shapes=[(9, 2, 16, 80)], output_dtypes=[mx.float16])
    assert compiled == ["batchjob_vision_rope_f16_16_80"] and [r["scalars"] for r in ran] == [[9, 3840]] * 2
