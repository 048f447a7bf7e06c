"""Qwen3's per-head q/k RMSNorm and the rotary embedding after it as one hand-written CUDA kernel.

On NVIDIA GPUs the decoder layer's GEMMs run near the measured ceiling; what is left beyond them is passes over
activations. In MLX the q/k norm is a row reduction over 128-wide rows (slow on its CUDA backend), a rounding
to the input's dtype, then a rotary kernel: three passes over q and k. The kernel gives one warp a token: its
head rows in turn, each read and written once as vectors, the sum of squares by shuffles, the rotary partner
half from the lane 16 away; the token's rotary tables and the weights are read once for all its rows.
(SwiGLU and the vision blocks' norms were tried the same way and dropped: docs/cuda_kernels.md says what
each measured.) The vision towers' rotary embedding is a kernel of its own (vision_rope.py); this module chooses
both at start.

The kernel rounds where MLX's path rounds (the norm's output to the input's dtype before the weight, the weight
product, each rotary product and their sum), so it agrees with it except where a float sum of squares taken in
another order moves a rounding: a unit in the last place of a typical element. The engine builds the kernels once
at start on CUDA in half precision and compares each with its portable form on random inputs at the model's head
counts (`select_fused_kernels`); a kernel that fails to build or to match is not used, and the reason is in the
run's summary. Elsewhere (CPU, Metal, float32) nothing is built and the portable forms run. Both are built
header-free by NVRTC where it can be used (kernel_build.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import mlx.core as mx
import numpy as np

from . import kernel_build, vision_rope
from .fused_ops import RotaryTables, rope_heads, split_tables
from .kernel_build import BITS, HALF_DTYPES, MLX_CONVERSIONS, THREADS, header_free_prelude, ulps_apart

_QK_NORM_ROPE = r"""
    // One warp per token: its HQ + HK head rows in turn, with the rotary tables and the norms' weights read once
    // for all of them. A lane holds E consecutive elements of a row (the rotary partner in the lane 16 away)
    // and moves them as one vector; UNROLL rows are read before any is reduced, so each warp keeps that many
    // reads in flight.
    constexpr int E = D / 32;
    constexpr int ROWS = HQ + HK;
    constexpr int UNROLL = 4;
    constexpr int ALIGN = (int)(sizeof(T) * E) & -(int)(sizeof(T) * E);   // the largest power of two dividing it
    struct alignas(ALIGN) Row { T v[E]; };
    const long long t = ((long long)blockIdx.x * blockDim.x + threadIdx.x) / 32;
    const int lane = threadIdx.x & 31;
    const long long tokens = qkv_shape[0];
    const int heads = qkv_shape[1];
    if (t >= tokens) return;   // a warp's lanes share `t`: whole warps leave together
    float c[E], s[E], wq[E], wk[E];
    #pragma unroll
    for (int i = 0; i < E; ++i) {
        c[i] = LOAD_C(cos_table[t * D + lane * E + i]);
        s[i] = LOAD_C(sin_table[t * D + lane * E + i]);
        wq[i] = LOAD_T(q_weight[lane * E + i]);
        wk[i] = LOAD_T(k_weight[lane * E + i]);
    }
    const float epsilon = eps[0];   // read once: the stores below could alias it as far as the compiler knows
    const T* x = qkv + t * heads * D + lane * E;
    T* o = out + t * ROWS * D + lane * E;
    constexpr bool ROUND_TABLES = sizeof(C) == sizeof(T);
    #pragma unroll 1
    for (int h0 = 0; h0 < ROWS; h0 += UNROLL) {
        float v[UNROLL][E];
        float squares[UNROLL];
        #pragma unroll
        for (int u = 0; u < UNROLL; ++u) {
            squares[u] = 0.0f;
            if (h0 + u < ROWS) {
                const Row r = *reinterpret_cast<const Row*>(x + (h0 + u) * D);
                #pragma unroll
                for (int i = 0; i < E; ++i) {
                    v[u][i] = LOAD_T(r.v[i]);
                    squares[u] += v[u][i] * v[u][i];
                }
            }
        }
        #pragma unroll
        for (int offset = 16; offset > 0; offset >>= 1) {
            #pragma unroll
            for (int u = 0; u < UNROLL; ++u) {
                squares[u] += __shfl_xor_sync(0xffffffffu, squares[u], offset);
            }
        }
        #pragma unroll
        for (int u = 0; u < UNROLL; ++u) {
            const int h = h0 + u;
            if (h >= ROWS) break;   // uniform across the warp: the shuffles below see every lane
            const float inv = rsqrtf(squares[u] / D + epsilon);
            Row r;
            #pragma unroll
            for (int i = 0; i < E; ++i) {
                const float normed = ROUND_T(v[u][i] * inv);
                v[u][i] = ROUND_T(normed * (h < HQ ? wq[i] : wk[i]));
            }
            #pragma unroll
            for (int i = 0; i < E; ++i) {
                const float partner = __shfl_xor_sync(0xffffffffu, v[u][i], 16);   // element i + D/2 (or i - D/2)
                const float rotated = lane < 16 ? -partner : partner;
                float a = v[u][i] * c[i];
                float b = rotated * s[i];
                if (ROUND_TABLES) {
                    a = ROUND_T(a);
                    b = ROUND_T(b);
                }
                r.v[i] = STORE_T(a + b);
            }
            *reinterpret_cast<Row*>(o + h * D) = r;
        }
    }
