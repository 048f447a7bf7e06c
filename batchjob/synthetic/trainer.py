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
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

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
    """Clips (vision inputs) and the questions about them, as padded arrays."""

    pixel_values: mx.array     # [sum of patches, C * tp * p * p]
    grids: tuple[tuple[int, int, int], ...]
    token_ids: mx.array        # int32 [B, L], right-padded
    positions: mx.array        # int32 [3, B, L]
    take: mx.array             # int32 [B * L]: row of (token embeddings ++ video features) for each slot
    video_slot: mx.array       # int32 [B * L]: 1 + feature row for video tokens, 0 elsewhere (DeepStack)
    last: mx.array             # int32 [B]: each sequence's last real position
    option_ids: mx.array       # int32 [B, most options] (padded with the first id)
    option_mask: mx.array      # bool [B, most options]
    answers: mx.array          # int32 [B]
    kinds: tuple[str, ...]


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

    def batch(self, clips: Sequence[VideoInputs], examples: Sequence[Example]) -> Batch:
        video_id = self.family.video_token_id
        starts = np.concatenate([[0], np.cumsum([c.num_tokens for c in clips])])
        size, width = len(examples), max(len(e.token_ids) for e in examples)
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
        most = max(len(e.option_ids) for e in examples)
        options = np.array([list(e.option_ids) + [e.option_ids[0]] * (most - len(e.option_ids)) for e in examples])
        return Batch(
            pixel_values=mx.array(np.concatenate([c.pixel_values for c in clips])),
            grids=tuple(tuple(c.grid_thw) for c in clips),
            token_ids=mx.array(ids), positions=mx.array(positions), take=mx.array(take.astype(np.int32)),
            video_slot=mx.array(np.where(is_video, rows + 1, 0).reshape(-1).astype(np.int32)),
            last=mx.array(np.array([len(e.token_ids) - 1 for e in examples], np.int32)),
            option_ids=mx.array(options.astype(np.int32)),
            option_mask=mx.array(np.arange(most)[None, :] < np.array([len(e.option_ids) for e in examples])[:, None]),
            answers=mx.array(np.array([e.answer for e in examples], np.int32)),
            kinds=tuple(e.kind for e in examples))


def option_logits(model: nn.Module, family: ModelFamily, batch: Batch) -> mx.array:
    """`[B, most options]` option-label logits at each sequence's last position (padded options at -inf)."""
    lm = model.language_model
    features = family.encode_video(model, batch.pixel_values, batch.grids, mx.float32) if len(batch.grids) == 1 \
        else _encode_clips(model, family, batch)
    size, width = batch.token_ids.shape
    hidden = lm.model.embed_tokens.weight.shape[1]
    embedded = lm.model.embed_tokens(batch.token_ids).reshape(size * width, hidden)
    h = mx.concatenate([embedded, features[:, :hidden]])[batch.take].reshape(size, width, hidden)
    position_embeddings = lm.model.layers[0].self_attn.rotary_emb(h, batch.positions)
    for i, layer in enumerate(lm.model.layers):
        h = layer(h, "causal", None, None, position_embeddings)
        if i < family.num_deepstack:
            extra = features[:, hidden * (i + 1):hidden * (i + 2)]
            extra = mx.concatenate([mx.zeros((1, hidden), extra.dtype), extra])[batch.video_slot]
            h = h + extra.reshape(size, width, hidden)
    h_last = lm.model.norm(h[mx.arange(size), batch.last])
    logits = lm.model.embed_tokens.as_linear(h_last) if lm.args.tie_word_embeddings else lm.lm_head(h_last)
    picked = mx.take_along_axis(logits, batch.option_ids, axis=1)
    return mx.where(batch.option_mask, picked, mx.array(-1e9, picked.dtype))


def _encode_clips(model: nn.Module, family: ModelFamily, batch: Batch) -> mx.array:
    """Vision features of every clip, one tower call per clip (the engine encodes clips one at a time)."""
    out, start = [], 0
    for grid in batch.grids:
        patches = grid[0] * grid[1] * grid[2]
        out.append(family.encode_video(model, batch.pixel_values[start:start + patches], grid, mx.float32))
        start += patches
    return mx.concatenate(out)


def loss(model: nn.Module, family: ModelFamily, batch: Batch) -> mx.array:
    return nn.losses.cross_entropy(option_logits(model, family, batch), batch.answers).mean()
