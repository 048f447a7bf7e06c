"""The benchmark's model and requests: a random model in a published shape behind the engine's own loading path,
and clips prepared once up front (the pipeline prepares them in its decode workers)."""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Callable

import numpy as np

QUESTIONS = ["What is the person doing in the video?", "Which object moves first?",
             "Where does the action take place?", "What happens right after the door opens?"]


@dataclasses.dataclass
class BenchModel:
    """One model row's engine and what the baselines need to build their own copies."""

    model_type: str
    dims: dict
    layers: int
    vision_layers: int
    classifier: object        # batchjob.engine.Classifier over the random model
    checkpoint: object        # its LoadedCheckpoint
    config_dir: Path          # Hugging Face config of the random model (for transformers' copy)
    tiny: object              # the tiny checkpoint it was built from (tokenizer, prompts)


def build_model(model_type: str, dims: dict, layers: int, vision_layers: int, frames: int, size, tmp: Path,
                dtype_name: str, engine_kwargs: dict) -> BenchModel:
    """The random model in `dims`' shape, cut to `layers` / `vision_layers`, behind `Classifier`: the tiny
    checkpoint is loaded by `load_checkpoint` (device, dtype, family, processor settings for `frames` frames
    at `size`), its model replaced by the random one with the family's load-time fixes, as
    `random_engine.random_classifier` does."""
    import mlx.core as mx
    from mlx.utils import tree_flatten

    from batchjob.engine import Classifier, EngineConfig
    from batchjob.engine.checkpoint import load_checkpoint
    from batchjob.synthetic.random_engine import build_random_model, scaled_config
    from batchjob.synthetic.tiny_model import TinyModelSpec, write_tiny_checkpoint

    area = size[0] * size[1]
    if model_type == "qwen3_vl":   # the clip's pixel budget, as configs/nextqa-qwen3vl.yaml sets it
        spec = TinyModelSpec(model_type=model_type, min_pixels=32 * 32 * 4, max_pixels=area,
                             video_max_pixels=area * frames, deepstack_visual_indexes=(0, 1))
    else:
        spec = TinyModelSpec(model_type=model_type, max_pixels=area, min_pixels=28 * 28 * 4)
    tiny_dir = write_tiny_checkpoint(tmp / f"tiny-{model_type}", spec)
    big_dir = tmp / f"big-{model_type}"
    big_dir.mkdir(exist_ok=True)
    cfg = scaled_config(json.loads((tiny_dir / "config.json").read_text()), dims, layers, vision_layers)
    (big_dir / "config.json").write_text(json.dumps(cfg))
    for f in tiny_dir.iterdir():
        if f.name not in ("config.json", "model.safetensors"):
            (big_dir / f.name).write_bytes(f.read_bytes())
    config = EngineConfig(dtype=dtype_name, **engine_kwargs)
    tiny = load_checkpoint(tiny_dir, config)
    model = build_random_model(big_dir, tiny.dtype)
    tiny.family.fix_model(model)   # what load_checkpoint does: window patch, stacked projections, fused MLPs...
    mx.eval(model.parameters())
    ckpt = dataclasses.replace(tiny, model=model, hf_config=cfg,
                               weights_bytes=sum(v.nbytes for _, v in tree_flatten(model.parameters())))
    ckpt.family.hf_config = cfg
    return BenchModel(model_type, dims, layers, vision_layers, Classifier(ckpt, config), ckpt, big_dir, tiny)


def make_workload(bench: BenchModel, rng, clips: int, questions: int, frames: int, size, tag: str) -> list:
    """`clips` random clips of `frames` frames at `size`, prepared with the checkpoint's processor settings,
    `questions` questions each; loader-like metadata with the frames' times (Qwen3-VL writes them)."""
    from batchjob.engine import ClassifyRequest, Clip
    from batchjob.engine.preprocess import preprocess_video

    requests = []
    for c in range(clips):
        pixels = rng.integers(0, 256, (frames, *size, 3), dtype=np.uint8)
        indices = list(range(0, 15 * frames, 15))
        metadata = {"fps": 30.0, "frames_indices": indices, "total_num_frames": 15 * frames,
                    "duration": frames / 2.0, "frames_timestamps": [i / 30.0 for i in indices],
                    "video_backend": "synthetic"}
        # patch bytes, as the pipeline's decoders send them (the engine normalises them on its device)
        inputs = preprocess_video(pixels, metadata, bench.checkpoint.vision, normalise=False)
        clip = Clip(None, metadata, media_id=f"{tag}-clip{c}", inputs=inputs)
        for q in range(questions):
            options = tuple(f"option {k} for question {q}" for k in range(4))
            requests.append(ClassifyRequest(f"{tag}-{c}-{q}", clip, QUESTIONS[q % len(QUESTIONS)], options))
    return requests


