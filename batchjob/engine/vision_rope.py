"""The vision towers' rotary embedding of q and k as one hand-written CUDA kernel.

MLX's compiled forms (fused_ops.py) read q and k of the stacked projection through broadcast tables and a reversed
or concatenated view with general strided indexing, slower than their bytes. The kernel reads the tables' fp32
halves once per token, and a thread takes four rotary pairs `(x[i], x[i + D/2])` of one head of q or k as 8-byte
words. It rounds as the portable form does (each product and their sum in fp32, then once to the dtype) except
where the compiler fused a product into the sum there (one fp32 rounding fewer): within a unit in the last place.

The towers call it for every block when it is active (`cuda_fused.select_fused_kernels` builds and checks it at
start against `portable_vision_rope`, on CUDA in half precision; `vision_attention.rotated_qkv` dispatches).
"""

from __future__ import annotations

from typing import Callable

import mlx.core as mx
import numpy as np

from . import kernel_build
from .fused_ops import rotate_half_rope
from .kernel_build import BITS, HALF_DTYPES, MLX_CONVERSIONS, THREADS, header_free_prelude, ulps_apart

_VISION_ROPE = r"""
    constexpr int HALF = D / 2;
    constexpr int GROUPS = HALF / 4;   // a thread takes four consecutive pairs: 8-byte loads of q/k, 16 of tables
    const long long idx = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    const long long tokens = qkv_shape[0];
    if (idx >= tokens * 2 * H * GROUPS) return;
    const int i = (int)(idx % GROUPS) * 4;
    long long rest = idx / GROUPS;
    const int h = (int)(rest % H);
    rest /= H;
    const int which = (int)(rest % 2);   // 0: q, 1: k
    const long long n = rest / 2;
    struct alignas(8) Quad { T v[4]; };   // four pairs' halves: one 8-byte load or store each
    const T* x = qkv + n * (3 * H * D) + (which * H + h) * D;
    const Quad a = *reinterpret_cast<const Quad*>(x + i);
    const Quad b = *reinterpret_cast<const Quad*>(x + i + HALF);
    const float4 c = *reinterpret_cast<const float4*>(cos_half + n * HALF + i);
    const float4 s = *reinterpret_cast<const float4*>(sin_half + n * HALF + i);
    const float cs[4] = {c.x, c.y, c.z, c.w};
    const float ss[4] = {s.x, s.y, s.z, s.w};
    float y1[4], y2[4];
    #pragma unroll
    for (int j = 0; j < 4; ++j) {
        // x * cos + rotate_half(x) * sin, each product and the sum rounded in fp32, then once to T
        const float x1 = LOAD_T(a.v[j]);
        const float x2 = LOAD_T(b.v[j]);
        y1[j] = __fadd_rn(__fmul_rn(x1, cs[j]), -__fmul_rn(x2, ss[j]));
        y2[j] = __fadd_rn(__fmul_rn(x2, cs[j]), __fmul_rn(x1, ss[j]));
    }
    union Words { Quad q; uint2 w; };   // the results stored as two 32-bit words (a Quad store came out split)
    Words r1, r2;
    #pragma unroll
    for (int j = 0; j < 4; ++j) {
        r1.q.v[j] = STORE_T(y1[j]);
        r2.q.v[j] = STORE_T(y2[j]);
    }
    T* o = out + ((n * 2 + which) * H + h) * D;
    *reinterpret_cast<uint2*>(o + i) = r1.w;
    *reinterpret_cast<uint2*>(o + i + HALF) = r2.w;
"""


def vision_rope_suits(dtype: mx.Dtype, head_dim: int) -> bool:
    """Half precision, and a rotary half of whole groups of four (8-byte words): head sizes 72, 80, 128 do."""
    return dtype in HALF_DTYPES and head_dim % 8 == 0


def _name(args: dict) -> str:
    return f"batchjob_vision_rope_{BITS[args['T']][1]}_{args['H']}_{args['D']}"


