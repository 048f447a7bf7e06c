"""Vision attention heads widened so each rotary half is whole 16-byte words, exactly.

Qwen3-VL's vision heads are 72 wide: each rotary half is 36 values, and MLX's CUDA elementwise kernels read such
rows slowly, whichever form the rotary embedding takes (fused_ops.py). Padding every half with zeros to the next
multiple of `PAIR_ALIGN` (36 -> 40: heads of 80) changes no value: the q/k/v rows of the stacked projection become
`[x1 | 0 | x2 | 0]` per head, so q.k gains only products of zeros; the rotation maps the zero pairs to zeros (the
rotary tables are padded with zero frequencies); v's padded columns give zero outputs, which zero columns of the
output projection drop; the softmax scale keeps the true head size. The swap happens once at load, on the loaded
module; mlx-vlm's own forward keeps working through the tower's `rot_pos_emb`, padded the same way.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from .fused_ops import PAIR_ALIGN, pairs_suit


def padded_half(head_dim: int) -> int:
    """The rotary half after padding (the half itself where `rope_pairs` already suits it)."""
    half = head_dim // 2
    return half if pairs_suit(head_dim) else -(-half // PAIR_ALIGN) * PAIR_ALIGN


def pad_rotary_heads(tower: nn.Module) -> int:
    """Pad the heads of every block's attention in `tower` (in place; idempotent) where a rotary half is not whole
    16-byte words; returns the number of blocks changed. Quantized or unusual attention is left alone."""
    changed, pad = 0, 0
    for block in tower.blocks:
        attn = getattr(block, "attn", None)
        qkv, proj = getattr(attn, "qkv", None), getattr(attn, "proj", None)
        if type(qkv) is not nn.Linear or type(proj) is not nn.Linear:
            continue
        d, heads = attn.head_dim, attn.num_heads
        if d % 2 or pairs_suit(d) or qkv.weight.shape[0] != 3 * heads * d:   # padded heads suit: idempotent
            continue
        half = d // 2
        pad = padded_half(d) - half
        cin = qkv.weight.shape[1]
        grow = [(0, 0)] * 3 + [(0, pad)]
        qkv.weight = mx.pad(qkv.weight.reshape(3, heads, 2, half, cin), grow + [(0, 0)]).reshape(-1, cin)
        if "bias" in qkv:
            qkv.bias = mx.pad(qkv.bias.reshape(3, heads, 2, half), grow).reshape(-1)
        cout = proj.weight.shape[0]
        proj.weight = mx.pad(proj.weight.reshape(cout, heads, 2, half), [(0, 0), (0, 0), (0, 0), (0, pad)]
                             ).reshape(cout, -1)
        attn.head_dim = 2 * (half + pad)     # attn.scale stays that of the true head size
        attn.rotary_half = half              # the true half, for the record
        changed += 1
    if changed:   # a second call pads nothing (its heads suit), so mlx-vlm's tables are padded once
        original = tower.rot_pos_emb          # mlx-vlm's tables for its own forward: zero frequencies appended

        def rot_pos_emb(grid_thw, original=original, pad=pad):
            freqs = original(grid_thw)
            return mx.pad(freqs, [(0, 0)] * (freqs.ndim - 1) + [(0, pad)])

        object.__setattr__(tower, "rot_pos_emb", rot_pos_emb)
    return changed
