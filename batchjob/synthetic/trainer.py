"""Training the demo model: MLX, on CPU, from random initialisation, on scenes rendered on the fly.

The model learns from exactly what the engine gives it: frames become pixel values through the engine's
`preprocess_video`, prompts and M-RoPE positions come from the checkpoint's model family (`video_prompt`), and
the loss is the cross-entropy of the option-label logits at the prompt's last position (the engine's answer).
The forward pass is mlx-vlm's model as the engine loads it (the family's corrections applied; the exact
speed-ups, which change the parameter layout, left out), over a right-padded batch with a causal mask, so
padding never reaches a real token. `tests/engine/test_demo_model.py` checks that the Classifier computes the
same option logits as this forward pass.
"""

from __future__ import annotations

import json
import multiprocessing
import os
from dataclasses import dataclass
from pathlib import Path
from queue import Empty, Full
from typing import Iterator, Sequence

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from batchjob.engine.families import ModelFamily, family_for
from batchjob.engine.preprocess import VideoInputs, preprocess_video
from batchjob.engine.prompt import PromptBuilder
from batchjob.engine.types import EngineConfig
from batchjob.synthetic.scenes import Question


@dataclass(frozen=True)
class Example:
    """One question about one clip, as the engine would prefill it."""

    clip: int                  # index of the clip in the batch
    token_ids: np.ndarray      # int64 [L]
    positions: np.ndarray      # int64 [3, L]
    option_ids: tuple[int, ...]
    answer: int
    kind: str


@dataclass(frozen=True)
class Batch:
    """Clips (vision inputs) and the questions about them, as padded numpy arrays (picklable: a data worker
    makes them); padding rows have weight 0, so a fixed shape fits every batch (one compiled step)."""

    pixel_values: np.ndarray   # float32 [sum of patches, C * tp * p * p]
    grids: tuple[tuple[int, int, int], ...]
    token_ids: np.ndarray      # int32 [B, L], right-padded
    positions: np.ndarray      # int32 [3, B, L]
    take: np.ndarray           # int32 [B * L]: row of (token embeddings ++ video features) for each slot
    video_slot: np.ndarray     # int32 [B * L]: 1 + feature row for video tokens, 0 elsewhere (DeepStack)
    last: np.ndarray           # int32 [B]: each sequence's last real position
    option_ids: np.ndarray     # int32 [B, most options] (padded with the first id)
    option_mask: np.ndarray    # bool [B, most options]
    answers: np.ndarray        # int32 [B]
    weights: np.ndarray        # float32 [B]: the question's kind weight (default 1), 0 for a padding row
    kinds: tuple[str, ...]     # one per question (padding rows have none)

    def arrays(self) -> tuple[mx.array, ...]:
        """The array fields, in `ARRAY_FIELDS` order, as MLX arrays (a compiled step's inputs)."""
        return tuple(mx.array(getattr(self, name)) for name in ARRAY_FIELDS)


ARRAY_FIELDS = ("pixel_values", "token_ids", "positions", "take", "video_slot", "last", "option_ids", "option_mask",
                "answers", "weights")


