"""Paged KV cache and packed varlen attention for MLX (Metal kernels on Apple GPUs, portable MLX path elsewhere).

Sequences of different lengths share one flat token axis over a paged cache, so a batch costs its real
tokens; identical prefixes (same tokens, same media) share physical blocks.
"""

from .attention import paged_attention
from .block_pool import BlockPool, PoolExhaustedError, PoolStats, SeqBlocks, hash_blocks, media_hash_spans
from .kv_cache import KVCache, StackedHeads, head_rows, write_kv
from .memory import kv_bytes_per_block
from .metadata import AttentionMetadata, SeqSlice, build_attention_metadata, token_positions
from .selection import AttentionBackend, select_attention_backend

__all__ = [
    "AttentionBackend",
    "AttentionMetadata",
    "BlockPool",
    "KVCache",
    "PoolExhaustedError",
    "PoolStats",
    "SeqBlocks",
    "SeqSlice",
    "StackedHeads",
    "build_attention_metadata",
    "hash_blocks",
    "head_rows",
    "kv_bytes_per_block",
    "media_hash_spans",
    "paged_attention",
    "select_attention_backend",
    "token_positions",
    "write_kv",
]
