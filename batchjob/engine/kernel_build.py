"""How our half-precision CUDA kernels are built and checked, whichever kernel it is (cuda_fused.py's q/k norm +
rotary, vision_rope.py's towers' rotary).

Built header-free by NVRTC (engine/nvrtc.py) and run through `mx.fast.precompiled_cuda_kernel`:
`mx.fast.cuda_kernel` would compile each kernel with MLX's device headers in every process, which costs more than
a second of each start. A kernel's body is written once; only the conversions between float and the half types
differ in spelling between MLX's build (`MLX_CONVERSIONS`), which runs where NVRTC cannot be used, and the
header-free one (`header_free_prelude`). A kernel that fails to build or to match its portable form at start is
not used (`ulps_apart` is the start-up checks' measure).
"""

from __future__ import annotations

import logging
from typing import Callable

import mlx.core as mx
import numpy as np

log = logging.getLogger(__name__)

HALF_DTYPES = (mx.bfloat16, mx.float16)
THREADS = 256

# The bodies' conversions, as MLX's headers give them (T and C are CUDA's half types or float there)
MLX_CONVERSIONS = r"""
#define LOAD_T(v) static_cast<float>(v)
#define LOAD_C(v) static_cast<float>(v)
#define ROUND_T(v) static_cast<float>(static_cast<T>(v))
#define STORE_T(v) static_cast<T>(v)
"""

# Header-free: half types as their 16 bits, converted with the PTX instructions cuda_bf16.h / cuda_fp16.h use
# (round to nearest even; exact widening).
_BITS_CONVERSIONS = r"""
__device__ __forceinline__ float bf16_to_float(unsigned short h) {
    union { unsigned int u; float f; } w; w.u = ((unsigned int)h) << 16; return w.f;
}
__device__ __forceinline__ unsigned short float_to_bf16(float x) {
    unsigned short r; asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(r) : "f"(x)); return r;
}
__device__ __forceinline__ float f16_to_float(unsigned short h) {
    float f; asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h)); return f;
}
__device__ __forceinline__ unsigned short float_to_f16(float x) {
    unsigned short r; asm("cvt.rn.f16.f32 %0, %1;" : "=h"(r) : "f"(x)); return r;
}
__device__ __forceinline__ float f32_to_float(float x) { return x; }
"""
BITS = {mx.bfloat16: ("unsigned short", "bf16"), mx.float16: ("unsigned short", "f16"), mx.float32: ("float", "f32")}


def header_free_prelude(t: mx.Dtype, c: mx.Dtype) -> str:
    """The conversions, the macros a body uses and the typedefs of `T` (the activations) and `C` (the tables)."""
    (t_type, t_tag), (c_type, c_tag) = BITS[t], BITS[c]
    return (_BITS_CONVERSIONS + f"""
#define LOAD_T(v) {t_tag}_to_float(v)
#define LOAD_C(v) {c_tag}_to_float(v)
#define ROUND_T(v) {t_tag}_to_float(float_to_{t_tag}(v))
#define STORE_T(v) float_to_{t_tag}(v)
typedef {t_type} T;
typedef {c_type} C;
""")


def precompiled_kernel(compiler, fallback: Callable[[], Callable], name_of: Callable[[dict], str],
                       source_of: Callable[[str, dict], str], label: str) -> Callable:
    """`mx.fast.cuda_kernel`'s calling convention over a kernel `compiler` (nvrtc.Compiler) builds header-free
    per template (`name_of(template)`, `source_of(name, template)`; the scalars are the first input's two
    dimensions); `fallback()` (MLX's build) serves a template whose compile fails. `label` names the kernel in
    the log."""
    built: dict[tuple, Callable] = {}

    def build(template) -> Callable:
        args = dict(template)
        name = name_of(args)
        try:
            cubin = compiler.cubin(name, source_of(name, args))
        except Exception as err:   # NVRTC refused it: MLX's own build of the same body
            log.info("%s: NVRTC build failed (%s); MLX's cuda_kernel builds it", label, str(err)[:300])
            kernel.built_by = f"MLX's cuda_kernel: NVRTC refused it ({str(err).splitlines()[0][:120]})"
            return fallback()

        def run(*, inputs, template, grid, threadgroup, output_shapes, output_dtypes):
            return mx.fast.precompiled_cuda_kernel(
                name=name, compiled_source=cubin, inputs=inputs, output_shapes=output_shapes,
                output_dtypes=output_dtypes, scalars=[int(inputs[0].shape[0]), int(inputs[0].shape[1])], grid=grid,
                threadgroup=threadgroup, ensure_row_contiguous=True)
        return run

    def kernel(*, inputs, template, grid, threadgroup, output_shapes, output_dtypes):
        key = tuple(template)
        if key not in built:
            built[key] = build(template)
        return built[key](inputs=inputs, template=template, grid=grid, threadgroup=threadgroup,
                          output_shapes=output_shapes, output_dtypes=output_dtypes)

    kernel.built_by = "NVRTC, header-free"   # for the run's summary; says so where a template fell back
    return kernel


def nvrtc_or_mlx(label: str, precompiled: Callable[[object], Callable], mlx_build: Callable[[], Callable]) -> Callable:
    """The kernel as NVRTC builds it header-free (`precompiled(compiler)`), else MLX's build, which says why."""
    from .nvrtc import compiler

    nvrtc = compiler()
    if isinstance(nvrtc, str):
        log.info("%s: %s; MLX's cuda_kernel builds it", label, nvrtc)
        mlx_kernel = mlx_build()

        def kernel(**kwargs):
            return mlx_kernel(**kwargs)
        kernel.built_by = f"MLX's cuda_kernel: {nvrtc}"
        return kernel
    return precompiled(nvrtc)


def ulps_apart(got: mx.array, want: mx.array, dtype: mx.Dtype) -> float:
    """Largest |got - want| in units of the dtype's spacing at the larger of the two, and never below the spacing
    at the values' root mean square: a rounding of a typical operand counts once even where products cancel
    to a small result, while a wrong element (a wrong partner, weight or row) is many units off."""
    g = np.array(got.astype(mx.float32)).ravel()
    w = np.array(want.astype(mx.float32)).ravel()
    if g.shape != w.shape:
        return float("inf")
    if not g.size:
        return 0.0
    mantissa = 7 if dtype == mx.bfloat16 else 10
    floor = max(float(np.sqrt(np.mean(w.astype(np.float64) ** 2))), 1e-30)
    scale = np.maximum(np.maximum(np.abs(w), np.abs(g)), floor)
    spacing = np.exp2(np.floor(np.log2(scale)) - mantissa)
    ulps = np.abs(g - w) / spacing
    return float(np.max(np.where(np.isfinite(g) & np.isfinite(w), ulps, np.inf)))
