#!/usr/bin/env python
"""The engine on one GPU at 7-8B scale: throughput, MFU against measured matmul ceilings, a profile that explains
each figure, attention paths, and Hugging Face transformers on torch as the baseline; one run, one table.

Models (`--model`, one row each): random bf16 weights in Qwen2.5-VL-7B's shape (text hidden 3584, 28 layers,
28 q / 4 kv heads; vision depth 32, hidden 1280) and in Qwen3-VL-8B's (text hidden 4096, 36 layers, 32 q / 8 kv
heads, head_dim 128; vision depth 27, hidden 1152, DeepStack at 8/16/24), cut to `--layers` / `--vision-layers`
(`--qwen3-layers` / `--qwen3-vision-layers`) so a run fits a time budget. The vocabulary is the synthetic
tokenizer's (~1k ids): the LM head runs only at each request's last position.

Workload per model: `--clips` clips x `--questions` questions, `--frames` frames at `--size` (Qwen2.5-VL: 2,048
video tokens per clip at 16 x 448x448; Qwen3-VL: 1,568 plus a timestamp per pair of frames), inputs prepared
up front as the decoders send them (patch bytes) and given to every path alike; the tower as the classifier runs a
step's clips and one clip alone; 8 distinct clips with one question each (the LM prefill, in one
forward under `max_num_batched_tokens: auto`, against mlx-vlm's contiguous forward on the same tokens; and the
same call with its prompts staged before it, as the job stages them);
8 clips of different lengths (ragged); the attention-only cases; the per-layer LM profile and the vision tower
profile (benchlib/profile_lm.py, profile_tower.py); one end-to-end pass step by step (benchlib/steps.py); MLX
and torch bf16 matmul ceilings in the same process.

    python scripts/bench_gpu.py --model qwen2_5_vl qwen3_vl --layers 28 --vision-layers 32 --out benchmarks/results
"""

from __future__ import annotations

import argparse
import datetime
import gc
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

import benchlib.env
from benchlib.attention_cases import attention_cases
from benchlib.ceilings import (median, mlx_copy_bandwidth, mlx_matmul_ceiling, mlx_matmul_ceiling_sustained,
                               mlx_matmul_ceiling_synced, torch_matmul_ceiling)
from benchlib.flops import request_flops, vision_flops_per_clip
from benchlib.gpu_monitor import GpuMonitor, section_table
from benchlib.gpu_targets import wall_gap
from benchlib.hf_baseline import transformers_baseline
from benchlib.profile_lm import profile_lm
from benchlib.profile_tower import profile_tower, towers_seconds
from benchlib.steps import step_timeline, summarize_steps
from benchlib.timing import ms_per_call, timed
from benchlib.workload import (build_model, cache_features, drop_features, fresh, make_workload, prompt_ids,
                               vary_questions)
from batchjob.engine.patchify import device_pixels
from batchjob.synthetic.random_engine import SHAPES


