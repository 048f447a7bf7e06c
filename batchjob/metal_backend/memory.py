"""How many KV blocks fit: the pool is sized from a memory budget once, at engine start.

Failing at start with the numbers beats failing at 3 a.m. on the first long clip: if the budget cannot hold
one maximum-length request next to the weights, no schedule can run, so we refuse to start.
"""

from __future__ import annotations

BUDGET_SETTING = "`model.memory_budget_gb` in the job config (EngineConfig.memory_budget_gb)"


class KVCacheBudgetError(ValueError):
    """The memory budget cannot hold the weights plus the KV cache of one maximum-length request."""


def kv_bytes_per_block(*, num_layers: int, num_kv_heads: int, head_dim: int, dtype_bytes: int, block_size: int) -> int:
    """K and V for every layer: 2 x layers x block_size x kv_heads x head_dim x dtype bytes."""
    return 2 * num_layers * block_size * num_kv_heads * head_dim * dtype_bytes


def _gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB"


def plan_num_blocks(
    *,
    memory_budget_bytes: int,
    weights_bytes: int,
    num_layers: int,
    num_kv_heads: int,
    head_dim: int,
    dtype_bytes: int,
    block_size: int,
    max_model_len: int,
) -> int:
    """Number of KV blocks that fit in `memory_budget_bytes - weights_bytes` (at least one full request)."""
    sizes = dict(num_layers=num_layers, num_kv_heads=num_kv_heads, head_dim=head_dim, dtype_bytes=dtype_bytes,
                 block_size=block_size, max_model_len=max_model_len)
    bad = {k: v for k, v in sizes.items() if v < 1}
    if bad or memory_budget_bytes < 0 or weights_bytes < 0:
        raise ValueError(f"plan_num_blocks: sizes must be positive and budgets non-negative, got {bad or sizes}")
    per_block = kv_bytes_per_block(num_layers=num_layers, num_kv_heads=num_kv_heads, head_dim=head_dim,
                                   dtype_bytes=dtype_bytes, block_size=block_size)
    blocks_per_request = -(-max_model_len // block_size)
    need = weights_bytes + blocks_per_request * per_block
    if memory_budget_bytes < need:
        raise KVCacheBudgetError(
            f"memory budget {_gib(memory_budget_bytes)} cannot hold the model weights ({_gib(weights_bytes)}) plus "
            f"the KV cache of one {max_model_len}-token request ({blocks_per_request} blocks x {per_block} bytes = "
            f"{_gib(blocks_per_request * per_block)}); need at least {_gib(need)}. Raise {BUDGET_SETTING}, or "
            f"lower max_model_len (fewer frames per clip)"
        )
    return (memory_budget_bytes - weights_bytes) // per_block