def cache_features(bench: BenchModel, requests) -> None:
    """Each distinct clip's vision features computed (and evaluated) and put in the engine's feature cache, so
    a call over `requests` runs the language model alone."""
    import mlx.core as mx

    clf, ckpt = bench.classifier, bench.checkpoint
    for r in {r.clip.media_id: r for r in requests}.values():
        features = ckpt.encode_clip(r.clip.inputs)
        mx.eval(features)
        clf._features.put_clip(r.clip.media_id, features)


def drop_features(bench: BenchModel, requests) -> None:
    """`cache_features` undone, for requests whose call never released their clips (a profile's forwards)."""
    for r in requests:
        bench.classifier._features.release_clip(r.clip.media_id, 0, keep_tail=False)


def fresh(requests, tag: str) -> list:
    """The same requests under new media ids: nothing cached from an earlier run helps."""
    clips, out = {}, []
    for r in requests:
        clip = clips.setdefault(r.clip.media_id, dataclasses.replace(r.clip, media_id=f"{r.clip.media_id}-{tag}"))
        out.append(dataclasses.replace(r, clip=clip))
    return out


def agreement(results: list, reference: list) -> dict:
    """How far two runs' answers to the same requests agree: the share of equal choices, the largest probability
    difference."""
    pairs = list(zip(results, reference))
    return {"choices_agree": float(np.mean([a.choice == b.choice for a, b in pairs])),
            "max_prob_diff": max(float(np.max(np.abs(np.subtract(a.probs, b.probs)))) for a, b in pairs)}


def vary_questions(requests, rng, most_words: int = 7) -> list:
    """Each request's question 0-`most_words` words longer, drawn per request: prompt lengths differ from call to
    call as a job's do, so a run meets shapes it has not met before (what fixed workloads never pay)."""
    return [dataclasses.replace(r, question=r.question + " now" * int(rng.integers(0, most_words + 1)))
            for r in requests]


def prompt_ids(bench: BenchModel, request) -> list[int]:
    """The request's prompt as the engine builds it (the family's layout: timestamps for Qwen3-VL)."""
    ckpt, clf = bench.checkpoint, bench.classifier
    return ckpt.family.video_prompt(clf.prompts, request.question, request.options, request.clip.inputs) \
        .token_ids.tolist()


@dataclasses.dataclass
class DiagEngine:
    """The engine the per-call diagnostics time: a model row in the published shape (or the small one on the CPU),
    its clips' frame count and size, and the attention's shape buckets in force."""

    bench: BenchModel
    frames: int
    size: tuple[int, int]
    buckets: int


def add_diag_arguments(ap) -> None:
    """The options every per-call diagnostic takes: which model row, its depth, the attention's shape buckets,
    the small CPU shape for tests, and where the JSON goes."""
    ap.add_argument("--model", choices=("qwen2_5_vl", "qwen3_vl"), default="qwen3_vl")
    ap.add_argument("--layers", type=int, default=None, help="decoder layers (default: the published depth)")
    ap.add_argument("--buckets", type=int, default=None, help="SDPA lengths per octave (default: the engine's)")
    ap.add_argument("--smoke", action="store_true", help="the small shape on the CPU (tests)")
    ap.add_argument("--json", type=Path, default=None)


