"""Metal kernels for paged varlen attention, built with `mx.fast.metal_kernel` (Apple GPUs only).

Sources live beside this file (`*.metal`, buffer layout in LAYOUT.md). `metal_paged_attention` has the same
signature and semantics as the portable `paged_attention`, which is its oracle: the backend selector checks
it on a probe batch before trusting it.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache
from importlib import resources

import mlx.core as mx

from ..attention import check_attention_inputs
from ..metadata import AttentionMetadata
from .index_math import tiled_grid_blocks

BQ = 16  # query rows per tiled threadgroup
NUM_SIMDGROUPS = 4  # simdgroups per tiled threadgroup; each owns BQ / NUM_SIMDGROUPS rows
PER_TOKEN_MAX_Q = 4  # batches whose longest query is this short use the per-token kernel
THREADGROUP_MEMORY_BYTES = 32 * 1024
INPUT_NAMES = ["q", "k_cache", "v_cache", "cu_seqlens_q", "context_lens", "block_tables", "params", "scale"]


def kernel_source(name: str) -> str:
    """Text of a kernel source file shipped beside this module."""
    return resources.files(__package__).joinpath(name).read_text()


@cache
def _kernel(kind: str):
    return mx.fast.metal_kernel(
        name=f"batchjob_paged_attention_{kind}",
        input_names=INPUT_NAMES,
        output_names=["out"],
        source=kernel_source(f"paged_attention_{kind}.metal"),
        header=kernel_source("paged_attention_common.metal"),
    )


def kv_tile_len(head_dim: int) -> int:
    """Largest power-of-two K/V tile (<= 16 positions) whose fp32 K and V copies fit threadgroup memory."""
    bk = 16
    while bk > 1 and 2 * bk * head_dim * 4 > THREADGROUP_MEMORY_BYTES:
        bk //= 2
    return bk


@dataclass(frozen=True)
class KernelLaunch:
    """Everything one kernel call needs; the CPU emulator in the tests runs exactly this launch."""

    kind: str  # "per_token" | "tiled"
    inputs: list[tuple[str, mx.array]]
    template: list[tuple[str, object]]
    grid: tuple[int, int, int]
    threadgroup: tuple[int, int, int]
    output_shape: tuple[int, ...]
    output_dtype: mx.Dtype


def kernel_launch(
    q: mx.array, k_cache: mx.array, v_cache: mx.array, meta: AttentionMetadata, scale: float, kind: str = "auto"
) -> KernelLaunch:
    """Choose the kernel and compute its grid, template constants and inputs (host-side, no sync)."""
    check_attention_inputs(q, k_cache, v_cache, meta)
    if k_cache.size >= 2**31:
        raise ValueError(f"Metal kernels index the cache with 32-bit ints; a cache of {k_cache.size} elements per "
                         f"layer is too large, use fewer blocks or the portable path")
    if kind == "auto":
        kind = "per_token" if meta.max_q_len <= PER_TOKEN_MAX_Q else "tiled"
    t, hq, d = q.shape
    _, bs, hkv, _ = k_cache.shape
    template = [("T", q.dtype), ("HEAD_DIM", d), ("BLOCK_SIZE", bs), ("NUM_Q_HEADS", hq), ("NUM_KV_HEADS", hkv)]
    if kind == "per_token":
        grid, threadgroup = (32, hq, t), (32, 1, 1)
    elif kind == "tiled":
        template += [("BQ", BQ), ("BK", kv_tile_len(d)), ("NUM_SIMDGROUPS", NUM_SIMDGROUPS)]
        blocks = tiled_grid_blocks(meta.num_tokens, meta.num_seqs, BQ)
        grid, threadgroup = (32 * NUM_SIMDGROUPS, hq, blocks), (32 * NUM_SIMDGROUPS, 1, 1)
    else:
        raise ValueError(f"unknown kernel kind {kind!r}; use 'auto', 'per_token' or 'tiled'")
    params = mx.array([meta.num_seqs, meta.block_tables_host.shape[1]], dtype=mx.int32)
    values = [q, k_cache, v_cache, meta.cu_seqlens_q, meta.context_lens, meta.block_tables, params,
              mx.array([scale], dtype=mx.float32)]
    return KernelLaunch(kind, list(zip(INPUT_NAMES, values)), template, grid, threadgroup, q.shape, q.dtype)


def metal_paged_attention(
    q: mx.array, k_cache: mx.array, v_cache: mx.array, meta: AttentionMetadata, scale: float, kind: str = "auto",
    new_kv=None,
) -> mx.array:
    """Paged attention on the Metal GPU: per-token kernel for short queries, tiled kernel for prefill.
    `new_kv` (the portable path's shortcut for fresh sequences) is ignored: the kernels read the cache."""
    launch = kernel_launch(q, k_cache, v_cache, meta, scale, kind)
    return run_launch(_kernel(launch.kind), launch)


def run_launch(kernel, launch: KernelLaunch) -> mx.array:
    """Call a compiled kernel (Metal or CUDA: the same signature in MLX) with a planned launch."""
    (out,) = kernel(
        inputs=[a for _, a in launch.inputs],
        template=launch.template,
        grid=launch.grid,
        threadgroup=launch.threadgroup,
        output_shapes=[launch.output_shape],
        output_dtypes=[launch.output_dtype],
    )
    return out
