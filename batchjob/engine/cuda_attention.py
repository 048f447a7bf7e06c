"""Paged varlen attention on Hopper's tensor cores: one kernel for every prefill shape of a forward.

The portable path runs cuDNN's fused SDPA over planned calls. A forward whose prompts differ in length or share a
cached prefix pays for that plan: gathers of query rows, keys and outputs, several calls, and a cuDNN graph build
for every new call shape. This kernel reads q in place from the packed projection and K/V from the paged cache
through the block table, so nothing is gathered, padded or built per shape.

The scheme is FlashAttention's, on `wgmma` (sm_90):
- a warpgroup (four warps) takes 64 query rows of one sequence and one q head, q in registers as the A operand;
- it walks the sequence's keys in tiles of 64, K and V brought into shared memory by `cp.async` in the layout
  `wgmma` reads (128-byte swizzle) and read by it through matrix descriptors;
- the scores' softmax is online, in fp32 (exp2, the scale folded in), and the probabilities stay in registers as
  the A operand of their product with V;
- the next tile's K and V load while this tile's are used (a ring of two in dynamic shared memory), through
  addresses fixed per thread at the start (hopper_kernel.py says why that matters).

A query row sees keys `< context_len - q_len + row + 1` (lower-right causal, as MLX's SDPA aligns it); tiles past
a block's last visible key are skipped, and key rows past a context load as zeros.

cuDNN stays faster on two shapes (docs/cuda_kernels.md has the figures), so `HopperAttention` hands them to the
portable path: a batch of fresh prompts of one length longer than `LONG_EQUAL_PROMPT` (one SDPA call over views of
the projection) and any prompt longer than `LONG_PROMPT`. It is built header-free by NVRTC (engine/nvrtc.py) at
start, checked against the portable path on probe batches at the model's head counts, and used only if it matches
(`select_hopper_attention`). Other GPUs, and Hopper without NVRTC or on a failed check, run the portable path.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Callable

import mlx.core as mx
import numpy as np

from batchjob.metal_backend import paged_attention
from batchjob.metal_backend.probe import make_ragged_batch
from batchjob.metal_backend.selection import probe_kernel

from .hopper_kernel import ARCH, BLOCK_M, HEAD_DIMS, THREADS, TYPES, kernel_source, shared_memory
from .nvrtc import compiler as nvrtc_compiler

log = logging.getLogger(__name__)

# Measured cuts (docs/cuda_kernels.md): new tokens above which cuDNN's SDPA outruns the kernel
LONG_PROMPT = 8192         # in any batch (gathers and several calls included on the portable side)
LONG_EQUAL_PROMPT = 3072   # in a batch of fresh prompts all of that length (one SDPA call over views)

def suits(dtype: mx.Dtype, hq: int, hkv: int, d: int) -> bool:
    """Half precision, a head size the kernel is written for, whole groups of q heads per kv head."""
    return dtype in TYPES and d in HEAD_DIMS and hkv >= 1 and hq % hkv == 0


@dataclass(frozen=True)
class TilePlan:
    """The forward's query tiles, heaviest first (a causal tile late in a long prompt reads the most keys)."""

    seq: np.ndarray     # [tiles] int32: the sequence of each tile
    start: np.ndarray   # [tiles] int32: its first query row within the sequence's new tokens


def plan_tiles(cu_seqlens_q: np.ndarray, context_lens: np.ndarray, block_m: int = BLOCK_M) -> TilePlan:
    """Every sequence's new tokens cut into `block_m`-row tiles, ordered by the keys they read (most first)."""
    seqs, starts, work = [], [], []
    q_lens = np.diff(np.asarray(cu_seqlens_q, dtype=np.int64))
    for s, (q_len, ctx) in enumerate(zip(q_lens, np.asarray(context_lens, dtype=np.int64))):
        prefix = ctx - q_len
        for start in range(0, int(q_len), block_m):
            seqs.append(s)
            starts.append(start)
            work.append(min(ctx, prefix + min(start + block_m, q_len)))
    order = np.argsort(-np.asarray(work, dtype=np.int64), kind="stable")
    return TilePlan(np.asarray(seqs, dtype=np.int32)[order], np.asarray(starts, dtype=np.int32)[order])


