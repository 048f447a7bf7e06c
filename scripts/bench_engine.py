#!/usr/bin/env python
"""Engine throughput: packed + per-clip sharing vs one-at-a-time vs mlx-vlm's own forward.

Builds a mid-size random checkpoint per family (Qwen2.5-VL and Qwen3-VL; default hidden 512, 8 layers, GQA
4:1), random clips of 16 frames, and 4 questions per clip, then measures requests/s for
  (a) the engine: packed forward passes, video encoded once per clip, video-prefix KV blocks shared;
  (b) the same engine fed one request at a time with prefix sharing off;
  (c) mlx-vlm's own one-request forward (vision tower + full prompt + LM head on every position), per request.
All three include preprocessing (resize/normalize/patchify) and prompt building. Medians over --repeats runs
after a warm-up; each repeat uses fresh media ids so no run profits from an earlier one's cache.

    source scripts/env.sh && python scripts/bench_engine.py
"""

from __future__ import annotations

import argparse
import dataclasses
import platform
import statistics
import tempfile
import time

import mlx.core as mx
import numpy as np

from batchjob.engine import ClassifyRequest, Classifier, Clip, EngineConfig
from batchjob.engine.preprocess import preprocess_video
from batchjob.synthetic.tiny_model import TinyModelSpec, write_tiny_checkpoint

QUESTIONS = ["What is the person doing in the video?", "Which object moves first?",
             "Where does the action take place?", "What happens right after the door opens?"]


def make_requests(rng, num_clips: int, questions: int, frames: int, size: tuple[int, int], tag: str):
    requests = []
    for c in range(num_clips):
        pixels = rng.integers(0, 256, (frames, *size, 3), dtype=np.uint8)
        # 4 sampled frames/s: temporal position step tokens_per_second * 2 / 4 = 1, the one case where
        # mlx-vlm's own get_rope_index (which ignores the time scale) is right, so (a) and (c) must agree.
        metadata = {"fps": 60.0, "frames_indices": list(range(0, 15 * frames, 15)), "video_backend": "synthetic"}
        clip = Clip(pixels, metadata, media_id=f"{tag}-clip{c}")
        for q in range(questions):
            options = tuple(f"option {k} for question {q}" for k in range(4))
            requests.append(ClassifyRequest(f"{tag}-{c}-{q}", clip, QUESTIONS[q % len(QUESTIONS)], options))
    return requests


def fresh(requests, tag):
    """The same work under new media ids (nothing cached yet)."""
    clips = {}
    out = []
    for r in requests:
        clip = clips.setdefault(r.clip.media_id, dataclasses.replace(r.clip, media_id=f"{r.clip.media_id}-{tag}"))
        out.append(dataclasses.replace(r, clip=clip))
    return out


def run_engine(clf, requests):
    results = clf.classify(requests)
    assert all(r.error is None for r in results), [r.error for r in results if r.error]
    return [r.probs for r in results]


def run_one_at_a_time(clf, requests):
    return [clf.classify([r])[0].probs for r in requests]


def run_mlx_vlm(clf, requests):
    """mlx-vlm's own forward, one request at a time: the published harness shape with max_tokens=1."""
    model, vision = clf.checkpoint.model, clf.checkpoint.vision
    out = []
    for r in requests:
        inputs = preprocess_video(r.clip.frames, r.clip.metadata, vision)
        ids = clf.checkpoint.family.video_prompt(clf.prompts, r.question, r.options, inputs).token_ids
        # mlx-vlm's Qwen3-VL reads video pixels from `pixel_values_videos`, Qwen2.5-VL from `pixel_values`
        key = "pixel_values_videos" if clf.checkpoint.family.num_deepstack else "pixel_values"
        logits = model(mx.array(ids[None]), **{key: mx.array(inputs.pixel_values)},
                       video_grid_thw=mx.array([inputs.grid_thw])).logits
        option = logits[0, -1, clf.prompts.option_token_ids(len(r.options))].astype(mx.float32)
        out.append(np.array(mx.softmax(option)).tolist())
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--clips", type=int, default=8)
    parser.add_argument("--questions", type=int, default=4)
    parser.add_argument("--frames", type=int, default=16)
    parser.add_argument("--size", type=int, nargs=2, default=(336, 336), metavar=("H", "W"))
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--families", nargs="+", default=["qwen2_5_vl", "qwen3_vl"],
                        choices=["qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe"])
    args = parser.parse_args()
    print(f"machine: {platform.machine()} {platform.system()}, {mx.default_device()}, "
          f"model hidden {args.hidden} x {args.layers} layers, {args.clips} clips x {args.questions} questions, "
          f"{args.frames} frames {args.size[0]}x{args.size[1]}")
    print("| model | mode | prompt tokens | median s | requests/s | vs (c) |\n|---|---|---|---|---|---|", flush=True)
    for family in args.families:  # each family's rows as soon as they are measured
        print("\n".join(bench_family(family, args)), flush=True)