class EnginePrep:
    """The engine's preparation of a clip and a question, for a checkpoint directory."""

    def __init__(self, checkpoint: str | Path, config: EngineConfig):
        from transformers import AutoTokenizer

        self.path = Path(checkpoint)
        self.config = config
        self.family: ModelFamily = family_for(json.loads((self.path / "config.json").read_text()), self.path)
        self.settings = self.family.vision_settings(config)
        self.prompts = PromptBuilder(AutoTokenizer.from_pretrained(self.path), config, self.family.video_token_id,
                                     str(self.path))

    def clip_inputs(self, frames: np.ndarray, metadata: dict) -> VideoInputs:
        return preprocess_video(frames, metadata, self.settings)

    def example(self, clip: int, inputs: VideoInputs, question: Question) -> Example:
        prompt = self.family.video_prompt(self.prompts, question.text, question.options, inputs)
        return Example(clip, prompt.token_ids, prompt.positions,
                       tuple(self.prompts.option_token_ids(len(question.options))), question.answer, question.kind)

    def batch(self, clips: Sequence[VideoInputs], examples: Sequence[Example], size: int | None = None,
              width: int | None = None, most: int | None = None, kind_weights: dict[str, float] | None = None) -> Batch:
        """Pad to `size` rows of `width` tokens and `most` options (defaults: what `examples` need); a question's
        loss weighs `kind_weights[kind]` (default 1)."""
        video_id = self.family.video_token_id
        starts = np.concatenate([[0], np.cumsum([c.num_tokens for c in clips])])
        real = len(examples)
        size = size or real
        width = width or max(len(e.token_ids) for e in examples)
        if real > size or max(len(e.token_ids) for e in examples) > width:
            raise ValueError(f"{real} questions of up to {max(len(e.token_ids) for e in examples)} tokens do not "
                             f"fit a batch of {size} x {width}")
        examples = list(examples) + [examples[0]] * (size - real)    # weight 0 below
        ids = np.zeros((size, width), np.int32)
        positions = np.zeros((3, size, width), np.int32)
        for b, e in enumerate(examples):
            n = len(e.token_ids)
            ids[b, :n], positions[:, b, :n] = e.token_ids, e.positions
            positions[:, b, n:] = e.positions[:, -1:] + 1 + np.arange(width - n)
        is_video = ids == video_id
        rows = np.zeros_like(ids)
        for b, e in enumerate(examples):
            rows[b, is_video[b]] = starts[e.clip] + np.arange(is_video[b].sum())
        flat = np.arange(size * width, dtype=np.int32).reshape(size, width)
        take = np.where(is_video, size * width + rows, flat).reshape(-1)
        most = most or max(len(e.option_ids) for e in examples)
        options = np.array([list(e.option_ids) + [e.option_ids[0]] * (most - len(e.option_ids)) for e in examples])
        return Batch(
            pixel_values=np.concatenate([c.pixel_values for c in clips]).astype(np.float32),
            grids=tuple(tuple(int(v) for v in c.grid_thw) for c in clips),
            token_ids=ids, positions=positions, take=take.astype(np.int32),
            video_slot=np.where(is_video, rows + 1, 0).reshape(-1).astype(np.int32),
            last=np.array([len(e.token_ids) - 1 for e in examples], np.int32),
            option_ids=options.astype(np.int32),
            option_mask=np.arange(most)[None, :] < np.array([len(e.option_ids) for e in examples])[:, None],
            answers=np.array([e.answer for e in examples], np.int32),
            weights=np.array([(kind_weights or {}).get(e.kind, 1.0) if b < real else 0.0
                              for b, e in enumerate(examples)], np.float32),
            kinds=tuple(e.kind for e in examples[:real]))


def option_logits(model: nn.Module, family: ModelFamily, grids, pixel_values, token_ids, positions, take,
                  video_slot, last, option_ids, option_mask, *_) -> mx.array:
    """`[B, most options]` option-label logits at each sequence's last position (padded options at -inf); the
    arguments after `grids` are `Batch.arrays()`."""
    lm = model.language_model
    features = _encode_clips(model, family, grids, pixel_values)
    size, width = token_ids.shape
    hidden = lm.model.embed_tokens.weight.shape[1]
    embedded = lm.model.embed_tokens(token_ids).reshape(size * width, hidden)
    h = mx.concatenate([embedded, features[:, :hidden]])[take].reshape(size, width, hidden)
    position_embeddings = lm.model.layers[0].self_attn.rotary_emb(h, positions)
    for i, layer in enumerate(lm.model.layers):
        h = layer(h, "causal", None, None, position_embeddings)
        if i < family.num_deepstack:
            extra = features[:, hidden * (i + 1):hidden * (i + 2)]
            extra = mx.concatenate([mx.zeros((1, hidden), extra.dtype), extra])[video_slot]
            h = h + extra.reshape(size, width, hidden)
    h_last = lm.model.norm(h[mx.arange(size), last])
    logits = lm.model.embed_tokens.as_linear(h_last) if lm.args.tie_word_embeddings else lm.lm_head(h_last)
    picked = mx.take_along_axis(logits, option_ids, axis=1)
    return mx.where(option_mask, picked, mx.array(-1e9, picked.dtype))


