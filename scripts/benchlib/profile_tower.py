"""Where one clip's vision tower spends its time: the steps outside the blocks (upload, plan, patch embedding,
position embedding, window order, mergers), each step of a block timed alone with the clip's real shapes, the
whole block, and the whole tower as the engine runs it; plus host syncs in the engine's tower and in mlx-vlm's.

`other_ms` = the engine's whole tower - (outside steps + blocks x whole block): what the steps leave unexplained
(launch gaps, allocation, the lazy graph's own overhead), reported rather than hidden.
"""
from __future__ import annotations

import time

from .flops import vision_block_linear_flops, vision_flops_per_clip
from .syncs import count_host_syncs
from .timing import ms_per_call, timed

CATEGORIES = {"matmuls": ("qkv", "proj", "mlp_up", "mlp_down"), "attention": ("sdpa",), "norms": ("norm1", "norm2"),
              "rotary": ("rope",), "elementwise": ("mlp_act", "residual_adds")}


def towers_seconds(ckpt, clips, repeats: int) -> float:
    """Seconds per clip for `clips` (prepared inputs) encoded as the classifier encodes a step's clips
    (`Classifier._video_rows`: each tower started with `async_eval` while the next graph is built); median of
    `repeats` after one untimed run."""
    import mlx.core as mx

    def run():
        feats = []
        for inputs in clips:
            f = ckpt.encode_clip(inputs)
            mx.async_eval(f)
            feats.append(f)
        mx.eval(feats)

    run()
    return timed(run, repeats)[0] / len(clips)


def _planner(model_type: str):
    from batchjob.engine.qwen2_vision import plan_qwen2
    from batchjob.engine.qwen3_vision import plan_qwen3
    from batchjob.engine.qwen25_vision import plan_qwen25

    return {"qwen2_5_vl": plan_qwen25, "qwen2_vl": plan_qwen2, "qwen3_vl": plan_qwen3}[model_type]


def profile_tower(bench, inputs, ceiling: float, *, inner: int, repeats: int) -> dict:
    """Profile the tower of `bench` (a workload.BenchModel) on one prepared clip `inputs`."""
    import mlx.core as mx

    from batchjob.engine.patchify import device_pixels
    from batchjob.engine.vision_plan import TowerPlan

    ckpt, model_type, dims = bench.checkpoint, bench.model_type, bench.dims
    tower, dtype = ckpt.model.vision_tower, ckpt.dtype
    grid = tuple(inputs.grid_thw)
    plan_fn = _planner(model_type)
    time_ = lambda fn, n=inner: ms_per_call(fn, inner=n, repeats=repeats)  # noqa: E731
    out: dict = {"grid_thw": list(grid), "patches": int(grid[0] * grid[1] * grid[2]), "blocks": len(tower.blocks)}
    steps: dict = {}
    with mx.stream(bench.classifier._device):
        # as the engine gets them: patch bytes from the decoders, normalised on the device (patchify.py)
        steps["upload"] = time_(lambda: mx.array(device_pixels(inputs)).astype(dtype))
        px = mx.array(device_pixels(inputs)).astype(dtype)
        mx.eval(px)

        def build_plan():
            getattr(tower, "_batchjob_plans", {}).clear()
            p = plan_fn(tower, [grid])
            return [p.rope.cos, p.rope.sin] if isinstance(p, TowerPlan) else [p.blocks.rope.cos, p.pos_weights]

        steps["plan_first_clip_of_a_shape"] = time_(build_plan, 1)
        plan = plan_fn(tower, [grid])
        blocks_plan = plan if isinstance(plan, TowerPlan) else plan.blocks
        steps["patch_embed"] = time_(lambda: tower.patch_embed(px))
        h = tower.patch_embed(px)
        if model_type == "qwen3_vl":
            from batchjob.engine.qwen3_vision import position_embedding

            steps["position_embedding"] = time_(lambda: position_embedding(tower, plan))
            h = h + position_embedding(tower, plan)
        if blocks_plan.order is not None:
            unit = tower.spatial_merge_unit
            steps["window_order"] = time_(lambda: h.reshape(-1, unit, h.shape[-1])[blocks_plan.order])
            h = h.reshape(-1, unit, h.shape[-1])[blocks_plan.order].reshape(h.shape)
        mx.eval(h)
        kinds = _block_kinds(tower, blocks_plan)
        out["block_kinds"] = {}
        for kind, (index, count) in kinds.items():
            out["block_kinds"][kind] = _block_steps(tower.blocks[index], h, blocks_plan.segments[index],
                                                    blocks_plan.rope, time_, count)
        steps["merger"] = time_(lambda: tower.merger(h))
        for i, merger in enumerate(getattr(tower, "deepstack_merger_list", [])):
            steps[f"deepstack_merger_{i}"] = time_(lambda m=merger: m(h))
        if blocks_plan.restore is not None:
            merged = tower.merger(h)
            mx.eval(merged)
            steps["restore_order"] = time_(lambda: merged[blocks_plan.restore])
        encode = lambda: ckpt.encode_clip(inputs)  # noqa: E731
        out["engine_tower_ms"] = time_(encode, 1)   # as the engine calls it: from host pixels, plan cached
        with count_host_syncs() as log:
            mx.eval(encode())
        out["engine_host_syncs"] = log.syncs
        with count_host_syncs() as log:
            t0 = time.perf_counter()
            mx.eval(tower(px, mx.array([list(grid)])))
            out["mlx_vlm_tower_ms_once"] = (time.perf_counter() - t0) * 1e3
        out["mlx_vlm_host_syncs"] = log.syncs
        out["mlx_vlm_sync_sites"] = dict(log.sites.most_common(6))
    out["steps_ms"] = steps
    blocks_ms = sum(k["block_ms"] * k["count"] for k in out["block_kinds"].values())
    outside = sum(v for k, v in steps.items() if k != "plan_first_clip_of_a_shape")
    out["blocks_ms"] = blocks_ms
    out["outside_blocks_ms"] = outside
    out["other_ms"] = out["engine_tower_ms"] - blocks_ms - outside
    flops = vision_flops_per_clip(grid, len(tower.blocks), model_type, dims)
    out["flops"] = flops
    out["mfu_tower"] = flops / ceiling / (out["engine_tower_ms"] / 1e3)
    out["mfu_blocks"] = (len(tower.blocks) * vision_block_linear_flops(out["patches"], model_type, dims) / ceiling
                         / (blocks_ms / 1e3))
    return out


