"""How many tokens one forward pass packs when `max_num_batched_tokens` is `auto`.

On a GPU every forward pass has a fixed cost (building and launching its graph, the sync that returns its
logits) and its matmuls run near the hardware's ceiling only when they are wide, so one forward over a batch
of clips' prompts beats two over halves of it: a fixed 16,384 split 8 prompts of 2,135 tokens into a 16,384-
and a 696-token forward. The limit is memory: a forward's activations grow with its tokens. So on a GPU the
budget is as many tokens as ACTIVATION_SHARE of the memory left after the weights holds activations for, capped
at GPU_MAX_TOKENS (15 Qwen2.5-VL clips of 16 frames at 448x448). The CPU keeps 8192: its matmuls gain nothing
from width and its memory is the host's, shared with the decoders.
"""

from __future__ import annotations

import math

CPU_TOKENS = 8192
GPU_MAX_TOKENS = 32768
GPU_MIN_TOKENS = 1024
ACTIVATION_SHARE = 0.45   # of the device memory left after the weights (the rest: KV cache, vision, allocator slack)
# A paced forward (runner.LAYER_LAG) keeps LIVE_BASE + LIVE_PER_QUEUED_LAYER * lag layers' widths alive per token:
# the layers queued on the device, the one being built, their inputs and outputs. Fitted with some margin to
# the peaks `scripts/diag_varied_forward.py --lag N` measured on an H100 (benchmarks/results/README.md, twelfth
# session), equal and ragged batches alike.
LIVE_BASE = 2.5
LIVE_PER_QUEUED_LAYER = 1.6
LAYER_REUSE = 2.0   # one layer's buffers, with margin: what MLX's cache must hold for the next layers to reuse them


def layer_widths(*, hidden: int, intermediate: int, num_heads: int, num_kv_heads: int, head_dim: int) -> int:
    """Elements per token one decoder layer writes: the residual stream and its norm, q/k/v, the attention output,
    and the MLP's gate, up and product (the widest point)."""
    return 4 * hidden + (num_heads + 2 * num_kv_heads) * head_dim + 3 * intermediate


def activation_bytes_per_token(*, hidden: int, intermediate: int, num_heads: int, num_kv_heads: int, head_dim: int,
                               dtype_bytes: int, layer_lag: int) -> int:
    """Peak activation bytes per token of one forward paced at `layer_lag` layers ahead (runner.LAYER_LAG): what
    the memory budget must hold for it."""
    live = LIVE_BASE + LIVE_PER_QUEUED_LAYER * max(0, layer_lag)
    widths = layer_widths(hidden=hidden, intermediate=intermediate, num_heads=num_heads, num_kv_heads=num_kv_heads,
                          head_dim=head_dim)
    return int(live * widths * dtype_bytes)


def reused_bytes_per_token(*, hidden: int, intermediate: int, num_heads: int, num_kv_heads: int, head_dim: int,
                           dtype_bytes: int) -> int:
    """Bytes per token MLX's cache of freed buffers must hold for one layer's buffers to come back for the layers
    after it (every layer of a pass allocates the same sizes); more only keeps memory idle."""
    widths = layer_widths(hidden=hidden, intermediate=intermediate, num_heads=num_heads, num_kv_heads=num_kv_heads,
                          head_dim=head_dim)
    return int(LAYER_REUSE * widths * dtype_bytes)


def auto_batched_tokens(device: str, *, memory_bytes: int | None, weights_bytes: int, bytes_per_token: int,
                        block_size: int = 16) -> int:
    """The token budget for `device` ("cpu", "cuda", "metal") with `memory_bytes` of device memory (None:
    unknown, treated like the CPU), a multiple of `block_size`."""
    if device == "cpu" or not memory_bytes:
        return CPU_TOKENS
    spare = max(0, memory_bytes - weights_bytes)
    fit = int(ACTIVATION_SHARE * spare) // max(1, bytes_per_token)
    tokens = max(GPU_MIN_TOKENS, min(GPU_MAX_TOKENS, fit))
    return max(block_size, tokens // block_size * block_size)


def smallest_budget(*, weights_bytes: int, kv_request_bytes: int, bytes_per_token: int,
                    tokens: int | None = None) -> int:
    """The least GPU memory budget (bytes) that holds the weights, one forward's activations and the KV cache of one
    maximum-length request, at every budget above it too: for `tokens` per forward, or (None) for `auto`, whose
    tokens follow the budget (ACTIVATION_SHARE of it after the weights, within GPU_MIN_TOKENS..GPU_MAX_TOKENS)."""
    if tokens is not None:
        return weights_bytes + tokens * bytes_per_token + kv_request_bytes
    floor = GPU_MIN_TOKENS * bytes_per_token + kv_request_bytes
    share = math.ceil(kv_request_bytes / (1 - ACTIVATION_SHARE))   # what auto's activations leave for the KV
    cap = GPU_MAX_TOKENS * bytes_per_token + kv_request_bytes
    return weights_bytes + min(cap, max(floor, share))


def language_model_shape(language_model, kv_shape: tuple[int, int]) -> dict:
    """The decoder's widths for `activation_bytes_per_token` (MoE: the active experts' width)."""
    args = language_model.args
    inter = getattr(args, "intermediate_size", 0) or 0
    moe = (getattr(args, "moe_intermediate_size", 0) or 0) * (getattr(args, "num_experts_per_tok", 0) or 0)
    return dict(hidden=args.hidden_size, intermediate=max(inter, moe), num_heads=args.num_attention_heads,
                num_kv_heads=kv_shape[0], head_dim=kv_shape[1])
