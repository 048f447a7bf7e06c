#!/usr/bin/env python
"""Where the Qwen2.5-VL vision tower's time goes on one device: each step of a block timed alone, the
whole tower as the engine runs it, and candidate rewrites of the costly steps, side by side.

Random bf16 weights in Qwen2.5-VL-7B's vision shape (hidden 1280, 16 heads, intermediate 3420), one clip of
`--frames` frames at `--size`. Each step is timed by queueing `--inner` independent evaluations and syncing
once, so launch latency is amortised the way a full tower hides it. Prints a table (ms per call, share of a
block) and writes JSON.

    python scripts/profile_vision.py --blocks 4 --out vision_profile.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import numpy as np


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, default=4)
    parser.add_argument("--frames", type=int, default=16)
    parser.add_argument("--size", type=int, nargs=2, default=(448, 448))
    parser.add_argument("--inner", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--small", action="store_true", help="tiny dims (CPU check of the script)")
    parser.add_argument("--out", default="vision_profile.json")
    args = parser.parse_args()

    import mlx.core as mx
    import mlx.nn as nn
    from mlx_vlm.models.qwen2_5_vl.config import VisionConfig
    from mlx_vlm.models.qwen2_5_vl.vision import VisionModel

    from batchjob.engine import vision_attention as va
    from batchjob.engine.qwen25_vision import encode_qwen25, patch_window_index

    hidden, heads, inter = (128, 2, 256) if args.small else (1280, 16, 3420)
    cfg = VisionConfig(depth=args.blocks, hidden_size=hidden, num_heads=heads, intermediate_size=inter,
                       out_hidden_size=3584 if not args.small else 256,
                       fullatt_block_indexes=[args.blocks - 1])
    tower = VisionModel(cfg)
    tower.set_dtype(mx.bfloat16)
    mx.eval(tower.parameters())
    patch_window_index(tower)

    t = args.frames // 2
    gh, gw = args.size[0] // 14, args.size[1] // 14
    grid_thw = [(t, gh, gw)]
    tokens = t * gh * gw
    px = mx.random.normal((tokens, 3 * 2 * 14 * 14)).astype(mx.bfloat16)
    grid = mx.array([list(g) for g in grid_thw])
    mx.eval(px)

    def timeit(fn):
        mx.eval(fn())
        times = []
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            mx.eval([fn() for _ in range(args.inner)])
            times.append((time.perf_counter() - t0) / args.inner * 1e3)
        return statistics.median(times)

    rows: dict[str, float] = {}

    def row(name, fn):
        rows[name] = timeit(fn)
        print(f"{name:44s} {rows[name]:9.3f} ms", flush=True)

    # Inputs to one block as the engine sees them.
    block = tower.blocks[0]
    x = mx.random.normal((tokens, hidden)).astype(mx.bfloat16)
    rotary = tower.rot_pos_emb(grid)
    window_index, cu_window = tower.get_window_index(grid)
    windows = va.segment_plan(np.array(cu_window))
    frames = va.segment_plan(va.frame_boundaries(grid_thw))
    mx.eval(x, rotary)
    attn = block.attn
    hd = attn.head_dim
    apply_rope = sys.modules[type(attn).__module__].apply_rotary_pos_emb_vision
    qkv = attn.qkv(x).reshape(tokens, 3, heads, hd)
    q, k, v = qkv[:, 0], qkv[:, 1], qkv[:, 2]
    mx.eval(qkv, q, k, v)
    g = windows.groups[0]
    qw, kw, vw = (a.reshape(g.count, g.length, heads, hd).transpose(0, 2, 1, 3) for a in (q, k, v))
    qw, kw, vw = mx.contiguous(qw), mx.contiguous(kw), mx.contiguous(vw)
    f = frames.groups[0]
    qf, kf, vf = (mx.contiguous(a.reshape(f.count, f.length, heads, hd).transpose(0, 2, 1, 3)) for a in (q, k, v))
    mx.eval(qw, kw, vw, qf, kf, vf)
    attn_out = mx.random.normal((tokens, hidden)).astype(mx.bfloat16)
    gate = mx.random.normal((tokens, inter)).astype(mx.bfloat16)
    mx.eval(attn_out, gate)

    print(f"# {mx.default_device()}, {tokens} patches, {g.count} windows of {g.length}, {f.count} frames of "
          f"{f.length}", flush=True)
    row("patch_embed (Conv3d)", lambda: tower.patch_embed(px))
    w = tower.patch_embed.proj.weight  # [out, t, h, w, in] (MLX channels-last)
    w_mat = w.transpose(0, 4, 1, 2, 3).reshape(w.shape[0], -1).T   # rows in (c, t, h, w) order, as px is laid out
    mx.eval(w_mat)
    row("patch_embed as one matmul", lambda: px @ w_mat)
    diff = mx.abs(tower.patch_embed(px).astype(mx.float32) - (px @ w_mat).astype(mx.float32)).max().item()
    rows["patch_embed_matmul_max_abs_diff"] = diff
    print(f"{'  conv vs matmul max |diff|':44s} {diff:9.3g}", flush=True)
    row("rot_pos_emb + window index (host)", lambda: tower.rot_pos_emb(grid))
    row("norm1", lambda: block.norm1(x))
    row("qkv linear", lambda: attn.qkv(x))
    row("rope q (mlx-vlm, cos/sin per call)", lambda: apply_rope(q[None], rotary)[0])
    cos = mx.tile(mx.cos(rotary)[:, None, :], (1, 1, 2))
    sin = mx.tile(mx.sin(rotary)[:, None, :], (1, 1, 2))
    mx.eval(cos, sin)

    def rope_pre(t_):
        half = t_.shape[-1] // 2
        rot = mx.concatenate([-t_[..., half:], t_[..., :half]], axis=-1)
        return (t_ * cos + rot * sin).astype(t_.dtype)

    row("rope q (cos/sin precomputed)", lambda: rope_pre(q))
    rope_c = mx.compile(rope_pre)
    row("rope q (precomputed, compiled)", lambda: rope_c(q))
    row("window gather+transpose q,k,v", lambda: [a.reshape(g.count, g.length, heads, hd).transpose(0, 2, 1, 3)
                                                  * 1 for a in (q, k, v)])
    row("SDPA windows", lambda: mx.fast.scaled_dot_product_attention(qw, kw, vw, scale=attn.scale))
    row("SDPA frames (full-attention block)", lambda: mx.fast.scaled_dot_product_attention(qf, kf, vf,
                                                                                         scale=attn.scale))

    def manual(qq, kk, vv):
        s = (qq * attn.scale) @ kk.swapaxes(-1, -2)
        return mx.softmax(s.astype(mx.float32), axis=-1).astype(qq.dtype) @ vv

    row("attention windows, matmul+softmax", lambda: manual(qw, kw, vw))
    row("packed_attention (whole, windows)", lambda: va.packed_attention(attn, x, windows, rotary))
    row("packed_attention (whole, frames)", lambda: va.packed_attention(attn, x, frames, rotary))
    row("proj linear", lambda: attn.proj(attn_out))
    row("norm2", lambda: block.norm2(x))
    row("mlp gate linear", lambda: block.mlp.gate_proj(x))
    row("silu(gate) * up", lambda: nn.silu(gate) * gate)
    row("mlp down linear", lambda: block.mlp.down_proj(gate))
    row("mlp (whole)", lambda: block.mlp(x))

    def block_fn(h):
        h = h + va.packed_attention(attn, block.norm1(h), windows, rotary)
        return h + block.mlp(block.norm2(h))

    row("block (window attention, as engine)", lambda: block_fn(x))
    block_c = mx.compile(block_fn)
    row("block compiled (mx.compile)", lambda: block_c(x))
    row("merger", lambda: tower.merger(x))

    def whole(name):
        mx.eval(encode_qwen25(tower, px, grid_thw))
        ntimes = []
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            mx.eval(encode_qwen25(tower, px, grid_thw))
            ntimes.append((time.perf_counter() - t0) * 1e3)
        rows[name] = statistics.median(ntimes)
        print(f"{name:44s} {rows[name]:9.3f} ms ({args.blocks} blocks)", flush=True)

    whole("encode_qwen25 (whole tower, mlx-vlm MLPs)")
    # The engine's load-time swap: gate/up fused and zero-padded to the GEMM tile (batchjob.engine.vision_mlp).
    from batchjob.engine.vision_mlp import fuse_gated_mlps

    fuse_gated_mlps(tower.blocks)
    mx.eval(tower.parameters())
    tables = va.rope_tables(rotary)
    mx.eval(tables.cos, tables.sin)
    row("mlp fused + padded", lambda: block.mlp(x))
    row("packed_attention (rope tables, windows)", lambda: va.packed_attention(attn, x, windows, tables))

    def block_engine(h):
        h = h + va.packed_attention(attn, block.norm1(h), windows, tables)
        return h + block.mlp(block.norm2(h))

    row("block (engine: rope tables, fused MLP)", lambda: block_engine(x))
    whole("encode_qwen25 (whole tower, as the engine)")
    flops_block = 2.0 * tokens * (hidden * 3 * hidden + hidden * hidden + 3 * hidden * inter)
    report = {"device": str(mx.default_device()), "tokens": tokens, "blocks": args.blocks,
              "linear_flops_per_block": flops_block, "ms": rows}
    with open(args.out, "w") as fh:
        json.dump(report, fh, indent=1)


if __name__ == "__main__":
    main()