def precompiled_source(name: str, t: mx.Dtype, heads: int, d: int) -> str:
    """The kernel as one header-free translation unit for NVRTC (inputs, output, then the scalars: `qkv`'s two
    dimensions); the same body as MLX's build."""
    return (header_free_prelude(t, mx.float32) + f"""
extern "C" __global__ void {name}(const T* qkv, const float* cos_half, const float* sin_half, T* out,
                                  int qkv_tokens, int qkv_width) {{
    constexpr int H = {heads};
    constexpr int D = {d};
    const int qkv_shape[2] = {{qkv_tokens, qkv_width}};
""" + _VISION_ROPE + "}\n")


def _mlx_kernel():
    return mx.fast.cuda_kernel(name="batchjob_vision_rope", input_names=["qkv", "cos_half", "sin_half"],
                               output_names=["out"], source=_VISION_ROPE, header=MLX_CONVERSIONS)


def precompiled_kernel(compiler, fallback) -> Callable:
    """Built header-free per template by `compiler` (nvrtc.Compiler), `fallback()` where a compile fails."""
    return kernel_build.precompiled_kernel(compiler, fallback, _name,
                                           lambda name, a: precompiled_source(name, a["T"], a["H"], a["D"]),
                                           "vision_rope")


def build_kernel():
    """NVRTC's header-free build, else MLX's (which says why)."""
    return kernel_build.nvrtc_or_mlx("vision_rope", lambda nvrtc: precompiled_kernel(nvrtc, _mlx_kernel), _mlx_kernel)


def vision_rope_with(kernel) -> Callable[..., mx.array]:
    """q and k of a vision block's stacked projection `qkv [N, 3 * heads * head_dim]` rotated: `[N, 2, heads,
    head_dim]`. `cos_half`/`sin_half`: the rotary tables' halves `[N, head_dim / 2]` in float32 (the towers'
    halves repeat)."""

    def vision_rope(qkv: mx.array, heads: int, head_dim: int, cos_half: mx.array, sin_half: mx.array) -> mx.array:
        tokens = qkv.shape[0]
        (out,) = kernel(inputs=[qkv, cos_half, sin_half], template=[("T", qkv.dtype), ("H", heads), ("D", head_dim)],
                        grid=(tokens * heads * head_dim // 4, 1, 1), threadgroup=(THREADS, 1, 1),
                        output_shapes=[(tokens, 2, heads, head_dim)], output_dtypes=[qkv.dtype])
        return out

    return vision_rope


def portable_vision_rope(qkv: mx.array, heads: int, head_dim: int, cos_half: mx.array, sin_half: mx.array) -> mx.array:
    """What a vision block computes without the kernel (`vision_attention.rotated_qkv`'s rotate-half form, which
    its pair-swap form equals bit for bit): `[N, 2, heads, head_dim]`."""
    cos = mx.concatenate([cos_half, cos_half], axis=-1)[:, None, None, :]
    sin = mx.concatenate([sin_half, sin_half], axis=-1)[:, None, None, :]
    return rotate_half_rope(qkv.reshape(qkv.shape[0], 3, heads, head_dim)[:, :2], cos, sin)


# One fp32 rounding more or fewer (a product fused into the sum) moves the result by at most a unit; a wrong
# partner, sign, head or table row is off by about its own size.
MAX_ULPS = 4.0
CHECK_HEADS = (3, 80)   # heads, head size of the check where no model's are given


def check_vision_rope(vision_rope, dtype: mx.Dtype, heads: tuple[int, int] = CHECK_HEADS, seed: int = 0) -> str | None:
    """None when `vision_rope` matches the portable form on random heads and tables, else the problem. `heads`:
    the tower's (heads, head size), so the kernel compiled for the check is the one its blocks use."""
    rng = np.random.default_rng(seed)
    tokens, (h, d) = 37, heads
    qkv = mx.array(rng.normal(0, 2, (tokens, 3 * h * d)).astype(np.float32)).astype(dtype)
    freqs = rng.uniform(0, 40, (tokens, d // 2)).astype(np.float32)
    c, s = mx.array(np.cos(freqs)), mx.array(np.sin(freqs))
    ulps = ulps_apart(vision_rope(qkv, h, d, c, s), portable_vision_rope(qkv, h, d, c, s), dtype)
    if ulps > MAX_ULPS:
        return f"vision rotary differs from the portable form by {ulps:.1f} units in the last place"
    return None
