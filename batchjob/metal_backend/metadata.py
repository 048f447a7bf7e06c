"""Attention metadata for one packed forward pass, built on the host once and read by every layer.

The batch mixes fresh prefills (nothing cached) and continuations after a prefix hit or a previous chunk
(KV for the first `num_computed` tokens already in the cache). All new tokens sit end to end on one flat
axis; `cu_seqlens_q` says where each sequence's tokens start, `context_lens` how far each one can see.
Building this once per forward keeps the per-layer attention free of host work and host syncs.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import mlx.core as mx
import numpy as np


@dataclass(frozen=True)
class SeqSlice:
    """One sequence in this forward pass: tokens [num_computed, num_computed + num_new) are computed now."""

    block_table: list[int]
    num_computed: int
    num_new: int


@dataclass(frozen=True)
class AttentionMetadata:
    """Device arrays (mx.int32) for kernels and layers, plus host numpy twins for Python-level loops."""

    cu_seqlens_q: mx.array  # [S + 1] start of each sequence's new tokens on the flat axis
    context_lens: mx.array  # [S] cached + new tokens: KV positions [0, context_len) exist after write_kv
    block_tables: mx.array  # [S, max_blocks] physical block ids, rows padded with 0 past the sequence
    slot_mapping: mx.array  # [T] flat cache slot (block * block_size + offset) for each new token
    cu_seqlens_q_host: np.ndarray
    context_lens_host: np.ndarray
    block_tables_host: np.ndarray
    slot_mapping_host: np.ndarray
    max_q_len: int
    max_context_len: int
    num_tokens: int
    block_size: int
    # Per-forward memo of derived device arrays (gather indices): built by the first layer, reused by the rest.
    plan_cache: dict = field(default_factory=dict, compare=False, repr=False)

    @property
    def num_seqs(self) -> int:
        return len(self.context_lens_host)

    @property
    def query_lens_host(self) -> np.ndarray:
        return np.diff(self.cu_seqlens_q_host)


def token_positions(slices: Sequence[SeqSlice]) -> np.ndarray:
    """Position of every new token within its own sequence (the flat-axis counterpart of `arange(len)`)."""
    if not slices:
        return np.zeros(0, dtype=np.int64)
    return np.concatenate([np.arange(s.num_computed, s.num_computed + s.num_new) for s in slices])


def _validate(slices: Sequence[SeqSlice], block_size: int) -> None:
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    if not slices:
        raise ValueError("build_attention_metadata needs at least one sequence in the forward pass")
    for i, s in enumerate(slices):
        if s.num_new < 1 or s.num_computed < 0:
            raise ValueError(
                f"sequence {i}: num_new={s.num_new}, num_computed={s.num_computed}; each sequence in a forward "
                f"pass computes at least one new token and has a non-negative cached count"
            )
        capacity = len(s.block_table) * block_size
        if capacity < s.num_computed + s.num_new:
            raise ValueError(
                f"sequence {i}: {s.num_computed + s.num_new} tokens do not fit its {len(s.block_table)} blocks of "
                f"{block_size} ({capacity} slots); allocate the sequence's blocks from the BlockPool first"
            )


def build_attention_metadata(slices: Sequence[SeqSlice], block_size: int) -> AttentionMetadata:
    """Pack the batch: offsets, context lengths, padded block tables and the slot of every new token."""
    _validate(slices, block_size)
    q_lens = np.array([s.num_new for s in slices], dtype=np.int32)
    cu = np.zeros(len(slices) + 1, dtype=np.int32)
    np.cumsum(q_lens, out=cu[1:])
    context = np.array([s.num_computed + s.num_new for s in slices], dtype=np.int32)
    max_blocks = max(len(s.block_table) for s in slices)
    tables = np.zeros((len(slices), max_blocks), dtype=np.int32)
    for i, s in enumerate(slices):
        tables[i, : len(s.block_table)] = s.block_table
    positions = token_positions(slices)
    seq_of_token = np.repeat(np.arange(len(slices)), q_lens)
    slots = (tables[seq_of_token, positions // block_size] * block_size + positions % block_size).astype(np.int32)
    return AttentionMetadata(
        cu_seqlens_q=mx.array(cu),
        context_lens=mx.array(context),
        block_tables=mx.array(tables),
        slot_mapping=mx.array(slots),
        cu_seqlens_q_host=cu,
        context_lens_host=context,
        block_tables_host=tables,
        slot_mapping_host=slots,
        max_q_len=int(q_lens.max()),
        max_context_len=int(context.max()),
        num_tokens=int(cu[-1]),
        block_size=block_size,
    )
