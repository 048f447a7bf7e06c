"""Diagnostic: the whole job's engine path alone, per batch, on the whole-job benchmark's clips and checkpoint.

Decodes clips with the shipped config's loader and prepares them as the decoders do (MlxClipPreparer), then
answers them in batches of `runtime.clips_per_batch` through `MlxEngine` (what the driver's engine thread
calls): prints ms per clip per batch, the tower / LM split of one batch, and the host profile's top functions.
"""
from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))


def _decode(job):
    from batchjob.contract import ClipMetadata
    from batchjob.loaders import load_video
    from batchjob.pipeline.mlx_engine import MlxEngine

    path, loader, num_frames, model_cfg = job
    frames, meta = load_video(path, backend=loader, num_frames=num_frames)
    metadata = ClipMetadata.from_loader(meta)
    prep = MlxEngine.input_preparer(model_cfg)
    return metadata, prep(frames, metadata), frames.shape


def _burn(jobs, stop, nice: int) -> None:
    import os

    os.nice(nice)
    while not stop.is_set():
        for job in jobs:
            if stop.is_set():
                return
            _decode(job)


def main() -> None:
    import bench_pipeline_gpu as B
    from benchlib.job_models import MODELS

    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="qwen3_vl", choices=sorted(MODELS))
    ap.add_argument("--clips", type=int, default=64)
    ap.add_argument("--cache", type=Path, default=Path("/tmp/bjcache"))
    ap.add_argument("--contend", type=int, default=0, help="processes decoding and preparing clips in a loop "
                    "while the engine answers (as the job's decoders do)")
    ap.add_argument("--contend-nice", type=int, default=0, help="their nice value")
    ap.add_argument("--cache-limit-gb", type=float, default=None, help="mx.set_cache_limit after the load")
    ap.add_argument("--clear-each-batch", action="store_true", help="mx.clear_cache() after every batch")
    ap.add_argument("--smoke", action="store_true", help="tiny clips and model: checks the script on a CPU")
    a = ap.parse_args()
    args = B.parse_args(["--model", a.model, "--cache", str(a.cache), "--clips", str(max(a.clips, 64))]
                        + (["--smoke"] if a.smoke else []))
    shape = B.SMOKE_SHAPE if a.smoke else B.Shape()
    jm = MODELS[a.model]
    specs = B.plan_clips(args.distinct, long_fraction=args.long_fraction, hevc_fraction=args.hevc_fraction,
                         seed=args.seed, shape=shape)
    data = B.build_dataset(args.cache, specs, args.clips, args.questions, args.segment_s, args.workers, args.seed,
                           shape.long_s)
    ckpt, _ = B.ensure_checkpoint(args.cache, jm.dims(a.smoke), args.layers, args.vision_layers,
                                  None if jm.clip_budget else args.max_pixels,
                                  "float32" if a.smoke else "bfloat16", a.model)
    from batchjob.config import JobConfig
    from batchjob.contract import ClipJob, EngineClip, Question
    from batchjob.pipeline.mlx_engine import MlxEngine

    cfg = JobConfig.model_validate(B.user_config(data, ckpt, "pyav_keyframes", Path("/tmp/diag-out"),
                                                 shipped=jm.config))
    records = [json.loads(x) for x in data.manifest.read_text().splitlines()]
    by_video: dict[str, list] = {}
    for r in records:
        by_video.setdefault(r["video"], []).append(r)
    videos = list(by_video)[:a.clips]
    t0 = time.perf_counter()
    with ProcessPoolExecutor(14) as pool:
        decoded = list(pool.map(_decode, [(str(data.clips_dir / v), "pyav_keyframes", cfg.loader.num_frames,
                                           cfg.model) for v in videos]))
    print(f"decoded {len(decoded)} clips in {time.perf_counter() - t0:.1f} s; frames {decoded[0][2]}; "
          f"grid {decoded[0][1].grid_thw}", flush=True)
    engine = MlxEngine.load(cfg.model, cfg.prompt)
    cpb = cfg.runtime.clips_per_batch

    def batches(tag: str) -> list:   # a fresh media id per pass: nothing cached from an earlier one
        clips = []
        for v, (meta, payload, _) in zip(videos, decoded):
            qs = tuple(Question(r["id"], r["question"], tuple(r["options"])) for r in by_video[v])
            clips.append(EngineClip(ClipJob(v, f"{v}#{tag}", qs), meta, payload))
        return [clips[i:i + cpb] for i in range(0, len(clips), cpb)]

    for b in batches("warm")[:2]:
        engine.answer(b)
    burners = []
    if a.contend:
        import multiprocessing as mp

        jobs = [(str(data.clips_dir / v), "pyav_keyframes", cfg.loader.num_frames, cfg.model) for v in videos]
        stop = mp.Event()
        burners = [mp.Process(target=_burn, args=(jobs[i::a.contend], stop, a.contend_nice), daemon=True)
                   for i in range(a.contend)]
        for p in burners:
            p.start()
        time.sleep(3)
    import mlx.core as mx

    clf = engine._clf
    if a.cache_limit_gb is not None:
        mx.set_cache_limit(int(a.cache_limit_gb * 2**30))
    ms, memory = [], []
    for b in batches("timed"):
        t = time.perf_counter()
        engine.answer(b)
        if a.clear_each_batch:
            mx.clear_cache()
        ms.append((time.perf_counter() - t) * 1e3 / len(b))
        memory.append((round(mx.get_active_memory() / 2**30, 1), round(mx.get_cache_memory() / 2**30, 1),
                       len(clf.pool._free)))
    print(f"per batch (active GiB, MLX cache GiB, never-used KV blocks): {memory}; memory limit "
          f"{mx.get_memory_limit() / 2**30:.1f} GiB, peak {mx.get_peak_memory() / 2**30:.1f} GiB", flush=True)
    print(f"{a.model} (contend {a.contend}, nice {a.contend_nice}, cache limit {a.cache_limit_gb} GiB, clear each "
          f"batch {a.clear_each_batch}): ms per clip per batch: {[round(x) for x in ms]}; median {sorted(ms)[len(ms) // 2]:.0f}",
          flush=True)
    if burners:
        stop.set()
        for p in burners:
            p.join(30)
    prof = cProfile.Profile()
    prof.enable()
    for b in batches("profiled")[:8]:
        engine.answer(b)
    prof.disable()
    s = io.StringIO()
    pstats.Stats(prof, stream=s).sort_stats("cumulative").print_stats(35)
    print(s.getvalue()[:9000], flush=True)
    s = io.StringIO()
    pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(20)
    print(s.getvalue()[:5000], flush=True)


if __name__ == "__main__":
    main()