def run_model(model_type: str, args, ceiling: float, tmp: Path, save, gpu: GpuMonitor) -> tuple[dict, dict]:
    """One model's engine row (build, vision, LM prefill equal and ragged, profiles, end to end, attention) and
    the arguments of its transformers baseline, run once this function's MLX model is gone; `gpu` keeps what the
    GPU did in each of its sections."""
    import mlx.core as mx

    dims = dict(SHAPES[model_type][1 if args.smoke else 0])
    qwen3 = model_type == "qwen3_vl"
    layers = (args.qwen3_layers if qwen3 else args.layers) or dims["layers"]
    v_layers = (args.qwen3_vision_layers if qwen3 else args.vision_layers) or dims["v_depth"]
    row: dict = {"model_type": model_type, "dims": dims, "layers": layers, "vision_layers": v_layers, "timings_s": {}}
    clock = [time.perf_counter()]

    def lap(name):
        now = time.perf_counter()
        row["timings_s"][name] = round(now - clock[0], 2)
        gpu.record(f"{model_type} {name}", clock[0], now)
        clock[0] = now
        save(model_type, row)

    engine = dict(device="auto" if args.smoke else "gpu", max_model_len=8192, memory_budget_gb=args.memory_budget_gb,
                  max_num_batched_tokens=args.max_num_batched_tokens)
    bench = build_model(model_type, dims, layers, v_layers, args.frames, tuple(args.size), tmp,
                        "float32" if args.smoke else "bfloat16", engine)
    clf, ckpt = bench.classifier, bench.checkpoint
    row["engine_runtime"] = clf.runtime.as_dict()
    row["max_num_batched_tokens"] = clf.max_num_batched_tokens
    print(f"[{model_type}] {layers} layers, {v_layers} vision blocks; engine {clf.runtime.as_dict()}; "
          f"{clf.max_num_batched_tokens} tokens per forward", flush=True)
    lap("build")

    rng = np.random.default_rng(0)
    size = tuple(args.size)
    workload = make_workload(bench, rng, args.clips, args.questions, args.frames, size, "w")
    distinct = make_workload(bench, rng, args.distinct, 1, args.frames, size, "d")
    ragged = []
    for i in range(args.distinct):
        ragged += make_workload(bench, rng, 1, 1, max(2, args.frames - 2 * (i % 6)), size, f"rg{i}")
    first = clf.classify(fresh(workload[:args.questions], "warm"))
    grid = workload[0].clip.inputs.grid_thw
    row["workload"] = {"clips": args.clips, "questions": args.questions, "grid_thw": list(grid),
                       "video_tokens": int(np.prod(grid)) // 4, "prompt_tokens": first[0].prompt_tokens,
                       "follower_cached_tokens": [r.cached_tokens for r in first[1:]]}
    lap("workload")

    # Vision tower: as the engine runs a step's clips (patch bytes in, plan cached, each tower started as soon as
    # its graph is built, one sync), one clip alone (built, run, synced) against mlx-vlm's forward and
    # transformers' (like for like); then the profile.
    inputs = workload[0].clip.inputs
    v_ours = towers_seconds(ckpt, [r.clip.inputs for r in workload[::args.questions][:8]], args.repeats)
    v_alone = ms_per_call(lambda: ckpt.encode_clip(inputs), 1, 5) / 1e3
    v_theirs = _mlx_vlm_tower_seconds(ckpt, inputs)
    v_flops = vision_flops_per_clip(grid, v_layers, model_type, dims)
    row["vision"] = {"ms_per_clip": v_ours * 1e3, "ms_per_clip_alone": v_alone * 1e3,
                     "mlx_vlm_ms_per_clip": v_theirs * 1e3, "flops_per_clip": v_flops,
                     "tflops": v_flops / v_ours / 1e12, "ms_per_block": v_ours * 1e3 / v_layers}
    row["vision_profile"] = profile_tower(bench, inputs, ceiling, inner=args.inner, repeats=args.repeats)
    print(f"[{model_type}] vision {v_ours * 1e3:.1f} ms/clip ({v_flops / v_ours / 1e12:.0f} TFLOP/s), mlx-vlm "
          f"{v_theirs * 1e3:.1f} ms", flush=True)
    lap("vision")

    def lm_only(reqs, tag, staged: bool):
        """The engine's LM path alone: vision features computed first and cached; (seconds, results, forwards).
        Unstaged, the call renders and tokenizes its prompts first (the figures' definition since the issue was
        filed); `staged`: the prompts made before the clock starts (`Classifier.stage`, which the job's staging
        thread runs while the batch before is on the device), the prefill as the job runs it, like mlx-vlm's
        forward over given tokens."""
        reqs = fresh(reqs, tag)
        cache_features(bench, reqs)
        if staged:
            clf.stage(reqs)
            mx.synchronize()   # the staged patch bytes' upload (unused here: the features are cached) done first
        collections = gc.get_stats()
        with step_timeline(clf) as log:
            t0 = time.perf_counter()
            res = clf.classify(reqs)
            seconds = time.perf_counter() - t0
        row.setdefault("lm_calls", []).append({   # every timed call, for the spread and Python's collections
            "tag": tag, "staged": staged, "s": round(seconds, 4), "forward_s": [round(x, 4) for x in log["forward_s"]],
            "gc_collections": sum(a["collections"] - b["collections"] for a, b in zip(gc.get_stats(), collections))})
        return seconds, res, len(log["forward_s"])

    def lm_calls(reqs, tag):
        """Unstaged and staged calls in turn, after one of each to build the batch's shapes (compilation, cuDNN
        graphs); the staged calls' median and whether both kinds gave the same answers."""
        lm_only(reqs, f"{tag}warm", False)
        lm_only(reqs, f"{tag}warms", True)
        unstaged, staged = [], []
        for i in range(max(5, args.repeats)):
            unstaged.append(lm_only(reqs, f"{tag}{i}", False))
            staged.append(lm_only(reqs, f"{tag}s{i}", True))
        same = all(a.probs == b.probs and a.choice == b.choice for a, b in zip(staged[0][1], unstaged[0][1]))
        return unstaged, median([t for t, _, _ in staged]), same

    runs, lm_s_staged, lm_same = lm_calls(distinct, "lm")
    lm_forwards = runs[-1][2]
    r_runs, r_s_staged, r_same = lm_calls(ragged, "rg")
    # The engine computes each prompt but its cached text prefix (the system prompt's full blocks, the same for
    # every clip); mlx-vlm's contiguous forward runs over the same number of new tokens per request.
    lm_s, done = median([t for t, _, _ in runs]), runs[0][1]
    lm_flops = sum(request_flops(r.prompt_tokens, r.cached_tokens, layers, dims) for r in done)
    new_len = done[0].prompt_tokens - done[0].cached_tokens
    c_s = _contiguous_seconds(ckpt, len(distinct), new_len, dims, args.repeats)
    c_flops = len(distinct) * request_flops(new_len, 0, layers, dims)
    row["lm_prefill"] = {"requests": len(distinct), "prompt_tokens": done[0].prompt_tokens,
                         "tokens": sum(r.prompt_tokens - r.cached_tokens for r in done), "flops": lm_flops,
                         "engine_s": lm_s, "engine_tflops": lm_flops / lm_s / 1e12, "engine_forwards": lm_forwards,
                         "mlx_vlm_contiguous_s": c_s, "mlx_vlm_contiguous_tokens": len(distinct) * new_len,
                         "mlx_vlm_contiguous_tflops": c_flops / c_s / 1e12, "engine_ms_per_layer": lm_s * 1e3 / layers,
                         "engine_s_staged": lm_s_staged, "engine_tflops_staged": lm_flops / lm_s_staged / 1e12,
                         "staged_answers_equal_unstaged": lm_same}
    r_s = median([t for t, _, _ in r_runs])
    r_lens = [r.prompt_tokens - r.cached_tokens for r in r_runs[0][1]]
    r_flops = sum(request_flops(r.prompt_tokens, r.cached_tokens, layers, dims) for r in r_runs[0][1])
    p_s = _contiguous_seconds(ckpt, len(ragged), max(r_lens), dims, args.repeats)
    row["lm_prefill_ragged"] = {"requests": len(ragged), "prompt_tokens": r_lens, "flops": r_flops, "engine_s": r_s,
                                "engine_tflops": r_flops / r_s / 1e12, "mlx_vlm_padded_s": p_s,
                                "mlx_vlm_padded_tokens": len(ragged) * max(r_lens), "engine_s_staged": r_s_staged,
                                "engine_tflops_staged": r_flops / r_s_staged / 1e12,
                                "staged_answers_equal_unstaged": r_same}
    print(f"[{model_type}] LM prefill {len(distinct)} x {new_len} new tokens in {lm_forwards} forward(s): "
          f"{lm_s:.3f} s ({lm_flops / lm_s / 1e12:.0f} TFLOP/s), mlx-vlm contiguous {c_s:.3f} s", flush=True)
    lap("lm_prefill")
    for key, reqs in (("lm_profile", distinct), ("lm_profile_ragged", ragged)):   # equal and ragged prompts
        profiled = fresh(reqs, "prof")
        cache_features(bench, profiled)
        row[key] = profile_lm(clf, profiled, dims, ceiling, inner=args.inner, repeats=args.repeats)
        drop_features(bench, profiled)
    lap("lm_profile")

    def whole(reqs, tag):
        res = clf.classify(fresh(reqs, tag))
        assert all(r.error is None for r in res), [r.error for r in res if r.error][:3]
        return res

    results = []
    e2e_s, _ = timed(lambda: results.append(whole(workload, f"e2e{len(results)}")), args.repeats)
    res = results[0]
    with step_timeline(clf) as log:   # one more run, step by step: where the wall time beyond the ideal goes
        t0 = time.perf_counter()
        whole(workload, "e2e-steps")
        steps = summarize_steps(log, time.perf_counter() - t0)
    gpu_idle = None
    if args.cupti:   # one more run under CUPTI: the GPU's idle time within it, charged to the host's phase then
        from benchlib.cupti import engine_phases, traced_idle
        (gpu_idle,) = traced_idle(lambda: whole(workload, "e2e-cupti"), engine_phases(clf, (clf, "classify")))
        print(f"[{model_type}] under CUPTI: wall {gpu_idle['wall_ms']:.0f} ms, GPU busy "
              f"{gpu_idle['gpu_busy_ms']:.0f}, idle by phase {gpu_idle['idle_ms']}", flush=True)
    d_s, _ = timed(lambda: whole(distinct, f"d{time.perf_counter()}"), args.repeats)
    rng_vary, varied = np.random.default_rng(1), []   # the same job with questions a few words longer, drawn anew
    v_s, _ = timed(lambda: varied.append(whole(vary_questions(workload, rng_vary), f"v{len(varied)}")), args.repeats)

    def job_flops_of(results):   # the prompts as the engine ran them (cached prefixes not counted), and the towers
        lm = sum(request_flops(r.prompt_tokens, r.cached_tokens, layers, dims) for r in results)
        return lm + args.clips * v_flops

    job_flops, varied_flops = job_flops_of(res), job_flops_of(varied[0])
    d_flops = lm_flops + len(distinct) * v_flops   # the distinct clips' prompts as the LM prefill ran them
    n = len(workload)
    row["engine"] = {"requests": n, "wall_s": e2e_s, "requests_per_s": n / e2e_s,
                     "prefill_tokens_per_s": sum(r.prompt_tokens - r.cached_tokens for r in res) / e2e_s,
                     "job_flops": job_flops, "ideal_s": job_flops / ceiling, "distinct8_wall_s": d_s,
                     "distinct8_requests_per_s": len(distinct) / d_s, "distinct8_ideal_s": d_flops / ceiling,
                     "varied_wall_s": v_s, "varied_requests_per_s": n / v_s, "varied_ideal_s": varied_flops / ceiling,
                     "timeline": steps, "gpu_idle": gpu_idle}
    print(f"[{model_type}] engine: {n} requests in {e2e_s:.2f} s ({n / e2e_s:.1f} req/s); ideal "
          f"{job_flops / ceiling:.2f} s; {len(distinct)} distinct clips {d_s:.2f} s", flush=True)
    lap("end_to_end")

    lm = ckpt.model.language_model
    kv_heads, head_dim = ckpt.family.kv_shape(lm)
    shape = dict(num_q_heads=lm.args.num_attention_heads, num_kv_heads=kv_heads, head_dim=head_dim)
    row["attention"] = attention_cases(ckpt.dtype, clf._attention, args.repeats, shape, small=args.smoke)
    lap("attention")
    needed = workload[:max(args.hf_sequential, args.hf_batch * args.hf_batches)]
    ids = {r.request_id: prompt_ids(bench, r) for r in needed}
    hf_job = dict(cfg_dir=bench.config_dir, workload=needed, token_ids=lambda r: ids[r.request_id],
                  video_token_id=ckpt.video_token_id, seq_requests=args.hf_sequential, batch_size=args.hf_batch,
                  batches=args.hf_batches, model_type=model_type)
    return row, hf_job