def prefers_portable(cu_seqlens_q: np.ndarray, context_lens: np.ndarray) -> bool:
    """Whether cuDNN's SDPA beats the kernel on this forward: fresh prompts all of one length over
    `LONG_EQUAL_PROMPT` (one call over views, nothing gathered) or any prompt over `LONG_PROMPT`."""
    q_lens = np.diff(np.asarray(cu_seqlens_q, dtype=np.int64))
    cached = np.asarray(context_lens, dtype=np.int64) - q_lens
    longest = q_lens.max(initial=0)
    equal_fresh = len(q_lens) > 0 and not cached.any() and (q_lens == q_lens[0]).all()
    return bool((equal_fresh and longest > LONG_EQUAL_PROMPT) or longest > LONG_PROMPT)


class HopperKernel:
    """The kernel as an attention function (`AttentionFn`): built once per (dtype, heads, head size, block size)
    by `compile(name, source)` (bytes of a cubin). `q_rows`: a contiguous array whose first Hq heads are q (the
    rotated q/k stack), read in place instead of copying the view."""

    def __init__(self, compile_cubin: Callable[[str, str], bytes]):
        self._compile = compile_cubin
        self._built: dict[tuple, tuple[str, bytes]] = {}
        self._scales: dict[float, mx.array] = {}

    def _cubin(self, *key) -> tuple[str, bytes]:
        if key not in self._built:
            source, name = kernel_source(*key)
            self._built[key] = name, self._compile(name, source)
        return self._built[key]

    def __call__(self, q: mx.array, k_cache: mx.array, v_cache: mx.array, meta, scale: float, *,
                 new_kv=None, q_rows: mx.array | None = None) -> mx.array:
        tokens, hq, d = q.shape
        _, block_size, hkv, _ = k_cache.shape
        if not suits(q.dtype, hq, hkv, d) or k_cache.dtype != q.dtype or v_cache.dtype != q.dtype:
            raise ValueError(f"HopperKernel: no kernel for {q.dtype} q / {k_cache.dtype} cache, {hq} q heads, "
                             f"{hkv} kv heads, head size {d}")
        source = q if q_rows is None else q_rows
        if source.shape[0] != tokens or source.shape[1] < hq or source.shape[2] != d:
            raise ValueError(f"HopperKernel: q_rows {source.shape} does not hold q {q.shape} as its first heads")
        tiles = meta.plan_cache.get("hopper_tiles")
        if tiles is None:
            plan = plan_tiles(meta.cu_seqlens_q_host, meta.context_lens_host)
            tiles = meta.plan_cache["hopper_tiles"] = (mx.array(plan.seq), mx.array(plan.start), len(plan.seq))
        tile_seq, tile_start, count = tiles
        if scale not in self._scales:
            self._scales[scale] = mx.array([scale * math.log2(math.e)], dtype=mx.float32)
        name, cubin = self._cubin(q.dtype, hq, hkv, d, block_size)
        (out,) = mx.fast.precompiled_cuda_kernel(
            name=name, compiled_source=cubin,
            inputs=[source, k_cache, v_cache, meta.block_tables, meta.cu_seqlens_q, meta.context_lens, tile_seq,
                    tile_start, self._scales[scale]],
            output_shapes=[(tokens, hq, d)], output_dtypes=[q.dtype],
            scalars=[int(source.shape[1]), int(meta.block_tables.shape[1])],
            grid=(count * THREADS, hq, 1), threadgroup=(THREADS, 1, 1), shared_memory=shared_memory(d),
            ensure_row_contiguous=True)
        return out


