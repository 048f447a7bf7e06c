"""The vision towers' MLPs at GEMM-friendly widths.

Qwen2.5-VL's vision MLP is `down(silu(gate(x)) * up(x))` with an intermediate width of 3420, which is not a
multiple of the GPU GEMM tile (128): MLX's CUDA matmuls at that width run at a fraction of the rate they reach
at 3456. Padding the intermediate axis with zero rows (gate/up) and zero columns (down) changes no value
(`silu(0) * 0 = 0`, and zero products add nothing), and gate and up become one matmul of twice the width.
The swap happens once at load (`fuse_gated_mlps`), on the loaded module, so mlx-vlm's own forward uses it too.
Qwen3-VL's plain `fc2(gelu(fc1(x)))` (width 4304) is padded the same way in place (`pad_plain_mlps`; gelu(0) = 0).
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from .fused_ops import linear_plus, swiglu_halves

GEMM_TILE = 128


def _padded(width: int) -> int:
    return -(-width // GEMM_TILE) * GEMM_TILE


class FusedGatedMLP(nn.Module):
    """`down(silu(gate(x)) * up(x))` with gate and up stacked, the intermediate axis zero-padded to the tile."""

    def __init__(self, gate: nn.Linear, up: nn.Linear, down: nn.Linear):
        super().__init__()
        inter, hidden = gate.weight.shape
        pad = _padded(inter) - inter

        def rows(w):   # [inter, ...] -> [padded inter, ...]
            return mx.pad(w, [(0, pad)] + [(0, 0)] * (w.ndim - 1)) if pad else w

        self.intermediate = inter
        self.gate_up = nn.Linear(hidden, 2 * (inter + pad), bias="bias" in gate)
        self.gate_up.weight = mx.concatenate([rows(gate.weight), rows(up.weight)], axis=0)
        if "bias" in gate:
            self.gate_up.bias = mx.concatenate([rows(gate.bias), rows(up.bias)], axis=0)
        self.down = nn.Linear(inter + pad, down.weight.shape[0], bias="bias" in down)
        self.down.weight = mx.pad(down.weight, [(0, 0), (0, pad)]) if pad else down.weight
        if "bias" in down:
            self.down.bias = down.bias

    def __call__(self, x: mx.array, residual: mx.array | None = None) -> mx.array:
        """The MLP's output, plus `residual` where given (added by the down projection's GEMM: `linear_plus`)."""
        return linear_plus(self.down, swiglu_halves(self.gate_up(x)), residual)


def fuse_gated_mlps(blocks) -> int:
    """Replace each block's plain-Linear gated MLP (`gate_proj`, `up_proj`, `down_proj`) by `FusedGatedMLP`;
    quantized or otherwise unusual MLPs are left alone. Returns how many were replaced."""
    replaced = 0
    for block in blocks:
        mlp = getattr(block, "mlp", None)
        parts = [getattr(mlp, name, None) for name in ("gate_proj", "up_proj", "down_proj")]
        if not all(type(p) is nn.Linear for p in parts):
            continue
        if ("bias" in parts[0]) != ("bias" in parts[1]):
            continue
        block.mlp = FusedGatedMLP(*parts)
        replaced += 1
    return replaced


def pad_plain_mlps(blocks) -> int:
    """Zero-pad each block's `linear_fc1` outputs and `linear_fc2` inputs to the GEMM tile, in place (the
    activation must map 0 to 0, as GELU does); quantized or already aligned MLPs are left alone."""
    padded = 0
    for block in blocks:
        mlp = getattr(block, "mlp", None)
        fc1, fc2 = getattr(mlp, "linear_fc1", None), getattr(mlp, "linear_fc2", None)
        if type(fc1) is not nn.Linear or type(fc2) is not nn.Linear:
            continue
        inter = fc1.weight.shape[0]
        pad = _padded(inter) - inter
        if not pad:
            continue
        fc1.weight = mx.pad(fc1.weight, [(0, pad), (0, 0)])
        if "bias" in fc1:
            fc1.bias = mx.pad(fc1.bias, [(0, pad)])
        fc2.weight = mx.pad(fc2.weight, [(0, 0), (0, pad)])
        padded += 1
    return padded