def _block_kinds(tower, plan) -> dict:
    """{kind: (first block of that kind, how many)}: windowed and full-attention blocks time differently."""
    full = set(getattr(tower, "fullatt_block_indexes", []) or [])
    kinds: dict = {}
    for i in range(len(tower.blocks)):
        kind = "full_attention" if (i in full or plan.order is None) else "window_attention"
        first, count = kinds.get(kind, (i, 0))
        kinds[kind] = (first, count + 1)
    return kinds


def _block_steps(block, h, segments, rope, time_, count: int) -> dict:
    import mlx.core as mx

    from batchjob.engine.vision_attention import packed_attention, rotated_qkv

    attn, mlp = block.attn, block.mlp
    heads, hd = attn.num_heads, attn.head_dim
    steps = {"norm1": time_(lambda: block.norm1(h))}
    x = block.norm1(h)
    steps["qkv"] = time_(lambda: attn.qkv(x))
    qkv = attn.qkv(x)
    mx.eval(qkv)
    steps["rope"] = time_(lambda: rotated_qkv(qkv, heads, hd, rope)[:2])   # the engine's form (fused_ops.py)
    q, k, v = rotated_qkv(qkv, heads, hd, rope)
    views = []
    for g in segments.groups:   # the segment plan's SDPA calls on ready q/k/v: attention math alone
        parts = [a if g.gather is None else a[g.gather] for a in (q, k, v)]
        views.append([a.reshape(g.count, g.length, heads, hd).transpose(0, 2, 1, 3) for a in parts])
    mx.eval(views)
    steps["sdpa"] = time_(lambda: [mx.fast.scaled_dot_product_attention(*w, scale=attn.scale) for w in views])
    attended = mx.zeros((x.shape[0], heads * hd), dtype=x.dtype)   # the attention output (padded heads: wider)
    steps["proj"] = time_(lambda: attn.proj(attended))
    # qkv, rope, SDPA, proj and the reshapes/gathers between them (not in the categories: it overlaps them)
    steps["attention_whole"] = time_(lambda: packed_attention(attn, x, segments, rope))
    o = packed_attention(attn, x, segments, rope)
    mx.eval(o)
    h1 = h + o
    steps["norm2"] = time_(lambda: block.norm2(h1))
    y = block.norm2(h1)
    mx.eval(h1, y)
    steps["residual_adds"] = 2 * time_(lambda: h + o)
    up = mlp.gate_up if hasattr(mlp, "gate_up") else mlp.linear_fc1
    down = mlp.down if hasattr(mlp, "down") else mlp.linear_fc2
    steps["mlp_up"] = time_(lambda: up(y))
    u = up(y)
    mx.eval(u)
    if hasattr(mlp, "gate_up"):
        from batchjob.engine.fused_ops import swiglu_halves

        act = lambda: swiglu_halves(u)  # noqa: E731
    else:
        act = lambda: mlp.act_fn(u)  # noqa: E731
    steps["mlp_act"] = time_(act)
    a = act()
    mx.eval(a)
    steps["mlp_down"] = time_(lambda: down(a))

    def whole():
        z = h + packed_attention(attn, block.norm1(h), segments, rope)
        return z + mlp(block.norm2(z))

    block_ms = time_(whole)
    categories = {c: sum(steps.get(k, 0.0) for k in ks) for c, ks in CATEGORIES.items()}
    return {"count": count, "steps_ms": steps, "block_ms": block_ms, "categories_ms": categories,
            "other_ms": block_ms - sum(categories.values())}