def bench_family(model_type: str, args) -> list[str]:
    qwen3 = model_type.startswith("qwen3")
    spec = TinyModelSpec(model_type=model_type, hidden_size=args.hidden, num_layers=args.layers,
                         num_heads=args.hidden // 64, num_kv_heads=max(1, args.hidden // 256),
                         intermediate_size=args.hidden * 11 // 4, vision_depth=4, vision_hidden=256, vision_heads=4,
                         fullatt_block_indexes=(3,), max_pixels=args.size[0] * args.size[1], seed=args.seed,
                         # Qwen3-VL: the same pixels, budgeted over the clip; DeepStack from 3 of 4 vision layers
                         video_max_pixels=args.frames * args.size[0] * args.size[1], deepstack_visual_indexes=(0, 1, 2),
                         moe_intermediate_size=args.hidden // 4 + 16)
    rng = np.random.default_rng(args.seed)
    with tempfile.TemporaryDirectory() as tmp:
        path = write_tiny_checkpoint(tmp, spec)
        config = EngineConfig(max_model_len=8192, memory_budget_gb=4.0)
        packed = Classifier.from_pretrained(path, config)
        single = Classifier.from_pretrained(path, dataclasses.replace(config, enable_prefix_sharing=False))
    requests = make_requests(rng, args.clips, args.questions, args.frames, tuple(args.size), "bench")
    modes = {
        "(a) engine: packed + per-clip sharing": (run_engine, packed),
        "(b) engine: one at a time, no sharing": (run_one_at_a_time, single),
        "(c) mlx-vlm forward, one at a time": (run_mlx_vlm, single),
    }
    warm = requests[: args.questions]
    times: dict[str, list[float]] = {m: [] for m in modes}
    answers, vision_runs = {}, {}
    for name, (fn, clf) in modes.items():
        fn(clf, fresh(warm, f"warm-{name[:3]}"))
    for rep in range(args.repeats):
        for name, (fn, clf) in modes.items():  # interleaved so drift on a shared machine hits all modes alike
            batch = fresh(requests, f"{rep}-{name[:3]}")
            calls, start = clf.vision_calls, time.perf_counter()
            answers[name] = fn(clf, batch)
            times[name].append(time.perf_counter() - start)
            vision_runs[name] = clf.vision_calls - calls   # per pass: the counter itself spans every run

    names = list(modes)
    agree = max(float(np.max(np.abs(np.array(a) - np.array(b))))
                for a, b in zip(answers[names[0]], answers[names[2]]))
    n = len(requests)
    baseline = n / statistics.median(times[names[2]])
    tokens = packed.classify(fresh(requests[:1], "len"))[0].prompt_tokens
    lines = []
    for name in names:
        med = statistics.median(times[name])
        lines.append(f"| {model_type} | {name} | {tokens} | {med:.3f} | {n / med:.2f} | {n / med / baseline:.2f}x |")
    note = "mlx-vlm's own Qwen3-VL positions" if qwen3 else "mlx-vlm's own positions (step 1 here)"
    lines.append(f"| {model_type} | max abs prob difference (a) vs (c), {note}: {agree:.1e}; vision runs in one pass "
                 f"of (a): {vision_runs[names[0]]} | | | | |")
    return lines


if __name__ == "__main__":
    main()