def _mlx_vlm_tower_seconds(ckpt, inputs) -> float:
    """mlx-vlm's own tower forward on the same clip (device pixels; its window fix and the load-time swaps in)."""
    import mlx.core as mx

    px = mx.array(device_pixels(inputs)).astype(ckpt.dtype)
    return ms_per_call(lambda: ckpt.model.vision_tower(px, mx.array([list(inputs.grid_thw)])), 1, 3) / 1e3


def _contiguous_seconds(ckpt, batch: int, length: int, dims: dict, repeats: int) -> float:
    """mlx-vlm's own decoder forward over `batch` x `length` tokens in one call (no padding when lengths are
    equal; right padding under its causal mask is exact otherwise), the LM head at the last token."""
    import mlx.core as mx

    lm = ckpt.model.language_model
    h = mx.random.normal((batch, length, dims["hidden"])).astype(ckpt.dtype)
    pos = mx.broadcast_to(mx.arange(length)[None, None], (3, batch, length))

    def contiguous():
        out = lm.model(None, inputs_embeds=h, position_ids=pos)
        head = lm.model.embed_tokens.as_linear if lm.args.tie_word_embeddings else lm.lm_head
        mx.eval(head(out[:, -1]))

    contiguous()
    return timed(contiguous, repeats)[0]