def _encode_clips(model: nn.Module, family: ModelFamily, grids, pixel_values: mx.array) -> mx.array:
    """Vision features of every clip, one tower call per clip (the engine encodes clips one at a time)."""
    out, start = [], 0
    for grid in grids:
        patches = grid[0] * grid[1] * grid[2]
        out.append(family.encode_video(model, pixel_values[start:start + patches], grid, mx.float32))
        start += patches
    return mx.concatenate(out)


def loss(model: nn.Module, family: ModelFamily, grids, *arrays) -> mx.array:
    """Mean cross-entropy of the right option over the batch's questions (padding rows weigh nothing)."""
    answers, weights = arrays[-2], arrays[-1]
    ce = nn.losses.cross_entropy(option_logits(model, family, grids, *arrays), answers)
    return (ce * weights).sum() / weights.sum()


def batch_logits(model: nn.Module, family: ModelFamily, batch: Batch) -> np.ndarray:
    """Option logits of the batch's questions (padding rows dropped), as numpy."""
    out = option_logits(model, family, batch.grids, *batch.arrays())
    return np.asarray(out)[:len(batch.kinds)]


# --- data: scenes rendered on the fly, sampled as a uniform loader samples a clip ------------------------------

FPS = 10.0
CLIP_SIZE = (256, 144)            # width, height: the demo clips' size (the engine resizes them, as in a job)
SECONDS = (2.0, 6.0)


# Clips laid out as `pyav_burst` returns them (`burst_layout`) are drawn this many frames long, told as 2-6 s: the
# sampler curve's 12 s clips at 24 fps are 288 frames, where a burst's pair of frames a few apart shows a mover
# a pixel or a few at the model's 128-pixel width.
BURST_FRAMES = (24, 360)
B_FRAMES = 2              # the encoders' B-frames between references (scene_gops, make_scene_clip)


def sample_clip(rng: np.random.Generator, num_frames: int, *, order: bool | None = None, motion: str | None = None,
                bursts: bool = False, burst_frames: tuple[int, int] = BURST_FRAMES):
    """A fresh scene and its frames as a uniform loader returns them (`bursts`: as `pyav_burst` returns them,
    `burst_layout`, from a clip of `burst_frames` frames, log-uniform): (scene, frames, metadata); `motion` is
    the scenes' (`scenes.MOTIONS`, default `scenes.MOTION`)."""
    from batchjob.loaders.media import ClipFacts
    from batchjob.loaders.picks import uniform_targets
    from batchjob.synthetic.scenes import background, random_scene, render

    width, height = CLIP_SIZE
    scene = random_scene(rng, width / height, order=order, motion=motion)
    if bursts:
        total = int(round(np.exp(rng.uniform(*np.log(burst_frames)))))
        fps = total / rng.uniform(*SECONDS)
        indices = burst_layout(rng, total, num_frames)
    else:
        total, fps = int(round(rng.uniform(*SECONDS) * FPS)), FPS
        indices = uniform_targets(total, num_frames)
    base = background(scene, width, height)
    frames = np.stack([render(scene, i / total, width, height, int(rng.integers(2**31)), base) for i in indices])
    metadata = ClipFacts(total, fps).metadata("synthetic", indices, frames_timestamps=[i / fps for i in indices])
    return scene, frames, metadata


