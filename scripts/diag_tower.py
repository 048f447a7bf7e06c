#!/usr/bin/env python
"""The vision towers with and without the towers' rotary kernel (engine/vision_rope.py), in alternating rounds
within one process: the kernel is kept only if the towers' time shows it, and runs on two machines differ by more
than the kernel's share.

Per model, bench_gpu's tower timing (a step's 8 clips of 16 frames at 448x448, each tower started while the next
graph is built) with the engine's kernels as selected at start, then with the towers' kernel taken out (the q/k
kernel kept), `--rounds` times; medians, their ratio, each variant's GPU clocks over its own rounds, the largest
difference between the two variants' features, and the block's rotary step alone with each.

    python3 scripts/diag_tower.py --model qwen2_5_vl qwen3_vl --rounds 5 --out $OUT
"""
from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchlib.ceilings import median, mlx_matmul_ceiling  # noqa: E402
from benchlib.flops import vision_flops_per_clip  # noqa: E402
from benchlib.gpu_monitor import GpuMonitor, monitored_report  # noqa: E402
from benchlib.profile_tower import towers_seconds  # noqa: E402
from benchlib.timing import ms_per_call  # noqa: E402
from benchlib.workload import diag_engine, make_workload  # noqa: E402

from batchjob.synthetic.random_engine import SHAPES  # noqa: E402


def variants(clf) -> dict:
    """name -> the fused kernels to activate: as selected at start, and the same without the towers' kernel."""
    built = clf.fused_kernels
    return {"kernel": built, "portable": dataclasses.replace(built, vision_rope=None)}


def rope_step_ms(ckpt, inputs, repeats: int) -> float:
    """A block's q/k rotary alone on the clip's token count, as the active kernels run it."""
    import mlx.core as mx

    from batchjob.engine.vision_attention import rope_tables, rotary_heads, rotated_qkv

    heads, d = rotary_heads(ckpt.model.vision_tower)
    tokens = int(np.prod(inputs.grid_thw))
    qkv = (mx.random.normal((tokens, 3 * heads * d)) * 2).astype(ckpt.dtype)
    tables = rope_tables(mx.random.uniform(0, 40, (tokens, d // 2)))
    mx.eval(qkv, tables.cos, tables.sin, *tables.halves)
    return ms_per_call(lambda: rotated_qkv(qkv, heads, d, tables)[:2], 10, repeats)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", nargs="+", default=["qwen2_5_vl", "qwen3_vl"], choices=sorted(SHAPES))
    parser.add_argument("--vision-layers", type=int, help="vision blocks (default: the model's)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=3, help="timed runs of the 8 clips per round")
    parser.add_argument("--smoke", action="store_true", help="tiny dims, fp32, on any device")
    parser.add_argument("--out", default=".")
    args = parser.parse_args()
    monitored_report("diag-tower", args, _run)
    return 0


def _run(args, report: dict, gpu: GpuMonitor) -> None:
    import mlx.core as mx

    from batchjob.engine import cuda_fused

    with gpu.section("ceiling"):
        report["matmul_ceiling_tflops"] = mlx_matmul_ceiling(512 if args.smoke else 8192) / 1e12
    for model_type in args.model:
        diag = diag_engine(model_type, smoke=args.smoke, layers=2 if args.smoke else 1, buckets=None, tag="tower",
                           vision_layers=args.vision_layers)   # few decoder layers: only the tower is timed
        bench, frames, size = diag.bench, diag.frames, diag.size
        clf, ckpt, dims, v_layers = bench.classifier, bench.checkpoint, bench.dims, bench.vision_layers
        print(f"[{model_type}] {v_layers} vision blocks; fused kernels: {clf.fused_kernels.summary()}", flush=True)
        clips = [r.clip.inputs for r in make_workload(bench, np.random.default_rng(0), 8, 1, frames, size, "t")]
        flops = vision_flops_per_clip(clips[0].grid_thw, v_layers, model_type, dims)
        chosen = variants(clf)
        seconds: dict = {name: [] for name in chosen}
        spans: dict = {name: [] for name in chosen}
        features, rope_ms = {}, {}
        for r in range(args.rounds):
            for name, kernels in (chosen.items() if r % 2 == 0 else reversed(chosen.items())):   # ABBA
                cuda_fused.activate(kernels)
                start = time.perf_counter()
                seconds[name].append(towers_seconds(ckpt, clips, args.repeats))
                spans[name].append((start, time.perf_counter()))
                if r == 0:
                    features[name] = np.array(ckpt.encode_clip(clips[0]).astype(mx.float32))
                    rope_ms[name] = rope_step_ms(ckpt, clips[0], args.repeats)
                print(f"[{model_type}] round {r} {name}: {seconds[name][-1] * 1e3:.2f} ms a clip", flush=True)
        cuda_fused.activate(clf.fused_kernels)
        row = {"vision_layers": v_layers, "fused_kernels": clf.fused_kernels.summary(),
               "grid_thw": list(clips[0].grid_thw), "flops_per_clip": flops, "variants": {}}
        for name in chosen:
            ms = median(seconds[name]) * 1e3
            row["variants"][name] = {"ms_per_clip": ms, "ms_per_clip_all": [s * 1e3 for s in seconds[name]],
                                     "mfu_vision": flops / (ms / 1e3) / (report["matmul_ceiling_tflops"] * 1e12),
                                     "rope_step_ms": rope_ms[name], "gpu": gpu.over(spans[name])}
        scale = float(np.abs(features["portable"]).max()) or 1.0
        row["features_max_abs_diff_rel"] = float(np.abs(features["kernel"] - features["portable"]).max()) / scale
        ms = {name: v["ms_per_clip"] for name, v in row["variants"].items()}
        row["kernel_vs_portable"] = ms["portable"] / ms["kernel"]
        report[model_type] = row
        print(f"\n[{model_type}] medians of {args.rounds} rounds (ceiling {report['matmul_ceiling_tflops']:.0f} "
              f"TFLOP/s; {row['fused_kernels']})\n| variant | ms a clip | MFU vision | rotary step ms | SM MHz "
              f"median |\n|---|---|---|---|---|")
        for name, v in row["variants"].items():
            print(f"| {name} | {v['ms_per_clip']:.2f} | {v['mfu_vision']:.3f} | {v['rope_step_ms']:.4f} | "
                  f"{v['gpu'].get('sm_mhz_median', 'n/a')} |")
        print(f"kernel vs portable: {row['kernel_vs_portable']:.3f}x; features differ by "
              f"{row['features_max_abs_diff_rel']:.2e} of their largest value", flush=True)
        del bench, clf, ckpt
        mx.clear_cache()


if __name__ == "__main__":
    sys.exit(main())
