"""The vision towers' patch embedding as one matmul.

mlx-vlm's `PatchEmbed` reshapes each pixel row (one temporal x spatial patch, channel-major) into a
`[t, p, p, c]` volume and runs a `Conv3d` whose kernel equals its stride and the volume: every output is one
dot product of the whole row with one filter, i.e. a matmul with the filters flattened in the row's order.
As a GEMM it reads the rows as they are (no reshape copy, no convolution kernel). Swapped at load
(`fix_model`), so mlx-vlm's own forward uses it too.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn


class MatmulPatchEmbed(nn.Module):
    """`proj(x)`, a Linear whose `[hidden, c * t * p * p]` weight is the Conv3d's `[hidden, t, p, p, c]` filters
    flattened in the pixel rows' order (named `proj` as before: mlx-vlm reads `patch_embed.proj.weight.dtype`)."""

    def __init__(self, conv: nn.Module):
        super().__init__()
        w = conv.proj.weight
        self.hidden_size = w.shape[0]
        self.proj = nn.Linear(w[0].size, w.shape[0], bias="bias" in conv.proj)
        self.proj.weight = w.transpose(0, 4, 1, 2, 3).reshape(w.shape[0], -1)
        if "bias" in conv.proj:
            self.proj.bias = conv.proj.bias

    def __call__(self, x: mx.array) -> mx.array:
        return self.proj(x.reshape(-1, self.proj.weight.shape[1]))


def matmul_patch_embed(tower: nn.Module) -> bool:
    """Swap the tower's Conv3d patch embedding for `MatmulPatchEmbed` (idempotent; anything that is not a
    plain Conv3d, e.g. quantized, is left alone). True when the tower now embeds by matmul."""
    embed = getattr(tower, "patch_embed", None)
    if isinstance(embed, MatmulPatchEmbed):
        return True
    if type(getattr(embed, "proj", None)) is not nn.Conv3d:
        return False
    tower.patch_embed = MatmulPatchEmbed(embed)
    return True
