"""The paged KV cache tensors and the scatter that writes a forward pass's new K/V into them.

Layout per layer, for K and for V: `[num_blocks, block_size, num_kv_heads, head_dim]`. A token's KV lives at
flat slot `block * block_size + offset`, so one scatter over `slot_mapping` writes the whole packed batch,
whatever mix of sequences it holds.
"""

from __future__ import annotations

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


def write_kv(
    k_cache: mx.array, v_cache: mx.array, k_new: mx.array, v_new: mx.array, meta: AttentionMetadata
) -> tuple[mx.array, mx.array]:
    """Scatter new K/V `[T, Hkv, D]` into their slots; returns the updated caches (lazy, no host sync).

    The caller stores the returned arrays back (e.g. `cache.k[l], cache.v[l] = write_kv(...)`): MLX arrays
    are values, and keeping the update in the graph is what keeps the layer free of host syncs.
    """
    nb, bs, hkv, d = k_cache.shape
    if k_new.shape != v_new.shape or k_new.shape[1:] != (hkv, d) or k_new.shape[0] != meta.num_tokens:
        raise ValueError(
            f"write_kv: new K {k_new.shape} / V {v_new.shape} must both be [num_tokens={meta.num_tokens}, "
            f"num_kv_heads={hkv}, head_dim={d}] to match the cache {k_cache.shape} and the metadata"
        )
    if meta.block_size != bs:
        raise ValueError(f"write_kv: metadata built for block_size {meta.block_size}, cache has {bs}")
    slots, width, dtype = meta.slot_mapping, hkv * d, k_cache.dtype
    # Half-precision rows move as 32-bit words: the same bits, half the elements for the scatter to index.
    word = mx.uint32 if dtype.size == 2 and width % 2 == 0 else dtype
    written = []
    for cache, new in ((k_cache, k_new), (v_cache, v_new)):
        flat = cache.reshape(nb * bs, width).view(word)
        flat[slots] = new.astype(dtype).reshape(meta.num_tokens, width).view(word)
        written.append(flat.view(dtype).reshape(nb, bs, hkv, d))
    return written[0], written[1]