"""


def _qk_name(args: dict) -> str:
    return (f"batchjob_qk_norm_rope_{BITS[args['T']][1]}_{BITS[args['C']][1]}_{args['HQ']}_{args['HK']}_"
            f"{args['D']}")


def precompiled_source(name: str, t: mx.Dtype, c: mx.Dtype, hq: int, hk: int, d: int) -> str:
    """The kernel as one header-free translation unit for NVRTC (`mx.fast.precompiled_cuda_kernel`'s convention:
    the inputs, the output, then the scalars: `qkv`'s tokens and heads); the same body as MLX's build."""
    return (header_free_prelude(t, c) + f"""
extern "C" __global__ void {name}(const T* qkv, const T* q_weight, const T* k_weight, const C* cos_table,
                                  const C* sin_table, const float* eps, T* out, int qkv_tokens, int qkv_heads) {{
    constexpr int HQ = {hq};
    constexpr int HK = {hk};
    constexpr int D = {d};
    const int qkv_shape[2] = {{qkv_tokens, qkv_heads}};
""" + _QK_NORM_ROPE + "}\n")


def _mlx_qk_norm_rope_kernel():
    return mx.fast.cuda_kernel(name="batchjob_qk_norm_rope",
                               input_names=["qkv", "q_weight", "k_weight", "cos_table", "sin_table", "eps"],
                               output_names=["out"], source=_QK_NORM_ROPE, header=MLX_CONVERSIONS)


def precompiled_kernel(compiler, fallback) -> Callable:
    """The q/k kernel built header-free per template by `compiler` (nvrtc.Compiler), `fallback()` (MLX's build)
    where a template's compile fails."""
    return kernel_build.precompiled_kernel(
        compiler, fallback, _qk_name,
        lambda name, a: precompiled_source(name, a["T"], a["C"], a["HQ"], a["HK"], a["D"]), "qk_norm_rope")


def _qk_norm_rope_kernel():
    """The kernel as NVRTC builds it header-free (a fraction of MLX's compile time at each start), else MLX's."""
    return kernel_build.nvrtc_or_mlx("qk_norm_rope", lambda nvrtc: precompiled_kernel(nvrtc, _mlx_qk_norm_rope_kernel),
                                     _mlx_qk_norm_rope_kernel)


def qk_norm_rope_suits(dtype: mx.Dtype, head_dim: int) -> bool:
    """Half precision; a warp's 32 lanes split a head row evenly, the rotary halves on lanes 0-15 and 16-31."""
    return dtype in HALF_DTYPES and head_dim % 64 == 0 and head_dim <= 256


@dataclass(frozen=True)
class FusedKernels:
    """The kernels in use (None: the portable form runs) and why, for the run's summary."""

    qk_norm_rope: Callable[..., mx.array] | None = None
    vision_rope: Callable[..., mx.array] | None = None
    reason: str = "not built"

    def summary(self) -> str:
        used = [name for name in ("qk_norm_rope", "vision_rope") if getattr(self, name) is not None]
        return f"{', '.join(used) or 'none'} ({self.reason})"


def qk_norm_rope_with(kernel) -> Callable[..., mx.array]:
    """RMSNorm then rotary for the first `hq + hkv` heads of `qkv [T, heads, D]` (q's heads first, then k's):
    `[T, hq + hkv, D]`. `cos`/`sin` `[T, D]` are the rotate-half tables; `q_norm`/`k_norm` MLX RMSNorms."""

    eps_arrays: dict[float, mx.array] = {}

    def qk_norm_rope(qkv: mx.array, hq: int, hkv: int, q_norm, k_norm, cos: mx.array, sin: mx.array) -> mx.array:
        tokens, _, d = qkv.shape
        if q_norm.eps != k_norm.eps:
            raise ValueError(f"q_norm eps {q_norm.eps} and k_norm eps {k_norm.eps} differ: the kernel takes one")
        eps = eps_arrays.setdefault(q_norm.eps, mx.array([q_norm.eps], dtype=mx.float32))
        (out,) = kernel(inputs=[qkv, q_norm.weight.astype(qkv.dtype), k_norm.weight.astype(qkv.dtype), cos, sin, eps],
                        template=[("T", qkv.dtype), ("C", cos.dtype), ("HQ", hq), ("HK", hkv), ("D", d)],
                        grid=(tokens * 32, 1, 1), threadgroup=(THREADS, 1, 1),
                        output_shapes=[(tokens, hq + hkv, d)], output_dtypes=[qkv.dtype])
        return out

    return qk_norm_rope


def portable_qk_norm_rope(qkv: mx.array, hq: int, hkv: int, q_norm, k_norm, cos: mx.array, sin: mx.array,
                          tables: RotaryTables | None = None) -> mx.array:
    """What the layer computes without the kernel (the reference of the start-up check): `[T, hq + hkv, D]`."""
    q, k = q_norm(qkv[:, :hq]), k_norm(qkv[:, hq:hq + hkv])
    c, s = cos[:, None, :], sin[:, None, :]
    t = tables or split_tables(c, s)
    return mx.concatenate([rope_heads(q, hq, c, s, t), rope_heads(k, hkv, c, s, t)], axis=1)


class _Norm:
    """An RMSNorm's weight and eps, as the kernels read them (MLX's `nn.RMSNorm` has the same attributes)."""

    def __init__(self, weight: mx.array, eps: float):
        self.weight, self.eps = weight, eps

    def __call__(self, x: mx.array) -> mx.array:
        return mx.fast.rms_norm(x, self.weight, self.eps)


# A sum of squares taken in another order moves a rounding of an element by a step of its own size (up to a few
# times the root mean square: measured 2 units at the 8B shapes); a wrong element is off by its own size, over
# a hundred units.
MAX_ULPS = 8.0


CHECK_HEADS = (4, 2, 128)   # q heads, kv heads, head size of the check where no model's are given


def check_qk_norm_rope(qk_norm_rope, dtype: mx.Dtype, heads: tuple[int, int, int] = CHECK_HEADS,
                       seed: int = 0) -> str | None:
    """None when `qk_norm_rope` matches the portable form on random heads and tables, else the problem. `heads`:
    the model's (q heads, kv heads, head size), so the kernel compiled for the check is the one its layers use."""
    rng = np.random.default_rng(seed)
    tokens, (hq, hkv, d) = 19, heads

    def arr(*shape, scale=1.0):
        return mx.array((rng.normal(0, scale, shape)).astype(np.float32)).astype(dtype)

    qkv = arr(tokens, hq + 2 * hkv, d, scale=2.0)
    angles = rng.uniform(0, 6.3, (tokens, d // 2)).astype(np.float32)
    cos = mx.array(np.concatenate([np.cos(angles)] * 2, axis=1)).astype(dtype)
    sin = mx.array(np.concatenate([np.sin(angles)] * 2, axis=1)).astype(dtype)
    q_norm, k_norm = _Norm(arr(d, scale=0.5) + 1, 1e-6), _Norm(arr(d, scale=0.5) + 1, 1e-6)
    got = qk_norm_rope(qkv, hq, hkv, q_norm, k_norm, cos, sin)
    ulps = ulps_apart(got, portable_qk_norm_rope(qkv, hq, hkv, q_norm, k_norm, cos, sin), dtype)
    if ulps > MAX_ULPS:
        return f"q/k norm + rotary differs from the portable form by {ulps:.1f} units in the last place"
    return None


def _checked(label: str, build: Callable, wrap: Callable, check: Callable) -> tuple[Callable | None, str]:
    """A kernel built, wrapped and checked against its portable form: (the wrapped kernel, why) or (None, the
    problem)."""
    built = None
    try:
        built = build()
        kernel = wrap(built)
        problem = check(kernel)
    except Exception as exc:   # NVRTC errors, a missing header: the portable form still works
        problem = f"{label} failed to build or run: {type(exc).__name__}: {str(exc)[:300]}"
    if problem is not None:
        return None, problem
    how = getattr(built, "built_by", None)   # known after the check's call: how its template was compiled
    return kernel, "the CUDA kernel matched the portable form at start" + (f"; built by {how}" if how else "")


def select_fused_kernels(device: str, dtype: mx.Dtype, *, qk_heads: tuple[int, int, int] | None = CHECK_HEADS,
                         vision_heads: tuple[int, int] | None = None, build_qk_norm_rope=_qk_norm_rope_kernel,
                         build_vision_rope=vision_rope.build_kernel) -> FusedKernels:
    """The kernels to use for `device` ("cpu" | "metal" | "cuda") and the engine's `dtype`: on CUDA in half
    precision, each one that builds and matches its portable form (the builders injectable for tests).
    `qk_heads`: (q heads, kv heads, head size) of a model whose attention normalises q and k (Qwen3), None for
    one that does not. `vision_heads`: the vision tower's (heads, head size), None to build no towers' kernel."""
    if qk_heads is None and vision_heads is None:
        return FusedKernels(reason="no q/k norms in this model")
    if device != "cuda":
        return FusedKernels(reason=f"portable forms on {device}")
    if dtype not in HALF_DTYPES:
        return FusedKernels(reason=f"portable forms in {dtype}: the kernels are for half precision")
    if qk_heads is None:
        qk, qk_why = None, "no q/k norms in this model"
    elif not qk_norm_rope_suits(dtype, qk_heads[2]):
        qk, qk_why = None, f"portable forms for head size {qk_heads[2]} (the kernel takes multiples of 64)"
    else:
        qk, qk_why = _checked("qk_norm_rope", build_qk_norm_rope, qk_norm_rope_with,
                              lambda k: check_qk_norm_rope(k, dtype, qk_heads))
    if vision_heads is None:
        return FusedKernels(qk_norm_rope=qk, reason=qk_why)
    if not vision_rope.vision_rope_suits(dtype, vision_heads[1]):
        tower, tower_why = None, f"portable form for head size {vision_heads[1]} (the kernel takes multiples of 8)"
    else:
        tower, tower_why = _checked("vision_rope", build_vision_rope, vision_rope.vision_rope_with,
                                    lambda k: vision_rope.check_vision_rope(k, dtype, vision_heads))
    return FusedKernels(qk_norm_rope=qk, vision_rope=tower, reason=f"q/k: {qk_why}; towers' rotary: {tower_why}")


_ACTIVE = FusedKernels()


def activate(kernels: FusedKernels) -> None:
    """Make `kernels` the ones the layers call (a process runs one engine's device and dtype)."""
    global _ACTIVE
    _ACTIVE = kernels


def active() -> FusedKernels:
    return _ACTIVE

