#!/usr/bin/env python
"""The LM prefill forward and its decoder layer under variants of the layer's non-GEMM work, compared in
alternating rounds within one process (single runs of one variant moved by more than the differences sought).

Variants: the residual adds as passes of their own or in the GEMMs' epilogues (`fused_ops.RESIDUAL_IN_GEMM`),
and for Qwen3-VL the q/k norm + rotary kernel as built now, the portable form, or the kernel of another commit
(`--qk-kernel-from FILE`, a `cuda_fused.py` from `git show REV:batchjob/engine/cuda_fused.py`). Each variant's
forward and layer come from `benchlib.profile_lm` on bench_gpu's batches (8 distinct clips of 16 frames at
448x448, equal prompts, then 8 ragged prompts), medians over the rounds.

    python scripts/diag_lm_layer.py --model qwen2_5_vl qwen3_vl --rounds 3 --out /tmp/out
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchlib.ceilings import median, mlx_matmul_ceiling  # noqa: E402
from benchlib.gpu_monitor import GpuMonitor, monitored_report  # noqa: E402
from benchlib.profile_lm import profile_lm  # noqa: E402
from benchlib.workload import build_model, cache_features, drop_features, fresh, make_workload  # noqa: E402

from batchjob.synthetic.random_engine import SHAPES  # noqa: E402


def _kernels_from(path: str, heads):
    """`select_fused_kernels` of a `cuda_fused.py` file given by path (imported as a sibling module)."""
    spec = importlib.util.spec_from_file_location("batchjob.engine._cuda_fused_other", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    import mlx.core as mx
    return module.select_fused_kernels("cuda", mx.bfloat16, qk_heads=heads)


def variants(clf, args) -> dict:
    """name -> (fused kernels to activate, residual in GEMM)."""
    from batchjob.engine import cuda_fused
    from batchjob.engine.attention import qk_norm_heads

    heads = qk_norm_heads(clf.checkpoint.model.language_model)
    built = clf.fused_kernels
    out = {"adds": (built, False), "in_gemm": (built, True)}
    if heads is not None:   # Qwen3: the q/k kernel's variants, residual as now
        out["portable_qk"] = (cuda_fused.FusedKernels(reason="portable"), True)
        if args.qk_kernel_from:
            other = _kernels_from(args.qk_kernel_from, heads)
            if other.qk_norm_rope is None:
                raise RuntimeError(f"the other commit's kernel was not used: {other.reason}")
            out["other_qk"] = (other, True)
            out["other_qk_adds"] = (other, False)
    return out


def _summary(profiles: list[dict]) -> dict:
    """Medians over the rounds of one variant and batch, and every round's forward and layer."""
    def med(key):
        return median([p[key] for p in profiles])
    return {"forward_ms": med("forward_ms"), "layer_ms": med("layer_ms"), "mfu_forward": med("mfu_forward"),
            "steps_ms": {k: median([p["steps_ms"].get(k, 0.0) for p in profiles]) for k in profiles[0]["steps_ms"]},
            "forward_ms_all": [p["forward_ms"] for p in profiles], "layer_ms_all": [p["layer_ms"] for p in profiles]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", nargs="+", default=["qwen2_5_vl", "qwen3_vl"], choices=sorted(SHAPES))
    parser.add_argument("--layers", type=int, help="text layers (default: the model's)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--inner", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--qk-kernel-from", help="a cuda_fused.py whose q/k kernel is one more variant")
    parser.add_argument("--smoke", action="store_true", help="tiny dims, fp32, on any device")
    parser.add_argument("--out", default=".")
    args = parser.parse_args()
    monitored_report("diag-lm-layer", args, _run)
    return 0


def _run(args, report: dict, gpu: GpuMonitor) -> None:
    """Every model's variants in alternating rounds; each variant's GPU clocks over its own rounds (`gpu` per
    variant and batch) so that a variant that ran at a lower clock shows it."""
    import mlx.core as mx

    from batchjob.engine import cuda_fused, fused_ops

    with gpu.section("ceiling"):
        report["matmul_ceiling_tflops"] = mlx_matmul_ceiling(512 if args.smoke else 8192) / 1e12
    tmp = Path(tempfile.mkdtemp())
    for model_type in args.model:
        dims = dict(SHAPES[model_type][1 if args.smoke else 0])
        layers = args.layers or dims["layers"]
        engine = dict(device="auto" if args.smoke else "gpu", max_model_len=8192)
        frames, size = (4, (56, 56)) if args.smoke else (16, (448, 448))
        bench = build_model(model_type, dims, layers, dims["v_depth"], frames, size, tmp,
                            "float32" if args.smoke else "bfloat16", engine)
        clf = bench.classifier
        print(f"[{model_type}] {layers} layers; engine {clf.runtime.as_dict()}", flush=True)
        rng = np.random.default_rng(0)
        batches = {"equal": make_workload(bench, rng, 8, 1, frames, size, "d"), "ragged": []}
        for i in range(8):
            batches["ragged"] += make_workload(bench, rng, 1, 1, max(2, frames - 2 * (i % 6)), size, f"rg{i}")
        runs: dict = {}
        spans: dict = {}
        chosen = variants(clf, args)
        for r in range(args.rounds):
            for name, (kernels, in_gemm) in chosen.items():
                cuda_fused.activate(kernels)
                fused_ops.RESIDUAL_IN_GEMM = in_gemm
                for batch_name, reqs in batches.items():
                    profiled = fresh(reqs, f"p{r}{name}")
                    cache_features(bench, profiled)
                    start = time.perf_counter()
                    prof = profile_lm(clf, profiled, dims, report["matmul_ceiling_tflops"] * 1e12,
                                      inner=args.inner, repeats=args.repeats)
                    spans.setdefault((name, batch_name), []).append((start, time.perf_counter()))
                    drop_features(bench, profiled)
                    runs.setdefault(name, {}).setdefault(batch_name, []).append(prof)
                    steps = json.dumps({k: round(v, 3) for k, v in prof["steps_ms"].items()})
                    print(f"[{model_type}] round {r} {name} {batch_name}: forward {prof['forward_ms']:.2f} ms, layer "
                          f"{prof['layer_ms']:.3f} ms, steps {steps}", flush=True)
        cuda_fused.activate(clf.fused_kernels)
        fused_ops.RESIDUAL_IN_GEMM = True
        row = {"layers": layers, "engine_runtime": clf.runtime.as_dict(), "variants": {}}
        for name, by_batch in runs.items():
            row["variants"][name] = {b: {**_summary(ps), "gpu": gpu.over(spans[name, b])} for b, ps in by_batch.items()}
        report[model_type] = row
        print(f"\n[{model_type}] {layers} layers; medians of {args.rounds} rounds (ceiling "
              f"{report['matmul_ceiling_tflops']:.0f} TFLOP/s)\n| variant | batch | forward ms | layer ms |"
              f" MFU forward | vs {next(iter(row['variants']))} | SM MHz median |\n|---|---|---|---|---|---|---|")
        base = next(iter(row["variants"].values()))
        for name, by_batch in row["variants"].items():
            for b, v in by_batch.items():
                print(f"| {name} | {b} | {v['forward_ms']:.2f} | {v['layer_ms']:.3f} | {v['mfu_forward']:.3f} | "
                      f"{base[b]['forward_ms'] / v['forward_ms']:.3f}x | {v['gpu'].get('sm_mhz_median', 'n/a')} |")
        del bench, clf
        mx.clear_cache()


if __name__ == "__main__":
    sys.exit(main())
