"""The language model's attention, swapped for paged varlen attention over the engine's KV cache.

vllm-metal's approach: each decoder layer's attention module is wrapped; the wrapper reuses the original
projections and rotary embedding, and replaces only the cache write and the attention itself. When no paged
context is set the wrapper delegates to the original module, so the model still works as mlx-vlm built it
(generation, its own tests). The context is an explicit object set around one packed forward pass
(nano-vllm style) rather than arguments threaded through mlx-vlm's layer signatures.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable, Iterator

import mlx.core as mx
import mlx.nn as nn

from batchjob.metal_backend import AttentionMetadata, KVCache, StackedHeads, write_kv

from .cuda_fused import active as active_fused_kernels
from .cuda_fused import qk_norm_rope_suits
from .fused_ops import RotaryTables, linear_plus, rope_heads

AttentionFn = Callable[..., mx.array]  # (q, k_cache, v_cache, meta, scale, *, new_kv=None) -> [T, Hq, D]


@dataclass
class AttentionContext:
    """Everything a layer needs for one packed forward: metadata, the cache, the attention function."""

    meta: AttentionMetadata
    kv_cache: KVCache
    attention: AttentionFn
    rope: RotaryTables | None = None   # the forward's rotary tables split once for all layers (fused_ops)


_CONTEXT: AttentionContext | None = None


@contextmanager
def attention_context(ctx: AttentionContext) -> Iterator[None]:
    global _CONTEXT
    previous, _CONTEXT = _CONTEXT, ctx
    try:
        yield
    finally:
        _CONTEXT = previous


class PagedAttention(nn.Module):
    """Wraps one mlx-vlm Qwen2-VL / Qwen3-VL attention module (q/k/v/o projections, q/k norms, M-RoPE)."""

    def __init__(self, inner: nn.Module, layer_index: int):
        super().__init__()
        self.inner = inner
        self.layer_index = layer_index

    @property
    def rotary_emb(self):
        """mlx-vlm's decoder reads `layers[0].self_attn.rotary_emb`; keep that working through the wrapper."""
        return self.inner.rotary_emb

    def __call__(self, x, mask=None, cache=None, position_ids=None, position_embeddings=None, residual=None):
        """The attention's output (`residual` plus it, where given: `decoder_layer.run_layer`)."""
        ctx = _CONTEXT
        if ctx is None:
            out = self.inner(x, mask=mask, cache=cache, position_ids=position_ids,
                             position_embeddings=position_embeddings)
            return out if residual is None else residual + out
        if position_embeddings is None:
            raise ValueError("paged attention needs precomputed M-RoPE (cos, sin); the engine's forward passes them")
        inner = self.inner
        _, num_tokens, _ = x.shape  # the packed batch is one row: [1, T, hidden]
        hq, hkv, d = inner.n_heads, inner.n_kv_heads, inner.head_dim
        cos2, sin2 = (table[0] for table in position_embeddings)   # [T, D]: one row per token
        # The rotary embedding is elementwise: applied token-major (heads on axis 1) it gives the same values as
        # mlx-vlm's head-major call, in the packed layout that the cache write and SDPA's views read without a
        # transpose copy; compiled, it is one kernel (for q and k together where no q/k norm comes between).
        cos, sin = cos2[:, None, :], sin2[:, None, :]   # broadcast over the heads (axis 1 here)
        if "qkv_proj" in inner:   # q/k/v stacked at load (lm_fusion.py): one GEMM, then views per head group
            qkv = inner.qkv_proj(x).reshape(num_tokens, hq + 2 * hkv, d)
            q, k, v = qkv[:, :hq], qkv[:, hq:hq + hkv], qkv[:, hq + hkv:]
        else:
            qkv = None
            q, k, v = (proj(x).reshape(num_tokens, h, d) for proj, h in
                       ((inner.q_proj, hq), (inner.k_proj, hkv), (inner.v_proj, hkv)))
        fused = fused_qk_norm_rope(inner, qkv)
        qk = None   # the rotated q/k stack (q's heads first) where one exists: q and k are views of it
        if fused is not None:   # one CUDA kernel
            qk = fused(qkv, hq, hkv, inner.q_norm, inner.k_norm, cos2, sin2)
            q, k = qk[:, :hq], qk[:, hq:]
        elif hasattr(inner, "q_norm"):   # Qwen3-VL: per-head RMSNorm of q and k before the rotary embedding
            q, k, _ = rotate_qk(inner.q_norm(q), inner.k_norm(k), cos, sin, ctx.rope)
        else:
            q, k, qk = rotate_qk(q, k, cos, sin, ctx.rope, stacked=qkv)
        cache, layer = ctx.kv_cache, self.layer_index
        # K and V named by the stacks they are views of: the cache write reads them there, with no copy first
        k_new = k if qk is None else StackedHeads(qk, hq, hkv)
        v_new = v if qkv is None else StackedHeads(qkv, hq + hkv, hkv)
        cache.k[layer], cache.v[layer] = write_kv(cache.k[layer], cache.v[layer], k_new, v_new, ctx.meta)
        # The new K/V go along: sequences with nothing cached attend to them directly (no gather from the cache).
        out = ctx.attention(q, cache.k[layer], cache.v[layer], ctx.meta, inner.scale, new_kv=(k, v),
                            **attention_hints(ctx.attention, qk))
        return linear_plus(inner.o_proj, out.reshape(1, num_tokens, -1), residual)


