"""CUDA twins of the Metal paged attention kernels, built with `mx.fast.cuda_kernel` (MLX's CUDA backend).

Same buffers, grid, template constants and index math as the Metal kernels (LAYOUT.md): `kernel_launch`
computes one launch for both, so the host-side logic tested on CPU is exactly what runs on the GPU. Only the
spelling differs (`__shfl_xor_sync` for `simd_sum`, `__shared__` for `threadgroup`). Like the Metal kernels,
these are used only after they reproduce the portable path on the probe batches (selection.py).
"""

from __future__ import annotations

from functools import cache

import mlx.core as mx

from ..metadata import AttentionMetadata
from . import INPUT_NAMES, KernelLaunch, kernel_launch, kernel_source, run_launch

CUDA_MAX_GRID_YZ = 65535  # CUDA caps gridDim.y and gridDim.z; the launch puts heads on y and blocks on z


@cache
def _kernel(kind: str):
    return mx.fast.cuda_kernel(
        name=f"batchjob_paged_attention_{kind}",
        input_names=INPUT_NAMES,
        output_names=["out"],
        source=kernel_source(f"paged_attention_{kind}.cu"),
        header=kernel_source("paged_attention_common.cuh"),
    )


def cuda_launch(q: mx.array, k_cache: mx.array, v_cache: mx.array, meta: AttentionMetadata, scale: float,
                kind: str = "auto") -> KernelLaunch:
    """`kernel_launch` plus CUDA's grid limits (a ValueError sends the caller to the portable path)."""
    launch = kernel_launch(q, k_cache, v_cache, meta, scale, kind)
    blocks_y, blocks_z = launch.grid[1] // launch.threadgroup[1], launch.grid[2] // launch.threadgroup[2]
    if max(blocks_y, blocks_z) > CUDA_MAX_GRID_YZ:
        raise ValueError(f"CUDA grid {launch.grid} exceeds {CUDA_MAX_GRID_YZ} blocks in y or z; "
                         f"use fewer tokens per forward pass (max_num_batched_tokens)")
    return launch


def cuda_paged_attention(q: mx.array, k_cache: mx.array, v_cache: mx.array, meta: AttentionMetadata, scale: float,
                         kind: str = "auto", new_kv=None) -> mx.array:
    """Paged attention on an NVIDIA GPU: per-token kernel for short queries, tiled kernel otherwise.
    `new_kv` (the portable path's shortcut for fresh sequences) is ignored: the kernels read the cache."""
    launch = cuda_launch(q, k_cache, v_cache, meta, scale, kind)
    return run_launch(_kernel(launch.kind), launch)
