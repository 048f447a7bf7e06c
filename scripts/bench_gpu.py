#!/usr/bin/env python
"""The engine on one GPU at 7B scale: throughput, MFU against measured matmul ceilings, attention paths, and
Hugging Face transformers on torch as the baseline users would otherwise run; one run, one table.

Model: random bf16 weights in Qwen2.5-VL-7B's shape (text hidden 3584, 28 layers, 28 q / 4 kv heads,
intermediate 18944; vision depth 32, hidden 1280, 16 heads, intermediate 3420), cut to `--layers` text layers
and `--vision-layers` vision blocks so a run fits a time budget (figures are also given per layer). The
vocabulary is the synthetic tokenizer's (~1k ids): the LM head runs only at each request's last position, so
the real 152k vocabulary would add well under 1% of the FLOPs.

Workload: `--clips` clips x `--questions` questions, `--frames` frames at `--size` (16 x 448x448 = 2,048 video
tokens per clip), inputs prepared once up front (the pipeline prepares them in decode workers) and given to
every path alike. Also 8 distinct clips with one question each (no sharing to help), 8 clips of different
lengths (a ragged LM prefill, against mlx-vlm's forward padded to the longest), the attention-only
cases (packed prefill, the mixed 30,000 + 5,000 + 10 case, followers over a cached video prefix), and MLX and
torch bf16 matmul ceilings measured in the same process.

    python scripts/bench_gpu.py --layers 4 --vision-layers 8 --out benchmarks/results
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import gc
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

import benchlib.env
from batchjob.synthetic.random_engine import QWEN25_VL_7B, SMOKE, build_random_model, scaled_config
from benchlib.ceilings import median, mlx_matmul_ceiling, torch_matmul_ceiling

DIMS = dict(QWEN25_VL_7B)
QUESTIONS = ["What is the person doing in the video?", "Which object moves first?",
             "Where does the action take place?", "What happens right after the door opens?"]


# --- FLOP counts (multiply-adds x 2) ---------------------------------------------------------------------
def lm_layer_linear_flops_per_token(d=DIMS) -> float:
    hd = d["hidden"] // d["heads"]
    params = d["hidden"] * (d["heads"] * hd) * 2 + d["hidden"] * (d["kv_heads"] * hd) * 2 + 3 * d["hidden"] * d["inter"]
    return 2.0 * params


def lm_attention_flops(q_len: int, cached: int, d=DIMS) -> float:
    """Per layer: QK^T and PV over the visible keys, causal (row j sees cached + j + 1)."""
    visible = q_len * cached + q_len * (q_len + 1) / 2
    return 4.0 * d["hidden"] * visible


def vision_flops_per_clip(grid, v_layers: int, d=DIMS) -> float:
    t, h, w = grid
    patches = t * h * w
    vh, vi = d["v_hidden"], d["v_inter"]
    per_layer_linear = 2.0 * patches * (vh * 3 * vh + vh * vh + 3 * vh * vi)
    window = 64  # 112 px windows = 8 x 8 patches
    full_layers = sum(1 for i in d["fullatt"] if i < v_layers)
    attn_window = 4.0 * vh * patches * window
    attn_full = 4.0 * vh * patches * (h * w)
    merged = patches // 4
    merger = 2.0 * merged * (4 * vh * 4 * vh + 4 * vh * d["hidden"])
    embed = 2.0 * patches * (3 * 2 * 14 * 14) * vh
    return (v_layers * per_layer_linear + (v_layers - full_layers) * attn_window + full_layers * attn_full
            + merger + embed)


def request_flops(prompt_len: int, cached: int, layers: int) -> float:
    q = prompt_len - cached
    return layers * (q * lm_layer_linear_flops_per_token() + lm_attention_flops(q, cached))


# --- environment -----------------------------------------------------------------------------------------
def environment() -> dict:
    return benchlib.env.environment(("mlx.core", "torch", "transformers", "mlx_vlm"))


# --- models ----------------------------------------------------------------------------------------------
def make_workload(clf, rng, clips: int, questions: int, frames: int, size, tag: str):
    from batchjob.engine import ClassifyRequest, Clip
    from batchjob.engine.preprocess import preprocess_video

    requests = []
    for c in range(clips):
        pixels = rng.integers(0, 256, (frames, *size, 3), dtype=np.uint8)
        metadata = {"fps": 30.0, "frames_indices": list(range(0, 15 * frames, 15)), "video_backend": "synthetic"}
        inputs = preprocess_video(pixels, metadata, clf.checkpoint.vision)
        clip = Clip(None, metadata, media_id=f"{tag}-clip{c}", inputs=inputs)
        for q in range(questions):
            options = tuple(f"option {k} for question {q}" for k in range(4))
            requests.append(ClassifyRequest(f"{tag}-{c}-{q}", clip, QUESTIONS[q % len(QUESTIONS)], options))
    return requests


def fresh(requests, tag):
    clips, out = {}, []
    for r in requests:
        clip = clips.setdefault(r.clip.media_id, dataclasses.replace(r.clip, media_id=f"{r.clip.media_id}-{tag}"))
        out.append(dataclasses.replace(r, clip=clip))
    return out


def timed(fn, repeats: int):
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return median(times), times


# --- attention-only cases --------------------------------------------------------------------------------
def attention_cases(dtype, kernel, repeats: int, small: bool = False, engine_attention=None) -> dict:
    """One layer's attention on three batches. Rows: `sdpa_per_sequence_ms` (the portable path as it was before
    grouping: one SDPA per sequence, 512-row chunks, K/V gathered from the cache), `paged_kernel_ms` (our CUDA
    kernel), `engine_attention_ms` (the function the engine chose at start, called as a layer calls it, new K/V
    included, its plan built inside every timed call as in a one-layer forward), `engine_attention_planned_ms`
    (the same with the plan already built, as in layers 2..N of a forward), `engine_attention_first_call_ms`
    (its very first call on these shapes: plan, compilation, cuDNN graph build), and `sdpa_padded_ms` (one SDPA
    over the batch padded to its longest query and context)."""
    import mlx.core as mx

    from batchjob.metal_backend import paged_attention
    from batchjob.metal_backend.probe import make_ragged_batch

    rng = np.random.default_rng(0)
    shape = dict(num_q_heads=28, num_kv_heads=4, head_dim=128, block_size=16, dtype=dtype, shuffle_blocks=False)
    cases = {"packed_prefill": ([2100] * 4, [0] * 4), "mixed_30000_5000_10": ([30000, 5000, 10], [0, 0, 0]),
             "follower": ([40] * 12, [2100] * 12)}
    if small:
        cases = {name: ([max(1, q // 100) for q in ql], [c // 100 for c in cl]) for name, (ql, cl) in cases.items()}
    out = {}
    for name, (q_lens, cached) in cases.items():
        b = make_ragged_batch(rng, q_lens, cached, **shape)
        scale = 128 ** -0.5
        flops = 28 * 128 * 4 * sum(q * c + q * (q + 1) / 2 for q, c in zip(q_lens, cached))

        def bench(fn):
            mx.eval(fn())
            ts = []
            for _ in range(repeats):
                t0 = time.perf_counter()
                mx.eval(fn())
                ts.append(time.perf_counter() - t0)
            return median(ts) * 1e3

        row = {"flops": flops}
        row["sdpa_per_sequence_ms"] = bench(lambda: paged_attention(b.q, b.k_cache, b.v_cache, b.meta, scale,
                                                                    group_rows=1))
        if kernel is not None:
            try:
                row["paged_kernel_ms"] = bench(lambda: kernel(b.q, b.k_cache, b.v_cache, b.meta, scale))
            except Exception as exc:
                row["paged_kernel_error"] = f"{type(exc).__name__}: {exc}"[:300]
        if engine_attention is not None:
            _, _, hkv, d = b.k_cache.shape  # the layer's new K/V, as the engine passes them: the rows just written
            new_kv = tuple(c.reshape(-1, hkv, d)[b.meta.slot_mapping] for c in (b.k_cache, b.v_cache))
            mx.eval(new_kv)

            def engine(replan: bool):
                if replan:
                    b.meta.plan_cache.clear()
                return engine_attention(b.q, b.k_cache, b.v_cache, b.meta, scale, new_kv=new_kv)

            try:
                b.meta.plan_cache.clear()
                t0 = time.perf_counter()
                mx.eval(engine(True))
                row["engine_attention_first_call_ms"] = (time.perf_counter() - t0) * 1e3
                row["engine_attention_ms"] = bench(lambda: engine(True))
                row["engine_attention_planned_ms"] = bench(lambda: engine(False))
                plan = [v for k, v in b.meta.plan_cache.items() if k[0] == "attention_plan" and len(k) == 4]
                if plan:
                    row["engine_attention_sdpa_calls"] = plan[0].num_calls
            except Exception as exc:
                row["engine_attention_error"] = f"{type(exc).__name__}: {exc}"[:300]
            del new_kv
        # Padded SDPA: every sequence padded to the longest query and context (what a padded batch pays).
        lq, lc = max(q_lens), max(q + c for q, c in zip(q_lens, cached))
        qp = mx.random.normal((len(q_lens), 28, lq, 128)).astype(dtype)
        kp = mx.random.normal((len(q_lens), 4, lc, 128)).astype(dtype)
        vp = mx.random.normal((len(q_lens), 4, lc, 128)).astype(dtype)
        try:
            row["sdpa_padded_ms"] = bench(lambda: mx.fast.scaled_dot_product_attention(qp, kp, vp, scale=scale,
                                                                                       mask="causal"))
        except Exception as exc:
            row["sdpa_padded_error"] = f"{type(exc).__name__}: {exc}"[:300]
        best = min(row[k] for k in ("sdpa_per_sequence_ms", "paged_kernel_ms", "engine_attention_ms") if k in row)
        row["best_paged_ms"] = best
        row["best_tflops"] = flops / best / 1e9
        out[name] = row
        del b, qp, kp, vp
        gc.collect()
    return out


# --- transformers baseline -------------------------------------------------------------------------------
def transformers_baseline(cfg_dir: Path, workload, token_ids, video_token_id, seq_requests: int, batch_size: int,
                          batches: int) -> dict:
    import torch
    from transformers import AutoConfig, AutoModelForImageTextToText

    torch.manual_seed(0)
    dev = "cuda" if torch.cuda.is_available() else "cpu"  # cpu only under --smoke
    config = AutoConfig.from_pretrained(cfg_dir)
    with torch.device(dev):
        model = AutoModelForImageTextToText.from_config(config, dtype=torch.bfloat16, attn_implementation="sdpa")
    model.eval()

    def sync():
        if dev == "cuda":
            torch.cuda.synchronize()

    def inputs_for(reqs):
        ids = [token_ids(r) for r in reqs]
        longest = max(len(i) for i in ids)
        pad = 0
        input_ids = torch.full((len(reqs), longest), pad, dtype=torch.long)
        mask = torch.zeros((len(reqs), longest), dtype=torch.long)
        for i, row in enumerate(ids):  # left padding: every prompt ends at the last column
            input_ids[i, longest - len(row):] = torch.tensor(row)
            mask[i, longest - len(row):] = 1
        pixels = torch.from_numpy(np.concatenate([r.clip.inputs.pixel_values for r in reqs]))
        grids = torch.tensor([list(r.clip.inputs.grid_thw) for r in reqs])
        spg = torch.tensor([r.clip.inputs.second_per_grid_t for r in reqs], dtype=torch.float32)
        return dict(input_ids=input_ids.to(dev), attention_mask=mask.to(dev),
                    pixel_values_videos=pixels.to(dev).to(torch.bfloat16), video_grid_thw=grids.to(dev),
                    second_per_grid_ts=spg.to(dev),
                    mm_token_type_ids=((input_ids == video_token_id).to(torch.int32) * 2).to(dev), logits_to_keep=1)

    @torch.inference_mode()
    def run(reqs):
        out = model(**inputs_for(reqs)).logits[:, -1].float()
        sync()
        return out

    result = {}
    run(workload[:1])
    t0 = time.perf_counter()
    for r in workload[:seq_requests]:
        run([r])
    result["sequential_s_per_request"] = (time.perf_counter() - t0) / seq_requests
    result["sequential_requests"] = seq_requests
    try:
        run(workload[:batch_size])
        times = []
        for b in range(batches):
            chunk = workload[b * batch_size:(b + 1) * batch_size]
            t0 = time.perf_counter()
            run(chunk)
            times.append(time.perf_counter() - t0)
        result["batched_s_per_request"] = median(times) / batch_size
        result["batch_size"] = batch_size
    except torch.OutOfMemoryError as exc:
        result["batched_error"] = f"out of memory at batch {batch_size}: {exc}"[:300]
    # Vision tower alone, one clip.
    visual = model.model.visual
    r = workload[0]
    px = torch.from_numpy(r.clip.inputs.pixel_values).to(dev).to(torch.bfloat16)
    grid = torch.tensor([list(r.clip.inputs.grid_thw)]).to(dev)
    with torch.inference_mode():
        visual(px, grid_thw=grid)
        sync()
        times = []
        for _ in range(5):
            t0 = time.perf_counter()
            visual(px, grid_thw=grid)
            sync()
            times.append(time.perf_counter() - t0)
    result["vision_ms_per_clip"] = median(times) * 1e3
    del model
    gc.collect()
    if dev == "cuda":
        torch.cuda.empty_cache()
    return result


# --- main ------------------------------------------------------------------------------------------------
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=28, help="text decoder layers (28 = full 7B depth)")
    parser.add_argument("--vision-layers", type=int, default=32, help="vision blocks (32 = full depth)")
    parser.add_argument("--clips", type=int, default=64)
    parser.add_argument("--questions", type=int, default=4)
    parser.add_argument("--frames", type=int, default=16)
    parser.add_argument("--size", type=int, nargs=2, default=(448, 448), metavar=("H", "W"))
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--max-num-batched-tokens", type=int, default=16384)
    parser.add_argument("--hf-sequential", type=int, default=12, help="requests timed one at a time in transformers")
    parser.add_argument("--hf-batch", type=int, default=8)
    parser.add_argument("--hf-batches", type=int, default=2)
    parser.add_argument("--skip-transformers", action="store_true")
    parser.add_argument("--out", default="benchmarks/results")
    parser.add_argument("--smoke", action="store_true", help="tiny dims on any device: checks the script runs")
    args = parser.parse_args()
    if args.smoke:
        DIMS.update(SMOKE)

    import mlx.core as mx

    from batchjob.engine import Classifier, EngineConfig
    from batchjob.engine.checkpoint import load_checkpoint
    from batchjob.synthetic.tiny_model import TinyModelSpec, write_tiny_checkpoint

    report: dict = {"environment": environment(), "args": vars(args)}
    env = report["environment"]
    print(f"# {env.get('gpu')} driver {env.get('driver')}, mlx {env['mlx']}, torch {env['torch']}", flush=True)
    ceiling_mlx = mlx_matmul_ceiling(512 if args.smoke else 8192)
    ceiling_torch = ceiling_mlx if args.smoke else torch_matmul_ceiling()
    report["matmul_ceiling_tflops"] = {"mlx": ceiling_mlx / 1e12, "torch": ceiling_torch / 1e12}
    print(f"bf16 matmul ceiling: MLX {ceiling_mlx / 1e12:.0f} TFLOP/s, torch {ceiling_torch / 1e12:.0f}", flush=True)

    tmp = Path(tempfile.mkdtemp())
    spec = TinyModelSpec(model_type="qwen2_5_vl", max_pixels=args.size[0] * args.size[1], min_pixels=28 * 28 * 4)
    tiny_dir = write_tiny_checkpoint(tmp / "tiny", spec)
    big_dir = tmp / "big"
    big_dir.mkdir()
    cfg = scaled_config(json.loads((tiny_dir / "config.json").read_text()), DIMS, args.layers, args.vision_layers)
    (big_dir / "config.json").write_text(json.dumps(cfg))
    for f in tiny_dir.iterdir():
        if f.name not in ("config.json", "model.safetensors"):
            (big_dir / f.name).write_bytes(f.read_bytes())

    t0 = time.perf_counter()
    model = build_random_model(big_dir, mx.bfloat16)   # bf16 weights (on a CPU too under --smoke)
    engine_config = EngineConfig(device="auto" if args.smoke else "gpu", max_model_len=8192,
                                 max_num_batched_tokens=args.max_num_batched_tokens, memory_budget_gb=60.0)
    tiny = load_checkpoint(tiny_dir, engine_config)
    from mlx.utils import tree_flatten

    ckpt = dataclasses.replace(tiny, model=model, hf_config=cfg, dtype=mx.bfloat16,
                               weights_bytes=sum(v.nbytes for _, v in tree_flatten(model.parameters())))
    ckpt.family.fix_model(model)   # what load_checkpoint does: window-index patch, fused vision MLPs
    mx.eval(model.parameters())
    clf = Classifier(ckpt, engine_config)
    encode_video = ckpt.family.encode_video   # Qwen2.5-VL's packed tower forward
    report["engine_runtime"] = clf.runtime.as_dict()
    print(f"model built in {time.perf_counter() - t0:.1f} s; engine {clf.runtime.as_dict()}", flush=True)

    rng = np.random.default_rng(0)
    workload = make_workload(clf, rng, args.clips, args.questions, args.frames, tuple(args.size), "w")
    distinct = make_workload(clf, rng, 8, 1, args.frames, tuple(args.size), "d")
    grid = workload[0].clip.inputs.grid_thw
    first = clf.classify(fresh(workload[:args.questions], "warm"))
    prompt_len = first[0].prompt_tokens
    follower_cached = [r.cached_tokens for r in first[1:]]
    report["workload"] = {"clips": args.clips, "questions": args.questions, "grid_thw": list(grid),
                          "video_tokens": int(np.prod(grid)) // 4, "prompt_tokens": prompt_len,
                          "follower_cached_tokens": follower_cached}
    print(f"prompt {prompt_len} tokens ({np.prod(grid) // 4} video), followers reuse {follower_cached}", flush=True)

    # Vision tower alone: ours (packed windows) vs mlx-vlm's forward (window patch applied, one SDPA per window).
    tower = model.vision_tower
    px = mx.array(workload[0].clip.inputs.pixel_values).astype(mx.bfloat16)

    def ours():
        mx.eval(encode_video(model, workload[0].clip.inputs.pixel_values, grid, mx.bfloat16))

    def theirs():
        mx.eval(tower(px, mx.array([list(grid)])))

    ours(), theirs()
    v_ours, _ = timed(ours, 5)
    v_theirs, _ = timed(theirs, 5)
    v_flops = vision_flops_per_clip(grid, args.vision_layers)
    report["vision"] = {"ms_per_clip": v_ours * 1e3, "mlx_vlm_ms_per_clip": v_theirs * 1e3,
                        "flops_per_clip": v_flops, "tflops": v_flops / v_ours / 1e12,
                        "ms_per_block": v_ours * 1e3 / args.vision_layers}
    save_partial(report, args)
    print(f"vision: {v_ours * 1e3:.1f} ms/clip ({v_flops / v_ours / 1e12:.0f} TFLOP/s); mlx-vlm forward "
          f"{v_theirs * 1e3:.1f} ms", flush=True)

    # LM prefill alone: vision features computed first and cached, then the engine's paged forward only.
    def lm_only(reqs, tag):
        reqs = fresh(reqs, tag)
        seen = set()
        for r in reqs:
            if r.clip.media_id not in seen:
                seen.add(r.clip.media_id)
                feats = encode_video(model, r.clip.inputs.pixel_values, r.clip.inputs.grid_thw, mx.bfloat16)
                mx.eval(feats)
                clf._features.put_clip(r.clip.media_id, feats)
        t0 = time.perf_counter()
        res = clf.classify(reqs)
        return time.perf_counter() - t0, res

    lm_only(distinct[:2], "lmwarm")
    lm_times = [lm_only(distinct, f"lm{i}")[0] for i in range(args.repeats)]
    lm_s = median(lm_times)
    lm_flops = sum(request_flops(prompt_len, 0, args.layers) for _ in distinct)
    # mlx-vlm's own contiguous forward on the same tokens (equal lengths: no padding), LM head at the last token.
    lm = model.language_model
    h = mx.random.normal((len(distinct), prompt_len, DIMS["hidden"])).astype(mx.bfloat16)
    pos = mx.broadcast_to(mx.arange(prompt_len)[None, None], (3, len(distinct), prompt_len))

    def contiguous():
        out = lm.model(None, inputs_embeds=h, position_ids=pos)
        mx.eval(lm.lm_head(out[:, -1]))

    contiguous()
    c_s, _ = timed(contiguous, args.repeats)
    report["lm_prefill"] = {"requests": len(distinct), "tokens": len(distinct) * prompt_len, "flops": lm_flops,
                            "engine_s": lm_s, "engine_tflops": lm_flops / lm_s / 1e12,
                            "mlx_vlm_contiguous_s": c_s, "mlx_vlm_contiguous_tflops": lm_flops / c_s / 1e12,
                            "engine_ms_per_layer": lm_s * 1e3 / args.layers}
    save_partial(report, args)
    print(f"LM prefill 8 x {prompt_len}: engine {lm_s:.3f} s ({lm_flops / lm_s / 1e12:.0f} TFLOP/s), mlx-vlm "
          f"contiguous {c_s:.3f} s ({lm_flops / c_s / 1e12:.0f})", flush=True)
    del h, pos

    # Ragged LM prefill: 8 distinct clips of different lengths. The engine computes their real tokens; mlx-vlm's
    # batched forward pads every request to the longest (right padding under its causal mask is exact).
    ragged = []
    for i in range(8):
        ragged += make_workload(clf, rng, 1, 1, max(2, args.frames - 2 * (i % 6)), tuple(args.size), f"rg{i}")
    lm_only(ragged[:2], "rgwarm")
    r_runs = [lm_only(ragged, f"rg{i}") for i in range(args.repeats)]
    r_s = median([t for t, _ in r_runs])
    r_lens = [r.prompt_tokens for r in r_runs[0][1]]
    r_flops = sum(request_flops(n, 0, args.layers) for n in r_lens)
    h = mx.random.normal((len(ragged), max(r_lens), DIMS["hidden"])).astype(mx.bfloat16)
    pos = mx.broadcast_to(mx.arange(max(r_lens))[None, None], (3, len(ragged), max(r_lens)))
    contiguous()
    p_s, _ = timed(contiguous, args.repeats)
    report["lm_prefill_ragged"] = {"requests": len(ragged), "prompt_tokens": r_lens, "flops": r_flops,
                                   "engine_s": r_s, "engine_tflops": r_flops / r_s / 1e12,
                                   "mlx_vlm_padded_s": p_s, "mlx_vlm_padded_tokens": len(ragged) * max(r_lens)}
    save_partial(report, args)
    print(f"LM prefill ragged {r_lens}: engine {r_s:.3f} s ({r_flops / r_s / 1e12:.0f} TFLOP/s), mlx-vlm padded "
          f"{p_s:.3f} s", flush=True)
    del h, pos

    # End to end: the whole workload, and 8 distinct clips.
    def whole(reqs, tag):
        res = clf.classify(fresh(reqs, tag))
        assert all(r.error is None for r in res), [r.error for r in res if r.error][:3]
        return res

    e2e = [0.0] * args.repeats
    for i in range(args.repeats):
        t0 = time.perf_counter()
        res = whole(workload, f"e2e{i}")
        e2e[i] = time.perf_counter() - t0
    e2e_s = median(e2e)
    d_times = []
    for i in range(args.repeats):
        t0 = time.perf_counter()
        whole(distinct, f"d{i}")
        d_times.append(time.perf_counter() - t0)
    d_s = median(d_times)
    n = len(workload)
    job_flops = 0.0
    for r in res:
        job_flops += request_flops(r.prompt_tokens, r.cached_tokens, args.layers)
    job_flops += args.clips * v_flops
    d_flops = lm_flops + len(distinct) * v_flops
    report["engine"] = {"requests": n, "wall_s": e2e_s, "requests_per_s": n / e2e_s,
                        "prefill_tokens_per_s": sum(r.prompt_tokens - r.cached_tokens for r in res) / e2e_s,
                        "job_flops": job_flops, "ideal_s": job_flops / ceiling_mlx,
                        "distinct8_wall_s": d_s, "distinct8_requests_per_s": len(distinct) / d_s,
                        "distinct8_ideal_s": d_flops / ceiling_mlx}
    save_partial(report, args)
    print(f"engine: {n} requests in {e2e_s:.2f} s ({n / e2e_s:.1f} req/s); ideal {job_flops / ceiling_mlx:.2f} s; "
          f"8 distinct clips {d_s:.2f} s", flush=True)

    # Attention alone.
    from batchjob.metal_backend.selection import PerCaseAttention

    kernel = clf._attention.fn.kernel if isinstance(getattr(clf._attention, "fn", None), PerCaseAttention) else None
    if kernel is None:
        try:
            from batchjob.metal_backend.kernels.cuda import cuda_paged_attention as kernel
        except Exception:
            kernel = None
    report["attention"] = attention_cases(mx.bfloat16, kernel, args.repeats, small=args.smoke,
                                          engine_attention=clf._attention)
    save_partial(report, args)
    for name, row in report["attention"].items():
        print(f"attention {name}: " + ", ".join(f"{k} {v:.2f}" for k, v in row.items()
                                                if isinstance(v, float) and k.endswith("_ms")), flush=True)

    del clf, model, tower, px, ckpt
    gc.collect()
    mx.clear_cache()

    if not args.skip_transformers:
        from batchjob.engine.prompt import PromptBuilder

        prompts = PromptBuilder(tiny.tokenizer, engine_config, tiny.video_token_id, str(tiny.path))

        def token_ids(r):
            return list(prompts.token_ids(r.question, r.options, r.clip.inputs.num_tokens))

        hf = transformers_baseline(big_dir, workload, token_ids, tiny.video_token_id, args.hf_sequential,
                                   args.hf_batch, args.hf_batches)
        report["transformers"] = hf
        print(f"transformers: {hf}", flush=True)

    summarize(report, args)


def save_partial(report: dict, args) -> None:
    """Write what is measured so far: a run stopped at its time limit still leaves its figures."""
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"partial-L{args.layers}-V{args.vision_layers}.json").write_text(json.dumps(report, indent=1, default=float))


def summarize(report: dict, args) -> None:
    ceil_m = report["matmul_ceiling_tflops"]["mlx"] * 1e12
    ceil_t = report["matmul_ceiling_tflops"]["torch"] * 1e12
    eng, lm, vis, att = report["engine"], report["lm_prefill"], report["vision"], report["attention"]
    fig = {
        "mfu_lm_prefill": lm["engine_tflops"] * 1e12 / ceil_m,
        "mfu_lm_prefill_vs_torch_ceiling": lm["engine_tflops"] * 1e12 / ceil_t,
        "mfu_lm_mlx_vlm_contiguous": lm["mlx_vlm_contiguous_tflops"] * 1e12 / ceil_m,
        "lm_paged_vs_mlx_vlm_contiguous": lm["mlx_vlm_contiguous_s"] / lm["engine_s"],
        "mfu_lm_prefill_ragged": report.get("lm_prefill_ragged", {}).get("engine_tflops", float("nan")) * 1e12 / ceil_m,
        "lm_paged_vs_mlx_vlm_padded_ragged": (report["lm_prefill_ragged"]["mlx_vlm_padded_s"]
                                              / report["lm_prefill_ragged"]["engine_s"]
                                              if "lm_prefill_ragged" in report else float("nan")),
        "mfu_vision": vis["tflops"] * 1e12 / ceil_m,
        "mfu_vision_vs_torch_ceiling": vis["tflops"] * 1e12 / ceil_t,
        "vision_vs_mlx_vlm": vis["mlx_vlm_ms_per_clip"] / vis["ms_per_clip"],
        "engine_requests_per_s": eng["requests_per_s"],
        "engine_prefill_tokens_per_s": eng["prefill_tokens_per_s"],
        "wall_vs_ideal": eng["wall_s"] / eng["ideal_s"],
        "wall_vs_ideal_torch_ceiling": eng["wall_s"] / (eng["job_flops"] / ceil_t),
        "distinct8_requests_per_s": eng["distinct8_requests_per_s"],
    }
    for case, row in att.items():
        if "paged_kernel_ms" in row:
            fig[f"paged_kernel_vs_sdpa_{case}"] = row["sdpa_per_sequence_ms"] / row["paged_kernel_ms"]
        if "sdpa_padded_ms" in row:
            fig[f"paged_vs_padded_sdpa_{case}"] = row["sdpa_padded_ms"] / row["best_paged_ms"]
        if "engine_attention_ms" in row:  # > 1: the engine's attention is faster than that baseline
            engine_ms = row["engine_attention_ms"]
            fig[f"engine_attention_vs_sdpa_per_sequence_{case}"] = row["sdpa_per_sequence_ms"] / engine_ms
            if "sdpa_padded_ms" in row:
                fig[f"engine_attention_vs_padded_{case}"] = row["sdpa_padded_ms"] / engine_ms
                fig[f"engine_attention_planned_vs_padded_{case}"] = (row["sdpa_padded_ms"]
                                                                     / row["engine_attention_planned_ms"])
    fig["paged_vs_sdpa"] = fig.get("paged_kernel_vs_sdpa_packed_prefill")
    hf = report.get("transformers")
    if hf:
        fig["transformers_sequential_requests_per_s"] = 1 / hf["sequential_s_per_request"]
        fig["vs_transformers_sequential"] = eng["requests_per_s"] * hf["sequential_s_per_request"]
        if "batched_s_per_request" in hf:
            fig["transformers_batched_requests_per_s"] = 1 / hf["batched_s_per_request"]
            fig["vs_transformers_batched"] = eng["requests_per_s"] * hf["batched_s_per_request"]
            fig["distinct8_vs_transformers_batched"] = eng["distinct8_requests_per_s"] * hf["batched_s_per_request"]
        fig["vision_vs_transformers"] = hf["vision_ms_per_clip"] / vis["ms_per_clip"]
    report["figures"] = fig
    env = report["environment"]
    date = datetime.date.today().isoformat()
    gpu = str(env.get("gpu", "gpu")).replace(" ", "-").replace("/", "-")
    path = Path(args.out) / f"{gpu}-{date}-L{args.layers}-V{args.vision_layers}.json"
    benchlib.env.save_json(report, path)
    print(f"\n{env.get('gpu')}, {date}, Qwen2.5-VL-7B shape, {args.layers}/28 text layers, {args.vision_layers}/32 "
          f"vision blocks, {eng['requests']} requests; ceilings MLX {ceil_m / 1e12:.0f} / torch {ceil_t / 1e12:.0f} "
          f"TFLOP/s")
    print("| figure | value |\n|---|---|")
    for k, v in fig.items():
        print(f"| {k} | {v:.3f} |" if isinstance(v, float) else f"| {k} | {v} |")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