def figures(row: dict, ceil_m: float, ceil_t: float, ceil_s: float) -> dict:
    """ceil_m divides the issue's figures; ceil_t (torch) and ceil_s (MLX held for seconds, power-capped) the
    companions that say how much of a miss is the denominator."""
    eng, lm, vis, att = row["engine"], row["lm_prefill"], row["vision"], row["attention"]
    rag, lp, vp = row["lm_prefill_ragged"], row["lm_profile"], row["vision_profile"]
    rp = row["lm_profile_ragged"]
    fig = {
        "mfu_lm_prefill": lm["engine_tflops"] * 1e12 / ceil_m,
        "mfu_lm_prefill_vs_torch_ceiling": lm["engine_tflops"] * 1e12 / ceil_t,
        "mfu_lm_mlx_vlm_contiguous": lm["mlx_vlm_contiguous_tflops"] * 1e12 / ceil_m,
        "lm_paged_vs_mlx_vlm_contiguous": lm["mlx_vlm_contiguous_s"] / lm["engine_s"],
        "mfu_lm_prefill_ragged": rag["engine_tflops"] * 1e12 / ceil_m,
        # the same calls with their prompts staged before them, as the job's staging thread makes them
        "mfu_lm_prefill_staged": lm["engine_tflops_staged"] * 1e12 / ceil_m,
        "mfu_lm_prefill_ragged_staged": rag["engine_tflops_staged"] * 1e12 / ceil_m,
        "lm_paged_vs_mlx_vlm_padded_ragged": rag["mlx_vlm_padded_s"] / rag["engine_s"],
        "mfu_vision": vis["tflops"] * 1e12 / ceil_m,
        "mfu_vision_vs_torch_ceiling": vis["tflops"] * 1e12 / ceil_t,
        "mfu_vision_one_clip_synced": vis["flops_per_clip"] / (vis["ms_per_clip_alone"] / 1e3) / ceil_m,
        "vision_vs_mlx_vlm": vis["mlx_vlm_ms_per_clip"] / vis["ms_per_clip_alone"],   # one clip each, synced
        "engine_requests_per_s": eng["requests_per_s"],
        "engine_prefill_tokens_per_s": eng["prefill_tokens_per_s"],
        "wall_vs_ideal": eng["wall_s"] / eng["ideal_s"],
        "wall_vs_ideal_torch_ceiling": eng["wall_s"] / (eng["job_flops"] / ceil_t),
        "wall_vs_ideal_sustained_ceiling": eng["wall_s"] / (eng["job_flops"] / ceil_s),
        **wall_gap(row, ceil_m),   # wall_vs_ideal - 1 split: the towers, the LM's forwards, the rest
        "distinct8_requests_per_s": eng["distinct8_requests_per_s"],
        "distinct8_wall_vs_ideal": eng["distinct8_wall_s"] / eng["distinct8_ideal_s"],
        # the same job with every run's questions 0-7 words longer (as a job's differ): new shapes in every run
        "engine_varied_requests_per_s": eng["varied_requests_per_s"],
        "wall_vs_ideal_varied": eng["varied_wall_s"] / eng["varied_ideal_s"],
        # the end-to-end run step by step (benchlib/steps.py): device work vs host time between it
        "engine_steps": eng["timeline"]["steps"],
        "engine_forward_share": eng["timeline"]["forward_s"] / eng["timeline"]["wall_s"],
        "engine_vision_graph_host_s": eng["timeline"]["vision_graph_host_s"],
        "engine_other_host_s": eng["timeline"]["other_host_s"],
        "engine_between_steps_host_s": eng["timeline"]["between_steps_host_s"],
        # the profile: what a layer / the tower spends where (shares of the measured whole)
        "lm_forwards_per_prefill": lm["engine_forwards"],
        "lm_layer_ms": lp["layer_ms"],
        "lm_layer_matmuls_share": lp["categories_ms"]["matmuls"] / lp["layer_ms"],
        "lm_layer_attention_share": lp["categories_ms"]["attention"] / lp["layer_ms"],
        "lm_layer_other_share": lp["other_ms"] / lp["layer_ms"],
        "lm_matmul_mfu": (lp["matmul_tflops"] or 0.0) * 1e12 / ceil_m,
        "lm_outside_layers_share": lp["outside_layers_ms"] / lp["forward_ms"],
        "lm_host_build_share": lp["host_build_ms"] / lp["forward_ms"],
        "lm_host_syncs_in_layers": lp["host_syncs_in_layers"],
        # the same profile over the ragged batch (8 prompts of different lengths): what its lower MFU is made of
        "lm_ragged_mfu_forward": rp["mfu_forward"],
        "lm_ragged_layer_ms": rp["layer_ms"],
        "lm_ragged_matmul_mfu": (rp["matmul_tflops"] or 0.0) * 1e12 / ceil_m,
        "lm_ragged_layer_attention_share": rp["categories_ms"]["attention"] / rp["layer_ms"],
        "lm_ragged_layer_other_share": rp["other_ms"] / rp["layer_ms"],
        "lm_ragged_sdpa_calls_per_layer": rp["sdpa_calls_per_layer"],
        "vision_blocks_share": vp["blocks_ms"] / vp["engine_tower_ms"],
        "vision_outside_blocks_share": vp["outside_blocks_ms"] / vp["engine_tower_ms"],
        "vision_other_share": vp["other_ms"] / vp["engine_tower_ms"],
        "vision_blocks_mfu": vp["mfu_blocks"],
        "vision_host_syncs": vp["engine_host_syncs"],
        "mlx_vlm_vision_host_syncs": vp["mlx_vlm_host_syncs"],
    }
    for case, r in att.items():
        if "engine_attention_ms" in r:  # > 1: the engine's attention is faster than that baseline
            fig[f"engine_attention_vs_sdpa_per_sequence_{case}"] = r["sdpa_per_sequence_ms"] / r["engine_attention_ms"]
            if "sdpa_padded_ms" in r:
                fig[f"engine_attention_vs_padded_{case}"] = r["sdpa_padded_ms"] / r["engine_attention_ms"]
                fig[f"engine_attention_planned_vs_padded_{case}"] = (r["sdpa_padded_ms"]
                                                                     / r["engine_attention_planned_ms"])
    if eng.get("gpu_idle"):   # --cupti: the share of the run's wall time the GPU had nothing to do
        fig["engine_gpu_idle_share"] = sum(eng["gpu_idle"]["idle_ms"].values()) / eng["gpu_idle"]["wall_ms"]
    hf = row.get("transformers")
    if hf:
        fig["transformers_sequential_requests_per_s"] = 1 / hf["sequential_s_per_request"]
        fig["vs_transformers_sequential"] = eng["requests_per_s"] * hf["sequential_s_per_request"]
        if "batched_s_per_request" in hf:
            fig["transformers_batched_requests_per_s"] = 1 / hf["batched_s_per_request"]
            fig["vs_transformers_batched"] = eng["requests_per_s"] * hf["batched_s_per_request"]
            fig["distinct8_vs_transformers_batched"] = eng["distinct8_requests_per_s"] * hf["batched_s_per_request"]
            # the most that figure could be: the distinct clips' requests in their ideal time (wall_vs_ideal 1.0)
            fig["distinct8_ideal_vs_transformers_batched"] = (fig["distinct8_vs_transformers_batched"]
                                                              * fig["distinct8_wall_vs_ideal"])
        fig["vision_vs_transformers"] = hf["vision_ms_per_clip"] / vis["ms_per_clip_alone"]
    return fig


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", nargs="+", default=["qwen2_5_vl"], choices=sorted(SHAPES))
    parser.add_argument("--layers", type=int, help="Qwen2.5-VL text layers (default: all 28)")
    parser.add_argument("--vision-layers", type=int, help="Qwen2.5-VL vision blocks (default: all 32)")
    parser.add_argument("--qwen3-layers", type=int, help="Qwen3-VL text layers (default: all 36)")
    parser.add_argument("--qwen3-vision-layers", type=int, help="Qwen3-VL vision blocks (default: all 27)")
    parser.add_argument("--clips", type=int, default=64)
    parser.add_argument("--questions", type=int, default=4)
    parser.add_argument("--distinct", type=int, default=8, help="distinct clips (one question) and ragged clips")
    parser.add_argument("--frames", type=int, default=16)
    parser.add_argument("--size", type=int, nargs=2, default=(448, 448), metavar=("H", "W"))
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--inner", type=int, default=5, help="calls queued per sync in the profiles")
    parser.add_argument("--max-num-batched-tokens", default="auto", type=lambda v: v if v == "auto" else int(v))
    parser.add_argument("--memory-budget-gb", type=float, default=None, help="default: the engine sizes it from the device")
    parser.add_argument("--hf-sequential", type=int, default=12, help="requests timed one at a time in transformers")
    parser.add_argument("--hf-batch", type=int, default=8)
    parser.add_argument("--hf-batches", type=int, default=2)
    parser.add_argument("--skip-transformers", action="store_true")
    parser.add_argument("--cupti", action="store_true", help="one more run of the 64 x 4 job under torch.profiler: "
                        "the GPU's idle time in it by host phase (engine.gpu_idle)")
    parser.add_argument("--out", default="benchmarks/results")
    parser.add_argument("--smoke", action="store_true", help="tiny dims, fp32, on any device: checks the script runs")
    args = parser.parse_args()

    report: dict = {"environment": benchlib.env.environment(("mlx.core", "torch", "transformers", "mlx_vlm")),
                    "args": vars(args)}
    env = report["environment"]
    print(f"# {env.get('gpu')} driver {env.get('driver')}, mlx {env['mlx']}, torch {env['torch']}", flush=True)
    gpu = GpuMonitor().start()
    try:
        _run(args, report, gpu)
    finally:
        gpu.stop()