def add_job_diag_arguments(ap, rounds: int) -> None:
    """The options of the diagnostics that time bench_gpu's 64 x 4 job per model row in one process (variants or
    settings alternated round by round): the rows, their depths, the job's size, the rounds, the JSON, and the
    small CPU shape for tests."""
    from batchjob.synthetic.random_engine import SHAPES

    ap.add_argument("--model", nargs="+", default=["qwen2_5_vl"], choices=sorted(SHAPES))
    ap.add_argument("--layers", type=int, help="Qwen2.5-VL text layers (default: the published depth)")
    ap.add_argument("--vision-layers", type=int)
    ap.add_argument("--qwen3-layers", type=int, help="Qwen3-VL text layers (default: the published depth)")
    ap.add_argument("--qwen3-vision-layers", type=int)
    ap.add_argument("--clips", type=int, default=64)
    ap.add_argument("--questions", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=rounds)
    ap.add_argument("--json")
    ap.add_argument("--smoke", action="store_true", help="tiny dims, fp32, 4 frames at 56x56, on any device")


def run_job_diag(args, run_model: Callable[[str, object], dict]) -> dict:
    """`run_model(model_type, args)` for each `--model`; the report (environment, arguments, one row per model)
    written to `--json` where given."""
    from benchlib.env import environment

    report = {"environment": environment(("mlx.core",)), "args": vars(args), "models": []}
    for model_type in args.model:
        report["models"].append(run_model(model_type, args))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))
    return report


def job_diag_engine(model_type: str, args, tag: str, max_num_batched_tokens: int | str = "auto") -> DiagEngine:
    """`diag_engine` at the depths `add_job_diag_arguments` took for this row."""
    qwen3 = model_type == "qwen3_vl"
    return diag_engine(model_type, smoke=args.smoke, layers=args.qwen3_layers if qwen3 else args.layers,
                       vision_layers=args.qwen3_vision_layers if qwen3 else args.vision_layers, buckets=None,
                       tag=tag, max_num_batched_tokens=max_num_batched_tokens)


def diag_engine(model_type: str, *, smoke: bool, layers: int | None, buckets: int | None, tag: str,
                vision_layers: int | None = None, max_num_batched_tokens: int | str = "auto") -> DiagEngine:
    """`build_model` as the diagnostics run it: bf16 on the GPU (float32 on the CPU for `smoke`), 16 frames at
    448x448 (4 at 56x56), the engine's own token budget unless `max_num_batched_tokens` sets one; `buckets` (None:
    the engine's setting) replaces the portable attention's shape buckets (`attention_plan.bucketed`); `layers` /
    `vision_layers` cut the depths (None: the published ones)."""
    import functools
    import tempfile

    from batchjob.metal_backend import paged_attention
    from batchjob.synthetic.random_engine import SHAPES

    dims = dict(SHAPES[model_type][1 if smoke else 0])
    frames, size = (4, (56, 56)) if smoke else (16, (448, 448))
    engine = dict(device="auto" if smoke else "gpu", max_model_len=8192, memory_budget_gb=None,
                  max_num_batched_tokens=max_num_batched_tokens)
    tmp = Path(tempfile.mkdtemp(prefix=f"bj-{tag}-"))
    bench = build_model(model_type, dims, layers or dims["layers"], vision_layers or dims["v_depth"], frames, size, tmp,
                        "float32" if smoke else "bfloat16", engine)
    clf = bench.classifier
    fn = getattr(clf._attention, "fn", clf._attention)   # the portable path, bare or with the GPU's settings
    settings = dict(fn.keywords) if isinstance(fn, functools.partial) else {}
    if buckets is not None:
        if getattr(fn, "func", fn) is not paged_attention:
            raise SystemExit(f"--buckets: this engine's attention ({clf._attention}) is not the portable path")
        settings["shape_buckets"] = buckets
        clf._attention = functools.partial(paged_attention, **settings)
    return DiagEngine(bench, frames, size, settings.get("shape_buckets", 0))


def equal_and_ragged(diag: DiagEngine, rng, equal_clips: int = 8) -> dict[str, list]:
    """The diagnostics' two batches: `equal_clips` clips of `frames` frames (one question each), and eight of 2 to
    `frames` frames (a ragged batch: prompts of different lengths)."""
    batches = {"equal": make_workload(diag.bench, rng, equal_clips, 1, diag.frames, diag.size, "eq"), "ragged": []}
    for i in range(8):
        batches["ragged"] += make_workload(diag.bench, rng, 1, 1, max(2, diag.frames - 2 * (i % 6)), diag.size,
                                           f"rg{i}")
    return batches
