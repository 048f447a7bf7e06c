"""One packed forward pass of the language model over a scheduled batch, and the vision tower per clip.

All new tokens of all scheduled sequences sit on one flat axis (a single row `[1, T, hidden]`); paged
attention keeps sequences apart through the metadata. mlx-vlm's own `LanguageModel.__call__` is bypassed:
it recomputes or reuses stale M-RoPE positions and runs the LM head on every position. Here positions come
from the engine and only the last position of each finishing sequence reaches the LM head.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from functools import cached_property
from typing import Callable, Mapping

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from batchjob.metal_backend import KVCache, build_attention_metadata

from .attention import AttentionContext, AttentionFn, attention_context
from .decoder_layer import run_layer
from .fused_ops import pairs_suit, split_tables
from .scheduler import ScheduledSlice
from .video_features import FeatureRows

# How many decoder layers the host may queue ahead of the one the GPU runs (0: build the whole pass, then run it).
# Each layer is handed to MLX as soon as it is built, so the GPU starts on layer 0 while Python builds the rest;
# waiting for layer i - LAYER_LAG before building past layer i bounds the activations alive at once to a few
# layers' worth, which MLX's cache of freed buffers then serves from layer to layer (unpaced, MLX runs up to ten
# command graphs ahead and a pass holds many layers' activations, more than the cache keeps).
LAYER_LAG = 2


@dataclass(frozen=True)
class ForwardOutput:
    """Option logits for the sequences whose last prompt token was computed in this pass."""

    finished_slices: list[int]  # indices into the batch
    option_logits: mx.array | None  # float32 [len(finished_slices), most options] on the device (None: no rows)

    @cached_property
    def logits(self) -> np.ndarray:
        """The option logits on the host, row i padded past the options of finished_slices[i] (only these columns
        ever leave the device); reading them waits for the pass."""
        if self.option_logits is None:
            return np.zeros((0, 0), np.float32)
        return np.array(self.option_logits)


@dataclass
class LayerQueue:
    """The layers handed to the device and not yet waited on. A pass given the queue its previous pass left keeps
    the device fed across the step's end: its first layers are queued behind the last ones of the pass before, and
    the LAYER_LAG bound on layers in flight (and so on activations alive) holds across the boundary as within a
    pass. A pass given none starts an empty one and waits for all of its work before returning."""

    queued: deque = field(default_factory=deque)

    def push(self, h: mx.array, *writes: mx.array, before_wait: Callable[[], None]) -> None:
        """Hand a layer's output (and its K/V writes) to the device; past LAYER_LAG layers in flight, call
        `before_wait`, then wait for the oldest."""
        mx.async_eval(h, *writes)
        self.queued.append(h)
        if len(self.queued) > LAYER_LAG:
            before_wait()
            mx.eval(self.queued.popleft())   # the GPU still holds LAYER_LAG layers: the host waits, the GPU does not


@dataclass(frozen=True)
class VideoInjection:
    """Where the clips' features go in this pass: flat token indices and the matching feature rows."""

    token_index: mx.array  # int32 [n] positions on the packed token axis
    rows: mx.array  # [n, hidden * (1 + num_deepstack)]


def _video_injection(batch: list[ScheduledSlice], video_features: Mapping[str, FeatureRows]) -> VideoInjection | None:
    """The video tokens among the new tokens and their rows (rows are consecutive within one slice)."""
    where, rows, flat = [], [], 0
    for s in batch:
        lo, hi = s.seq.num_computed, s.seq.num_computed + s.num_new
        first, end = s.seq.rows_between(lo, hi)
        if first < end:
            where.append(flat + np.flatnonzero(s.seq.video_rows[lo:hi] >= 0))
            rows.append(video_features[s.seq.media_key].slice(first, end))
        flat += s.num_new
    if not where:
        return None
    return VideoInjection(mx.array(np.concatenate(where).astype(np.int32)),
                          rows[0] if len(rows) == 1 else mx.concatenate(rows, axis=0))


def _embed(language_model, batch: list[ScheduledSlice], video: VideoInjection | None) -> mx.array:
    """Token embeddings of the new tokens, with video placeholders replaced by the clip's vision features."""
    ids = np.concatenate([s.seq.token_ids[s.seq.num_computed:s.seq.num_computed + s.num_new] for s in batch])
    h = language_model.model.embed_tokens(mx.array(ids))
    if video is not None:
        h[video.token_index] = video.rows[:, :h.shape[-1]].astype(h.dtype)
    return h


