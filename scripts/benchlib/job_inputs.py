"""The whole-job benchmark's inputs as a user has them on disk: synthetic clips with their questions (a NExT-QA MC
annotation and a manifest), a random checkpoint in a published shape, and the shipped config pointed at them."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .clips import SMOKE_SHAPE, ClipSpec, Shape, encode_clips, job_clip_names, plan_clips
from .job_models import MODELS

SHIPPED_CONFIG = MODELS["qwen2_5_vl"].config
IN_PROCESS_ENGINE = "batchjob.synthetic.random_engine:RandomWeightsEngine"


@dataclass(frozen=True)
class Dataset:
    """One job's files: the clips (hard links to the encoded files), the same questions as a NExT-QA MC
    annotation (what the shipped config reads) and as a manifest (the in-process methods and the baseline)."""
    root: Path
    annotation: Path
    manifest: Path
    info: dict

    @property
    def clips_dir(self) -> Path:
        return self.root / "clips"


def build_dataset(cache: Path, specs: list[ClipSpec], clips: int, questions: int, segment_s: float,
                  workers: int, seed: int, long_s: float) -> Dataset:
    """Encode the distinct clips in parallel, link the job's names, write the questions in both formats."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    times, build_s = encode_clips(cache / "clips", specs, segment_s, workers)
    root = cache / f"job-{clips}-{len(specs)}-{questions}q-{seed}"
    (root / "clips").mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    records, nextqa = [], []
    for i, (name, spec) in enumerate(job_clip_names(specs, clips)):
        link = root / "clips" / name
        if not link.exists():
            os.link(cache / "clips" / spec.name, link)
        for q in range(questions):
            question, options, answer = f"Question {q} about clip {i}?", [f"option {k}" for k in range(5)], \
                int(rng.integers(0, 5))
            records.append({"id": f"c{i:05d}q{q}", "video": name, "question": question, "options": options,
                            "answer": answer})
            nextqa.append({"video": name.removesuffix(".mp4"), "qid": q, "type": "CW", "question": question,
                           **{f"a{k}": o for k, o in enumerate(options)}, "answer": answer})
    manifest, annotation = root / "manifest.jsonl", root / "nextqa_mc.parquet"
    tmp = root / "manifest.tmp"
    tmp.write_text("".join(json.dumps(r) + "\n" for r in records))
    tmp.rename(manifest)
    pq.write_table(pa.Table.from_pylist(nextqa), root / "nextqa_mc.tmp")
    (root / "nextqa_mc.tmp").rename(annotation)
    sizes = [(cache / "clips" / s.name).stat().st_size for s in dict.fromkeys(specs)]
    info = {"build_s": build_s, "encoded": len(times), "distinct": len(set(specs)), "clips": clips,
            "rows": len(records), "encode_s": times, "bytes_total": int(sum(sizes)),
            "long_clips": sum(1 for _, s in job_clip_names(specs, clips) if s.seconds >= long_s),
            "hevc_clips": sum(1 for _, s in job_clip_names(specs, clips) if s.codec == "hevc")}
    return Dataset(root, annotation, manifest, info)



def ensure_checkpoint(cache: Path, dims: dict, layers: int, vision_layers: int, max_pixels: int | None,
                      dtype: str, model_type: str = "qwen2_5_vl") -> tuple[Path, float]:
    """The model as users have it: a `model_type` checkpoint directory on disk (safetensors shards) in `dims`'
    shape, its processor's default `max_pixels` (None: the hub's), written once per machine by a child process
    (this one never holds the GPU). Returns its path and the seconds spent."""
    path = cache / (f"checkpoint-{model_type}-h{dims['hidden']}-L{layers}-V{vision_layers}-p{max_pixels or 'hub'}"
                    f"-{dtype}")
    if (path / ".complete").exists():
        return path, 0.0
    t0 = time.perf_counter()
    code = ("import json, sys; from batchjob.synthetic.random_engine import write_random_checkpoint as w; "
            "w(sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), "
            "max_pixels=json.loads(sys.argv[5]), dtype=sys.argv[6], model_type=sys.argv[7])")
    subprocess.run([sys.executable, "-c", code, str(path), json.dumps(dims), str(layers), str(vision_layers),
                    json.dumps(max_pixels), dtype, model_type], check=True)
    (path / ".complete").touch()
    return path, time.perf_counter() - t0