def rotate_qk(q: mx.array, k: mx.array, cos: mx.array, sin: mx.array, tables: RotaryTables | None,
              stacked: mx.array | None = None) -> tuple[mx.array, mx.array, mx.array | None]:
    """q `[T, Hq, D]` and k `[T, Hkv, D]` rotated (`fused_ops.rope_heads`), and the rotated stack they are views of
    (or None): in one kernel over `stacked`, the q/k/v projection's output they are still views of (heads on
    axis 1, q's first), else each alone."""
    hq, hkv = q.shape[1], k.shape[1]
    if stacked is not None:
        qk = rope_heads(stacked, hq + hkv, cos, sin, tables)
        return qk[:, :hq], qk[:, hq:], qk
    return rope_heads(q, hq, cos, sin, tables), rope_heads(k, hkv, cos, sin, tables), None


def attention_hints(attention: AttentionFn, qk: mx.array | None) -> dict:
    """Extra arguments for the attention call: an attention that reads q in place (the Hopper kernel,
    `reads_q_rows`) gets the rotated q/k stack q is a view of, where there is one, instead of a copy of q."""
    return {"q_rows": qk} if qk is not None and getattr(attention, "reads_q_rows", False) else {}


def fused_qk_norm_rope(inner: nn.Module, qkv: mx.array | None) -> Callable[..., mx.array] | None:
    """The active CUDA kernel for q/k norm + rotary where this attention module (mlx-vlm's) can use it: q/k
    norms (Qwen3), q/k/v stacked (`qkv`, `[T, heads, D]`), and a dtype and head size the kernel takes; else None."""
    fused = active_fused_kernels().qk_norm_rope
    if fused is None or qkv is None or not hasattr(inner, "q_norm"):
        return None
    return fused if qk_norm_rope_suits(qkv.dtype, qkv.shape[-1]) else None


def _first_attention(language_model: nn.Module) -> nn.Module | None:
    """mlx-vlm's attention module of the first decoder layer (under the paged wrapper if installed), or None."""
    layers = language_model.model.layers
    return getattr(layers[0].self_attn, "inner", layers[0].self_attn) if layers else None


def decoder_heads(language_model: nn.Module) -> tuple[int, int, int]:
    """(q heads, kv heads, head size) of the decoder's attention."""
    attn = _first_attention(language_model)
    return attn.n_heads, attn.n_kv_heads, attn.head_dim


def qk_norm_heads(language_model: nn.Module) -> tuple[int, int, int] | None:
    """(q heads, kv heads, head size) where the decoder normalises q and k per head before the rotary embedding
    (Qwen3), else None."""
    return decoder_heads(language_model) if hasattr(_first_attention(language_model), "q_norm") else None


def install_paged_attention(language_model: nn.Module) -> int:
    """Wrap every decoder layer's attention in place (idempotent); returns the number of layers."""
    layers = language_model.model.layers
    for i, layer in enumerate(layers):
        if not isinstance(layer.self_attn, PagedAttention):
            layer.self_attn = PagedAttention(layer.self_attn, i)
    return len(layers)
