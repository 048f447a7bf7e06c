"""Shared fixtures for metal_backend tests: a per-run random seed and the float64 dense reference."""

from __future__ import annotations

import hashlib
import os
import secrets
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest


@pytest.fixture
def rng(request) -> np.random.Generator:
    """Fresh randomness every run; set BATCHJOB_TEST_SEED to replay a failure (the seed is printed)."""
    seed = int(os.environ.get("BATCHJOB_TEST_SEED", secrets.randbits(32)))
    print(f"{request.node.nodeid}: BATCHJOB_TEST_SEED={seed}")
    return np.random.default_rng(seed)


def _dense_reference(batch, scale: float) -> np.ndarray:
    """Independent oracle: per-sequence dense attention in float64 on the contiguous K/V, GQA by repeating
    KV heads, causal with the context offset written out as an explicit visibility matrix."""
    hq, hkv = batch.q_host.shape[1], batch.k_seqs[0].shape[1]
    group = hq // hkv
    out = np.zeros_like(batch.q_host)
    start = 0
    for ql, ctx, k, v in zip(batch.q_lens, batch.context_lens, batch.k_seqs, batch.v_seqs):
        q = batch.q_host[start : start + ql]
        kh, vh = np.repeat(k, group, axis=1), np.repeat(v, group, axis=1)
        scores = np.einsum("qhd,khd->hqk", q, kh) * scale
        visible = np.arange(ctx)[None, :] < (ctx - ql + np.arange(ql) + 1)[:, None]
        scores = np.where(visible[None], scores, -np.inf)
        p = np.exp(scores - scores.max(-1, keepdims=True))
        out[start : start + ql] = np.einsum("hqk,khd->qhd", p / p.sum(-1, keepdims=True), vh)
        start += ql
    return out


@pytest.fixture
def dense_reference():
    return _dense_reference


# --- CPU emulator for the Metal kernels ---------------------------------------------------------------------
# The kernels cannot run here (no Metal), so the tests compile the exact kernel text with g++ against a small
# shim (metal_shim.hpp) that runs each threadgroup's threads as fibers with a real simd_sum and real barriers. The
# signature is written the way mx.fast.metal_kernel writes it, including `constant` for inputs under 8
# elements; the launch (grid, template constants, inputs) is the one the product computes.

_ATTRIBUTES = [  # MLX's order; an attribute is passed only when the body names it
    ("simdgroup_index_in_threadgroup", "uint"), ("thread_index_in_simdgroup", "uint"),
    ("thread_position_in_grid", "uint3"), ("thread_position_in_threadgroup", "uint3"),
    ("threadgroup_position_in_grid", "uint3"),
]
_CTYPES = {"float32": ("float", np.float32), "float16": ("float16_t", np.float16), "int32": ("int", np.int32)}

_MAIN = r"""
template <typename V> static std::vector<V> load(const std::string& path) {
    std::ifstream f(path, std::ios::binary | std::ios::ate);
    const size_t n = size_t(f.tellg()) / sizeof(V);
    std::vector<V> v(n);
    f.seekg(0);
    f.read(reinterpret_cast<char*>(v.data()), n * sizeof(V));
    return v;
}
int main(int, char** argv) {
    const std::string dir = argv[1];
    %(loads)s
    std::vector<%(out_t)s> out(%(out_n)d);
    const uint3 grid = {%(grid)s}, tg = {%(tg)s};
    const uint n = tg.x * tg.y * tg.z;
    std::vector<EmuFiber> fibers(n);
    for (auto& f : fibers) f.stack.resize(256 * 1024);
    for (uint gz = 0; gz < grid.z / tg.z; ++gz)
    for (uint gy = 0; gy < grid.y / tg.y; ++gy)
    for (uint gx = 0; gx < grid.x / tg.x; ++gx) {
        emu_thread_body = [&](uint tid) {
            const uint3 local = {tid %% tg.x, (tid / tg.x) %% tg.y, tid / (tg.x * tg.y)};
            const uint3 group = {gx, gy, gz};
            const uint3 global = {gx * tg.x + local.x, gy * tg.y + local.y, gz * tg.z + local.z};
            (void)local; (void)group; (void)global;
            %(pre)s
            kernel_fn<%(targs)s>(%(call)s);
        };
        emu_run_threadgroup(fibers, n);
    }
    std::ofstream(dir + "/out.bin", std::ios::binary).write(reinterpret_cast<const char*>(out.data()), out.size() * sizeof(out[0]));
    return 0;
}
"""


