"""The paged KV cache tensors and the scatter that writes a forward pass's new K/V into them.

Layout per layer, for K and for V: `[num_blocks, block_size, num_kv_heads, head_dim]`. A token's KV lives at
flat slot `block * block_size + offset`, so one scatter over `slot_mapping` writes the whole packed batch,
whatever mix of sequences it holds.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx

from .metadata import AttentionMetadata


class KVCache:
    """Per-layer K and V block arrays, allocated once at engine start from the planned block count."""

    def __init__(
        self, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: mx.Dtype
    ):
        if min(num_layers, num_blocks, block_size, num_kv_heads, head_dim) < 1:
            raise ValueError(
                "KVCache sizes must all be >= 1, got "
                f"num_layers={num_layers}, num_blocks={num_blocks}, block_size={block_size}, "
                f"num_kv_heads={num_kv_heads}, head_dim={head_dim}"
            )
        shape = (num_blocks, block_size, num_kv_heads, head_dim)
        self.num_layers, self.num_blocks, self.block_size = num_layers, num_blocks, block_size
        self.num_kv_heads, self.head_dim, self.dtype = num_kv_heads, head_dim, dtype
        self.k = [mx.zeros(shape, dtype=dtype) for _ in range(num_layers)]
        self.v = [mx.zeros(shape, dtype=dtype) for _ in range(num_layers)]
        mx.eval(self.k, self.v)

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.k) + sum(a.nbytes for a in self.v)


@dataclass(frozen=True)
class StackedHeads:
    """Heads `[first, first + count)` of a `[T, H, D]` stack (a q/k/v projection's output, a rotated q/k stack):
    the K or V a layer writes, named by where it lives so that the write can read it in place."""

    stack: mx.array
    first: int
    count: int

    def __post_init__(self):
        if self.stack.ndim != 3 or not (0 <= self.first and 1 <= self.count
                                        and self.first + self.count <= self.stack.shape[1]):
            raise ValueError(f"StackedHeads: heads [{self.first}, {self.first + self.count}) of a stack shaped "
                             f"{tuple(self.stack.shape)}: the stack must be [T, H, D] and hold them")

    @property
    def shape(self) -> tuple[int, int, int]:
        return (self.stack.shape[0], self.count, self.stack.shape[2])


def _word(dtype: mx.Dtype, head_dim: int) -> mx.Dtype:
    """Half-precision rows move as 32-bit words where a head is whole words: the same bits, half the elements
    for the scatter to index."""
    return mx.uint32 if dtype.size == 2 and head_dim % 2 == 0 else dtype


def head_rows(heads: mx.array | StackedHeads, dtype: mx.Dtype) -> mx.array:
    """`[T, Hkv * D]` rows of `heads` in `dtype`, as the cache write scatters them (`_word`). Of a `StackedHeads`
    the rows are a strided view of the stack's words, which the scatter reads in place; a `[T, Hkv, D]` view of
    a stack would be copied first, since MLX widens the element of a non-contiguous array only through a copy."""
    if isinstance(heads, StackedHeads):
        stack, first, count = heads.stack, heads.first, heads.count
    else:
        stack, first, count = heads, 0, heads.shape[1]
    tokens, num_heads, d = stack.shape
    word = _word(dtype, d)
    flat = stack.astype(dtype).reshape(tokens, num_heads * d)
    per_head = d
    if word != dtype:
        flat, per_head = flat.view(word), d // 2
    return flat[:, first * per_head:(first + count) * per_head]


def write_kv(
    k_cache: mx.array, v_cache: mx.array, k_new: mx.array | StackedHeads, v_new: mx.array | StackedHeads,
    meta: AttentionMetadata,
) -> tuple[mx.array, mx.array]:
    """Scatter new K/V `[T, Hkv, D]` (arrays, or `StackedHeads` of the stacks they are views of) into their
    slots; returns the updated caches (lazy, no host sync).

    The caller stores the returned arrays back (e.g. `cache.k[l], cache.v[l] = write_kv(...)`): MLX arrays
    are values, and keeping the update in the graph is what keeps the layer free of host syncs.
    """
    nb, bs, hkv, d = k_cache.shape
    if tuple(k_new.shape) != tuple(v_new.shape) or tuple(k_new.shape[1:]) != (hkv, d) \
            or k_new.shape[0] != meta.num_tokens:
        raise ValueError(
            f"write_kv: new K {tuple(k_new.shape)} / V {tuple(v_new.shape)} must both be [num_tokens="
            f"{meta.num_tokens}, num_kv_heads={hkv}, head_dim={d}] to match the cache {k_cache.shape} and the "
            "metadata"
        )
    if meta.block_size != bs:
        raise ValueError(f"write_kv: metadata built for block_size {meta.block_size}, cache has {bs}")
    dtype, word = k_cache.dtype, _word(k_cache.dtype, d)
    written = []
    for cache, new in ((k_cache, k_new), (v_cache, v_new)):
        flat = cache.reshape(nb * bs, hkv * d).view(word)
        flat[meta.slot_mapping] = head_rows(new, dtype)
        written.append(flat.view(dtype).reshape(nb, bs, hkv, d))
    return written[0], written[1]