def ensure_in_process_model(cache: Path, dims: dict, layers: int, vision_layers: int, max_pixels: int | None,
                            model_type: str = "qwen2_5_vl") -> Path:
    """A tiny checkpoint naming the shape to build in the engine's process (`--in-process-model`, a diagnostic)."""
    from batchjob.synthetic.random_engine import scaled_config, tiny_spec, write_random_config
    from batchjob.synthetic.tiny_model import write_tiny_checkpoint

    path = cache / f"model-{model_type}-h{dims['hidden']}-L{layers}-V{vision_layers}-p{max_pixels or 'hub'}"
    if not (path / ".complete").exists():
        shutil.rmtree(path, ignore_errors=True)
        write_tiny_checkpoint(path, tiny_spec(model_type, max_pixels))
        tiny = json.loads((path / "config.json").read_text())
        write_random_config(path, scaled_config(tiny, dims, layers, vision_layers))
        (path / ".complete").touch()
    return path


def job_data(args) -> Dataset:
    """The job's clips and questions as `args` asks (encoded once per cache)."""
    shape = SMOKE_SHAPE if args.smoke else Shape()
    specs = plan_clips(args.distinct, long_fraction=args.long_fraction, hevc_fraction=args.hevc_fraction,
                       seed=args.seed, shape=shape)
    return build_dataset(args.cache, specs, args.clips, args.questions, args.segment_s, args.workers, args.seed,
                         shape.long_s)


def checkpoint_pixels(args) -> int | None:
    """The checkpoint's own processor default: Qwen2.5-VL's as before (the config's per-frame value), Qwen3-VL's as
    published (None: the shipped config sets the job's whole-clip budget over it)."""
    return None if MODELS[args.model].clip_budget else args.max_pixels


def job_checkpoint(args, dtype: str) -> tuple[Path, float]:
    """`ensure_checkpoint` for `args`' model, depth and size: (its path, seconds spent writing it)."""
    dims = MODELS[args.model].dims(args.smoke or args.tiny_model)
    return ensure_checkpoint(args.cache, dims, args.layers, args.vision_layers, checkpoint_pixels(args), dtype,
                             args.model)


def user_config(data: Dataset, checkpoint: Path, loader: str, out: Path, *, limit: int | None = None,
                budget_gb: float | None = None, shipped: Path = SHIPPED_CONFIG) -> dict:
    """The model's shipped config (configs/nextqa.yaml, nextqa-qwen3vl.yaml) as shipped: only the paths, the loader
    and the job's size change (and, for the explicit-budget run, `model.memory_budget_gb`)."""
    import yaml

    cfg = yaml.safe_load(shipped.read_text())
    cfg["dataset"].update(annotation=str(data.annotation), video_root=str(data.clips_dir), limit=limit)
    cfg["model"]["checkpoint"] = str(checkpoint)
    cfg["loader"]["name"] = loader
    cfg["output"]["directory"] = str(out)
    if budget_gb is not None:
        cfg["model"]["memory_budget_gb"] = budget_gb
    return cfg


def in_process_config(args, model: Path, data: Dataset, loader: str, out: Path) -> dict:
    """The diagnostic job of `--in-process-model`: the random model built in the engine's process."""
    return {
        "job": f"bench-{loader}",
        "dataset": {"adapter": "manifest", "annotation": str(data.manifest), "video_root": str(data.clips_dir)},
        "model": {"checkpoint": str(model), "engine": IN_PROCESS_ENGINE, "dtype": args.dtype, "device": args.device,
                  "max_pixels": args.max_pixels, "memory_budget_gb": args.memory_budget_gb},
        "loader": {"name": loader, "num_frames": args.num_frames},
        "output": {"directory": str(out)},
    }