def _run(cmd: list[str], what: str) -> None:
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    if done.returncode:
        raise AssertionError(f"{what} failed ({done.returncode}):\n{done.stderr[-4000:]}")


class MetalEmulator:
    def __init__(self, workdir: Path):
        self.workdir = workdir
        self.compiler = shutil.which("g++")

    def __call__(self, launch) -> np.ndarray:
        from batchjob.metal_backend.kernels import kernel_source

        body = kernel_source(f"paged_attention_{launch.kind}.metal")
        header = kernel_source("paged_attention_common.metal")
        arrays = [(name, np.array(a), str(a.dtype).split(".")[-1]) for name, a in launch.inputs]
        params, loads, call = [], [], []
        for name, arr, dt in arrays:
            ctype = _CTYPES[dt][0]
            space = "constant" if arr.size < 8 else "device"
            params.append(f"const {space} {ctype}* {name}")
            loads.append(f"auto {name}_buf = load<{ctype}>(dir + \"/{name}.bin\");")
            call.append(f"{name}_buf.data()")
        out_t = _CTYPES[str(launch.output_dtype).split(".")[-1]][0]
        params.append(f"device {out_t}* out")
        call.append("out.data()")
        values = {"simdgroup_index_in_threadgroup": "tid / 32", "thread_index_in_simdgroup": "tid % 32",
                  "thread_position_in_grid": "global", "thread_position_in_threadgroup": "local",
                  "threadgroup_position_in_grid": "group"}
        for attr, ctype in _ATTRIBUTES:
            if attr in body:
                params.append(f"{ctype} {attr}")
                call.append(values[attr])
        tparams = ", ".join(("typename " if k == "T" else "int ") + k for k, _ in launch.template)
        targs = ", ".join(_CTYPES[str(v).split(".")[-1]][0] if k == "T" else str(v) for k, v in launch.template)
        src = (f'#include "metal_shim.hpp"\n{header}\ntemplate <{tparams}>\nvoid kernel_fn({", ".join(params)}) {{\n'
               f"{body}\n}}\n" + _MAIN % dict(loads="\n    ".join(loads), out_t=out_t,
                                              out_n=int(np.prod(launch.output_shape)),
                                              grid=", ".join(map(str, launch.grid)),
                                              tg=", ".join(map(str, launch.threadgroup)), targs=targs,
                                              call=", ".join(call), pre=""))
        return self._build_and_run(src, arrays, launch)

    def _build_and_run(self, src: str, arrays, launch) -> np.ndarray:
        key = hashlib.sha256(src.encode()).hexdigest()[:16]
        binary = self.workdir / f"kernel_{key}"
        if not binary.exists():
            cpp = self.workdir / f"kernel_{key}.cpp"
            cpp.write_text(src)
            _run([self.compiler, "-std=c++17", "-O1", "-w", f"-I{Path(__file__).parent}", str(cpp), "-o",
                  str(binary)], "compiling the kernel for the emulator")
        run_dir = self.workdir / f"run_{key}_{secrets.token_hex(4)}"
        run_dir.mkdir()
        for name, arr, dt in arrays:
            arr.astype(_CTYPES[dt][1]).tofile(run_dir / f"{name}.bin")
        _run([str(binary), str(run_dir)], "running the emulated kernel")
        out = np.fromfile(run_dir / "out.bin", dtype=_CTYPES[str(launch.output_dtype).split(".")[-1]][1])
        return out.reshape(launch.output_shape)


@pytest.fixture(scope="session")
def metal_emulator(tmp_path_factory):
    emulator = MetalEmulator(tmp_path_factory.mktemp("metal_emulator"))
    if emulator.compiler is None:
        pytest.skip("g++ not found: the CPU emulator for the Metal kernels needs a C++17 compiler")
    return emulator