def forward(
    model: nn.Module,
    batch: list[ScheduledSlice],
    kv_cache: KVCache,
    attention: AttentionFn,
    video_features: Mapping[str, FeatureRows],
    num_deepstack: int = 0,
    on_first_wait: Callable[[], None] | None = None,
    on_wait: Callable[[], object] | None = None,
    on_queued: Callable[[], None] | None = None,
    layers: LayerQueue | None = None,
) -> ForwardOutput:
    """Run the decoder over the packed batch, writing KV; logits only at finishing sequences' last token.

    With DeepStack (Qwen3-VL), feature set i is added to the video tokens' hidden states after layer i. Each
    layer is queued as soon as it is built, at most LAYER_LAG ahead of the GPU. `on_first_wait` is called once,
    when the host first waits on the device (work queued, the thread about to idle: `Classifier.stage`'s turn).
    `on_wait` is called before every wait on a layer, with LAYER_LAG + 1 layers queued to cover it: a short piece
    of host work (`intake.StepAhead.piece`). `on_queued` is called once the whole pass is queued, before its logits
    are read: work queued there runs on the device right after this pass (`intake.StepAhead.finish`). With
    `layers` (the queue the previous pass left), the pass is left running: its logits are read when asked for
    (`ForwardOutput.logits`), once the host has queued the next pass; without, it is done on return."""
    lm = model.language_model
    meta = build_attention_metadata([s.attention_slice() for s in batch], kv_cache.block_size)
    positions = np.concatenate(
        [s.seq.positions[:, s.seq.num_computed:s.seq.num_computed + s.num_new] for s in batch], axis=1)
    video = _video_injection(batch, video_features)
    h = _embed(lm, batch, video)[None]
    rotary = lm.model.layers[0].self_attn.rotary_emb
    position_embeddings = rotary(h, mx.array(positions[:, None, :]))
    cos, sin = position_embeddings
    tables = split_tables(cos[0][:, None, :], sin[0][:, None, :]) if pairs_suit(cos.shape[-1]) else None
    leave_running = layers is not None
    layers = layers if leave_running else LayerQueue()

    def before_wait() -> None:
        nonlocal on_first_wait
        if on_first_wait is not None:
            on_first_wait()
            on_first_wait = None
        if on_wait is not None:
            on_wait()

    with attention_context(AttentionContext(meta, kv_cache, attention, tables)):
        for i, layer in enumerate(lm.model.layers):
            h = run_layer(layer, h, position_embeddings)
            if video is not None and i < num_deepstack:
                width = h.shape[-1]
                h = h.at[:, video.token_index].add(video.rows[None, :, width * (i + 1):width * (i + 2)].astype(h.dtype))
            if LAYER_LAG > 0:
                layers.push(h, kv_cache.k[i], kv_cache.v[i], before_wait=before_wait)
    if on_first_wait is not None:
        on_first_wait()
    finished = [i for i, s in enumerate(batch) if s.is_last_chunk]
    option_logits = None
    if finished:   # else a chunk of a long prompt: only the cache writes matter
        last = mx.array([int(meta.cu_seqlens_q_host[i + 1]) - 1 for i in finished])
        h_last = lm.model.norm(h[0, last])
        logits = lm.model.embed_tokens.as_linear(h_last) if lm.args.tie_word_embeddings else lm.lm_head(h_last)
        options = option_columns([batch[i].seq.option_token_ids for i in finished])
        option_logits = mx.take_along_axis(logits, mx.array(options), axis=1).astype(mx.float32)
    outputs = ([option_logits] if finished else []) + [kv_cache.k, kv_cache.v]
    if on_queued is not None or leave_running:
        mx.async_eval(*outputs)   # the pass's last work handed to the device: what `on_queued` queues runs after it
    if on_queued is not None:
        on_queued()
    if not leave_running:
        mx.eval(*outputs)
    return ForwardOutput(finished, option_logits)


def option_columns(option_ids: list[list[int]]) -> np.ndarray:
    """`[n, most options]` vocabulary ids to gather per row, short rows padded with their own first id."""
    width = max(len(ids) for ids in option_ids)
    return np.array([list(ids) + [ids[0]] * (width - len(ids)) for ids in option_ids], dtype=np.int32)