def _run(args, report: dict, gpu: GpuMonitor) -> None:
    env = report["environment"]
    with gpu.section("ceilings"):
        ceiling_mlx = mlx_matmul_ceiling(512 if args.smoke else 8192)
        ceiling_torch = ceiling_mlx if args.smoke else torch_matmul_ceiling()
        report["matmul_ceiling_tflops"] = {"mlx": ceiling_mlx / 1e12, "torch": ceiling_torch / 1e12,
                                           "mlx_synced": mlx_matmul_ceiling_synced(512 if args.smoke else 8192) / 1e12}
        report["memory_bandwidth_gbps"] = {"mlx_copy": mlx_copy_bandwidth(2**24 if args.smoke else 2**30) / 1e9}
    with gpu.section("sustained ceiling"):   # its own section: the clocks it ran at are the point of it
        ceiling_sustained = mlx_matmul_ceiling_sustained(*((512, 0.2) if args.smoke else (8192, 10.0)))
        report["matmul_ceiling_tflops"]["mlx_sustained"] = ceiling_sustained / 1e12
    import mlx.core as mx
    print(f"bf16 matmul ceiling: MLX {ceiling_mlx / 1e12:.0f} TFLOP/s, torch {ceiling_torch / 1e12:.0f}", flush=True)
    out = Path(args.out)
    stem = "L{}-V{}".format(args.layers or "all", args.vision_layers or "all")

    def save(model_type, row):   # a run stopped at its limit still leaves what it measured
        (report if model_type == "qwen2_5_vl" else report.setdefault(model_type, {})).update(row)
        report["gpu_monitor"] = gpu.as_dict()
        benchlib.env.save_json(report, out / f"partial-{stem}.json")

    tmp = Path(tempfile.mkdtemp())
    report["figures"] = {}
    for model_type in args.model:
        row, hf_job = run_model(model_type, args, ceiling_mlx, tmp, save, gpu)
        gc.collect()   # transformers gets the GPU to itself: the MLX model, its KV cache and buffer cache go first
        mx.clear_cache()
        if not args.skip_transformers:
            t0 = time.perf_counter()
            row["transformers"] = transformers_baseline(**hf_job)
            row["timings_s"]["transformers"] = round(time.perf_counter() - t0, 2)
            gpu.record(f"{model_type} transformers", t0)
            print(f"[{model_type}] transformers: {row['transformers']}", flush=True)
        save(model_type, row)
        prefix = "" if model_type == "qwen2_5_vl" else f"{model_type}."
        report["figures"].update({prefix + k: v for k, v in
                                  figures(row, ceiling_mlx, ceiling_torch, ceiling_sustained).items()})
    # The ceiling read again at the end, for the record only (the figures keep the start's): every MFU and
    # wall-vs-ideal figure divides by it, and readings differ between machines and, less, within one.
    with gpu.section("ceiling at the end"):
        ceiling_end = mlx_matmul_ceiling(512 if args.smoke else 8192)
    report["matmul_ceiling_tflops"]["mlx_at_end"] = ceiling_end / 1e12
    report["gpu_monitor"] = gpu.as_dict()
    gpu_name = str(env.get("gpu", "gpu")).replace(" ", "-").replace("/", "-")
    path = out / f"{gpu_name}-{datetime.date.today().isoformat()}-{'-'.join(args.model)}-{stem}.json"
    benchlib.env.save_json(report, path)
    print(f"\n{env.get('gpu')}, {datetime.date.today()}, models {', '.join(args.model)}; ceilings MLX "
          f"{ceiling_mlx / 1e12:.0f} (read again at the end: {ceiling_end / 1e12:.0f}; held for seconds: "
          f"{ceiling_sustained / 1e12:.0f}) / torch "
          f"{ceiling_torch / 1e12:.0f} TFLOP/s\n| figure | value |\n|---|---|")
    for k, v in report["figures"].items():
        print(f"| {k} | {v:.3f} |" if isinstance(v, float) else f"| {k} | {v} |")
    print(f"\nmemory bandwidth (MLX x + 1): {report['memory_bandwidth_gbps']['mlx_copy']:.0f} GB/s; the GPU by section "
          f"({gpu.problem or 'nvidia-smi every %d ms' % gpu.interval_ms}):\n{section_table(gpu.sections)}")
    print(f"wrote {path}")


if __name__ == "__main__":
    sys.exit(main())