class HopperAttention:
    """The engine's attention on Hopper: the kernel, except on the forwards cuDNN runs faster
    (`prefers_portable`), which go to `portable`. The choice is made once per forward."""

    reads_q_rows = True   # the layer may pass the rotated q/k stack (`q_rows`)

    def __init__(self, kernel: HopperKernel, portable: Callable[..., mx.array]):
        self.kernel, self.portable = kernel, portable

    def __call__(self, q, k_cache, v_cache, meta, scale, *, new_kv=None, q_rows=None) -> mx.array:
        portable = meta.plan_cache.get("hopper_prefers_portable")
        if portable is None:
            portable = meta.plan_cache["hopper_prefers_portable"] = prefers_portable(meta.cu_seqlens_q_host,
                                                                                     meta.context_lens_host)
        if portable:
            return self.portable(q, k_cache, v_cache, meta, scale, new_kv=new_kv)
        return self.kernel(q, k_cache, v_cache, meta, scale, q_rows=q_rows)


# Probe batches at the model's head counts: prompts of 1 to 150 new tokens over 0 to 40 cached, several tiles and
# partial ones, and decode-like single tokens; blocks shuffled, spare blocks full of garbage.
PROBE_BATCHES = {"prefill": ([1, 16, 37, 5, 64, 150, 70], [31, 0, 32, 3, 16, 0, 40]),
                 "decode": ([1, 1, 1, 1], [0, 15, 16, 70])}


def _fp32_on_cpu(q, k_cache, v_cache, meta, scale) -> mx.array:
    """The check's reference: the portable path in fp32 on the CPU (no cuDNN graph to build for the probe shapes)."""
    with mx.stream(mx.cpu):
        return paged_attention(*(x.astype(mx.float32) for x in (q, k_cache, v_cache)), meta, scale)


def check_kernel(kernel: Callable[..., mx.array], dtype: mx.Dtype, heads: tuple[int, int, int],
                 block_size: int) -> str | None:
    """None when `kernel` matches the portable path (in fp32, on the CPU) on the probe batches at the model's head
    counts (`selection.probe_kernel`), else the problem."""
    hq, hkv, d = heads
    rng = np.random.default_rng(20261127)   # fixed: a failed check must be reproducible from its log line
    batches = {label: make_ragged_batch(rng, q_lens, cached, num_q_heads=hq, num_kv_heads=hkv, head_dim=d,
                                        block_size=block_size, dtype=dtype)
               for label, (q_lens, cached) in PROBE_BATCHES.items()}
    problem = probe_kernel(kernel, dtype, batches, reference=_fp32_on_cpu)
    return None if problem is None else f"the Hopper {problem}"


def select_hopper_attention(dtype: mx.Dtype, heads: tuple[int, int, int], block_size: int,
                            portable: Callable[..., mx.array], compiler=None) -> tuple[Callable | None, str]:
    """(HopperAttention, why) on a Hopper GPU whose kernel builds and matches the portable path, else (None, why
    not). `heads`: the model's (q heads, kv heads, head size); `compiler`: nvrtc.compiler()'s result (injectable)."""
    if not suits(dtype, *heads):
        return None, (f"no Hopper kernel for {dtype} with {heads[0]} q heads, {heads[1]} kv heads, head size "
                      f"{heads[2]} (half precision, head size {' or '.join(map(str, HEAD_DIMS))})")
    nvrtc = nvrtc_compiler() if compiler is None else compiler
    if isinstance(nvrtc, str):
        return None, f"no Hopper kernel: {nvrtc}"
    if nvrtc.target.major != 9:
        return None, (f"compute capability {nvrtc.target.major}.{nvrtc.target.minor}: the paged kernel needs "
                      "Hopper's wgmma (9.x)")
    kernel = HopperKernel(lambda name, source: nvrtc.cubin(name, source, ARCH))
    try:
        problem = check_kernel(kernel, dtype, heads, block_size)
    except Exception as exc:   # the probe batches could not be built: the portable path still works (a kernel
        # that fails to compile or launch is reported by probe_kernel)
        problem = f"the Hopper kernel failed to build or run: {type(exc).__name__}: {str(exc)[:300]}"
    if problem is not None:
        log.warning("%s; using the portable path", problem)
        return None, problem
    return HopperAttention(kernel, portable), ("Hopper paged kernel (matched the portable path at start); cuDNN's "
                                               f"SDPA for equal fresh prompts over {LONG_EQUAL_PROMPT} tokens and "
                                               f"prompts over {LONG_PROMPT}")
