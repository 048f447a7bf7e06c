"""Choosing the attention implementation at engine start: Metal kernels only when they prove themselves.

A custom kernel that is wrong gives plausible-looking but wrong answers, which is worse than a slow job. So
the kernels are used only on a Metal device, and only after they reproduce the portable path on probe
batches (a decode batch for the per-token kernel and a mixed prefill batch with prefix hits for the tiled
one). Any exception, non-finite value or mismatch is logged with the reason and the portable path is used.
NVIDIA GPUs run the portable path tuned for fused SDPA (`gpu_portable_attention`); on Hopper the engine adds
its own paged kernel where cuDNN's SDPA is slower (`engine/cuda_attention.py`, docs/cuda_kernels.md).
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass
from typing import Callable

import mlx.core as mx
import numpy as np

from .attention import paged_attention
from .attention_plan import GPU_SHAPE_BUCKETS
from .probe import make_ragged_batch

log = logging.getLogger(__name__)

AttentionFn = Callable[..., mx.array]  # (q, k_cache, v_cache, meta, scale, *, new_kv=None) -> out
PROBE_TOLERANCE = {mx.float32: 1e-4, mx.float16: 1e-2, mx.bfloat16: 6e-2}  # max abs diff vs portable


@dataclass
class AttentionBackend:
    """The chosen implementation, with why it was chosen (shown in logs and the job summary)."""

    name: str  # "metal" | "portable"
    reason: str
    fn: AttentionFn

    def __call__(self, q: mx.array, k_cache: mx.array, v_cache: mx.array, meta, scale: float,
                 new_kv: tuple[mx.array, mx.array] | None = None) -> mx.array:
        if new_kv is None:  # every AttentionFn takes the five positional arguments; new_kv is an optional hint
            return self.fn(q, k_cache, v_cache, meta, scale)
        return self.fn(q, k_cache, v_cache, meta, scale, new_kv=new_kv)


def metal_is_available() -> bool:
    try:
        return bool(mx.metal.is_available())
    except Exception:  # an MLX build without the metal module
        return False


def _load_metal_kernel() -> AttentionFn:
    from .kernels import metal_paged_attention

    return metal_paged_attention


def probe_batches(dtype: mx.Dtype):
    """Two small ragged batches over shuffled blocks with GQA: decode-like, and prefill with prefix hits."""
    rng = np.random.default_rng(20251122)  # fixed: the probe must be reproducible from a log line
    shape = dict(num_q_heads=8, num_kv_heads=2, head_dim=128, block_size=16, dtype=dtype)
    decode = make_ragged_batch(rng, [1, 1, 1, 1], [0, 15, 16, 70], **shape)
    prefill = make_ragged_batch(rng, [1, 16, 37, 5, 64], [31, 0, 32, 3, 16], **shape)
    return {"decode": decode, "prefill": prefill}


def probe_kernel(kernel: AttentionFn, dtype: mx.Dtype = mx.float16, batches: dict | None = None,
                 reference: AttentionFn = paged_attention) -> str | None:
    """None when `kernel` matches the portable path on every probe batch, else the reason it does not.
    `batches`: label -> RaggedBatch (default `probe_batches(dtype)`); `reference`: the portable path as the
    caller wants it computed (default: on the default device, in the batch's dtype)."""
    tol = PROBE_TOLERANCE.get(dtype, 1e-2)
    for label, b in (probe_batches(dtype) if batches is None else batches).items():
        scale = b.q.shape[-1] ** -0.5
        try:
            got = kernel(b.q, b.k_cache, b.v_cache, b.meta, scale)
            mx.eval(got)
        except Exception as exc:  # whatever the kernel raises, the job must still run
            return f"kernel raised on the {label} probe: {type(exc).__name__}: {exc}"
        if got.shape != b.q.shape or got.dtype != b.q.dtype:
            return f"kernel returned {got.shape} {got.dtype} on the {label} probe, expected {b.q.shape} {b.q.dtype}"
        want = reference(b.q, b.k_cache, b.v_cache, b.meta, scale)
        diff = mx.abs(got.astype(mx.float32) - want.astype(mx.float32))
        if not mx.all(mx.isfinite(got.astype(mx.float32))).item():
            return f"kernel returned non-finite values on the {label} probe"
        err = diff.max().item()
        if err > tol:
            return f"kernel differs from the portable path on the {label} probe: max abs diff {err:.3g} > {tol:g}"
    return None


def _built_and_probed(load_kernel: Callable[[], AttentionFn], dtype: mx.Dtype,
                      probe: bool) -> tuple[AttentionFn | None, str | None]:
    """(kernel, why it must not be used): build, then check against the portable path."""
    try:
        kernel = load_kernel()
    except Exception as exc:
        return None, f"Metal kernels failed to build: {type(exc).__name__}: {exc}"
    return kernel, probe_kernel(kernel, dtype) if probe else None


def _portable_because(problem: str, portable: AttentionFn) -> AttentionBackend:
    reason = f"{problem}; using the portable MLX path"
    log.warning(reason)
    return AttentionBackend("portable", reason, portable)


def select_attention_backend(
    probe: bool = True,
    *,
    dtype: mx.Dtype = mx.float16,
    metal_available: Callable[[], bool] = metal_is_available,
    load_kernel: Callable[[], AttentionFn] = _load_metal_kernel,
) -> AttentionBackend:
    """Metal kernels when on a Metal device and (unless probe=False) they match the portable path.

    `metal_available` and `load_kernel` are injectable so the selection and fallback logic can be tested
    on machines without Metal.
    """
    if not metal_available():
        return AttentionBackend("portable", "no Metal device: using the portable MLX path", paged_attention)
    portable = gpu_portable_attention(dtype)  # Metal's SDPA is fused too: the GPU's grouping and chunking
    kernel, problem = _built_and_probed(load_kernel, dtype, probe)
    if problem is not None:
        return _portable_because(problem, portable)
    if not probe:
        return AttentionBackend("metal", "Metal device; kernel probe skipped by request", kernel)
    log.info("Metal attention kernels match the portable path on the probe batches; using them")
    return AttentionBackend("metal", f"Metal kernels matched the portable path on the probe ({dtype})", kernel)


GPU_QUERY_CHUNK = 4096  # query rows per SDPA call on a GPU in half precision (see gpu_portable_attention)
GPU_GROUP_ROWS = 1 << 16  # query rows of one grouped SDPA call there: above any forward pass's token budget


def gpu_portable_attention(dtype: mx.Dtype) -> AttentionFn:
    """The portable path tuned for a GPU: in bf16/fp16 MLX's SDPA is a fused kernel (cuDNN on CUDA) that never
    materialises the score matrix, so the 512-row query chunks that bound CPU memory only add launches, a
    grouped call may hold the whole batch, K/V views are read as they are (no copy), and the followers of a
    clip are folded into one call over their shared context (read once, not once per follower); fp32 falls
    back to unfused ops there, so it keeps the CPU's settings. On CUDA, whose SDPA builds a cuDNN graph per new
    shape, calls are padded to lengths that repeat (`GPU_SHAPE_BUCKETS`); Metal's SDPA builds nothing per shape."""
    if dtype in (mx.bfloat16, mx.float16):
        return functools.partial(paged_attention, query_chunk=GPU_QUERY_CHUNK, group_rows=GPU_GROUP_ROWS,
                                 contiguous_kv=False, fold_followers=True,
                                 shape_buckets=0 if metal_is_available() else GPU_SHAPE_BUCKETS)
    return paged_attention
