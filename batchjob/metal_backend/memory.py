"""The KV cache's size per block: the unit the engine's memory budget (`batchjob.engine.memory_budget`) buys."""

from __future__ import annotations


def kv_bytes_per_block(*, num_layers: int, num_kv_heads: int, head_dim: int, dtype_bytes: int, block_size: int) -> int:
    """K and V for every layer: 2 x layers x block_size x kv_heads x head_dim x dtype bytes."""
    sizes = dict(num_layers=num_layers, num_kv_heads=num_kv_heads, head_dim=head_dim, dtype_bytes=dtype_bytes,
                 block_size=block_size)
    bad = {k: v for k, v in sizes.items() if v < 1}
    if bad:
        raise ValueError(f"kv_bytes_per_block: sizes must be positive, got {bad}")
    return 2 * num_layers * block_size * num_kv_heads * head_dim * dtype_bytes