def burst_layout(rng: np.random.Generator, total: int, num_frames: int) -> list[int]:
    """Frame indices `pyav_burst` picks from a clip of `total` frames with fewer keyframes than `num_frames`, evenly
    spaced (fixed GOP): the pictures decoded right after each keyframe (its default; with 0 or `B_FRAMES`
    B-frames, all or at most 2 of them per keyframe) or frames 1-8 apart (`burst_step`). The loaders' own picks
    (`picks.py`), so training sees exactly what they return."""
    from batchjob.loaders.picks import burst_targets, decode_order_bursts

    keyframes = list(range(0, total, -(-total // int(rng.integers(1, num_frames)))))
    if rng.random() < 0.5:
        return burst_targets(keyframes, total, num_frames, int(rng.integers(1, 9)))
    bframes = B_FRAMES if rng.random() < 0.75 else 0
    most = 2 if rng.random() < 0.5 else None
    return decode_order_bursts(keyframes, keyframes, closed_gop_decode_order(keyframes, total, bframes), num_frames,
                               most)


def closed_gop_decode_order(keyframes: list[int], total: int, bframes: int) -> list[int]:
    """Presentation index of each picture in decode order for closed GOPs starting at `keyframes`, a reference
    every `bframes + 1` frames (each GOP's last frame a reference), the B-frames before it decoded after it."""
    order = []
    for start, end in zip(keyframes, keyframes[1:] + [total]):
        order.append(start)
        previous = start
        while previous < end - 1:
            reference = min(previous + bframes + 1, end - 1)
            order += [reference, *range(previous + 1, reference)]
            previous = reference
    return order


def sample_batch(prep: EnginePrep, rng: np.random.Generator, clips: int, num_frames: int,
                 one_question: bool = True, kind_weights: dict[str, float] | None = None,
                 motion: str | None = None, burst_share: float = 0.0,
                 burst_frames: tuple[int, int] = BURST_FRAMES) -> Batch:
    """`clips` fresh clips and questions about them: with `one_question`, one question per clip, the kinds in
    turn (each kind equally often; a clip asked the order question has two or more movers); otherwise every
    question each clip supports (every other clip with two or more movers). The prompt, not the video, is
    most of a step's work: one question per clip sees more clips for the same work. A clip's frames are laid
    out as `pyav_burst` lays them out with probability `burst_share` (`sample_clip`), else uniformly; 1.0:
    every clip bursts."""
    from batchjob.synthetic.scenes import KINDS, QUESTIONS, questions_for

    inputs, examples = [], []
    for c in range(clips):
        kind = KINDS[c % len(KINDS)]
        bursts = burst_share >= 1 or (burst_share > 0 and rng.random() < burst_share)
        scene, frames, metadata = sample_clip(rng, num_frames, order=kind == "order" if one_question else bool(c % 2),
                                              motion=motion, bursts=bursts, burst_frames=burst_frames)
        inputs.append(prep.clip_inputs(frames, metadata))
        questions = questions_for(scene)
        if one_question:
            questions = [q for q in questions if q.kind == kind]
        examples += [prep.example(c, inputs[-1], q) for q in questions]
    # one shape for every batch (one compiled step): every question kind's prompt fits
    width = max(len(prep.example(0, inputs[0], Question(kind, text, options, 0)).token_ids)
                for kind, (text, options) in QUESTIONS.items())
    return prep.batch(inputs, examples, size=clips if one_question else len(KINDS) * clips, width=width,
                      most=max(len(options) for _, options in QUESTIONS.values()), kind_weights=kind_weights)


def _produce(queue, checkpoint: str, config: EngineConfig, seed: int, clips: int, num_frames: int, count: int,
             one_question: bool, kind_weights: dict[str, float] | None, motion: str | None, burst_share: float,
             burst_frames: tuple[int, int]):
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    prep, rng, parent = EnginePrep(checkpoint, config), np.random.default_rng(seed), os.getppid()
    for _ in range(count):
        batch = sample_batch(prep, rng, clips, num_frames, one_question, kind_weights, motion, burst_share,
                             burst_frames)
        while True:
            try:
                queue.put(batch, timeout=5)
                break
            except Full:
                if os.getppid() != parent:      # the trainer is gone (killed): stop, not wait forever
                    return


def batch_stream(checkpoint: str | Path, config: EngineConfig, seed: int, clips: int, num_frames: int,
                 count: int, one_question: bool = True, kind_weights: dict[str, float] | None = None,
                 motion: str | None = None, burst_share: float = 0.0,
                 burst_frames: tuple[int, int] = BURST_FRAMES) -> Iterator[Batch]:
    """`count` batches from `np.random.default_rng(seed)`, made by one worker process while the caller trains
    (the same batches, in the same order, as `sample_batch` calls in a loop)."""
    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue(maxsize=4)
    worker = ctx.Process(target=_produce, daemon=True, args=(queue, str(checkpoint), config, seed, clips, num_frames,
                                                             count, one_question, kind_weights, motion,
                                                             burst_share, burst_frames))
    worker.start()
    try:
        for _ in range(count):
            while True:
                try:
                    yield queue.get(timeout=5)
                    break
                except Empty:
                    if not worker.is_alive():
                        raise RuntimeError(f"the data worker died (exit code {worker.exitcode})") from None
    finally:
        worker.terminate()
        worker.join()


def accuracy_by_kind(model: nn.Module, prep: EnginePrep, batches: Sequence[Batch]) -> dict[str, float]:
    """Accuracy per question kind (argmax of the option logits) over `batches`."""
    right: dict[str, list[bool]] = {}
    for batch in batches:
        chosen = batch_logits(model, prep.family, batch).argmax(axis=1)
        for kind, ok in zip(batch.kinds, chosen == batch.answers[:len(batch.kinds)]):
            right.setdefault(kind, []).append(bool(ok))
    return {k: float(np.mean(v)) for k, v in sorted(right.items())}


# --- the model as training sees it, and back to the hub's layout ----------------------------------------------

def load_for_training(checkpoint: str | Path, family: ModelFamily) -> nn.Module:
    """mlx-vlm's model from a hub checkpoint, with the engine's corrections and in the checkpoint's layout."""
    from mlx_vlm.utils import load_model

    model = load_model(Path(checkpoint))
    family.correct_model(model)
    return model


def save_hub_weights(model: nn.Module, checkpoint: str | Path) -> None:
    """Write the trained parameters over the checkpoint's own safetensors, under its hub names and layouts.

    mlx-vlm renames hub tensors and moves the patch embedding's channel axis last on load; each hub tensor is
    matched to its parameter by running mlx-vlm's own renaming on its name alone."""
    from mlx.utils import tree_flatten
    from mlx_vlm.utils import get_model_and_args, load_config, sanitize_weights

    path = Path(checkpoint) / "model.safetensors"
    hub = mx.load(str(path))
    config = load_config(Path(checkpoint))
    model_class, _ = get_model_and_args(config)
    trained = dict(tree_flatten(model.parameters()))
    out = {}
    for name, value in hub.items():
        # mlx-vlm's renaming needs the tensor (it checks shapes); the model's arguments come from its config
        renamed = sanitize_weights(model, {name: value})
        if hasattr(model_class, "VisionModel"):
            renamed = sanitize_weights(model_class.VisionModel, renamed, model.config.vision_config)
        if hasattr(model_class, "LanguageModel"):
            renamed = sanitize_weights(model_class.LanguageModel, renamed, model.config.text_config)
        (mlx_name, mlx_value), = renamed.items()
        new = trained[mlx_name]
        if new.shape != value.shape:                          # Conv3d: [O, T, H, W, C] back to [O, C, T, H, W]
            new = mx.moveaxis(new, -1, 1)
        if new.shape != value.shape or mlx_value.shape != trained[mlx_name].shape:
            raise RuntimeError(f"{name}: cannot map {trained[mlx_name].shape} back to the hub's {value.shape}")
        out[name] = new.astype(value.dtype)
    mx.save_safetensors(str(path), out, metadata={"format": "pt"})
