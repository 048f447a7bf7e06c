"""One packed forward pass of the language model over a scheduled batch, and the vision tower per clip.

All new tokens of all scheduled sequences sit on one flat axis (a single row `[1, T, hidden]`); paged
attention keeps sequences apart through the metadata. mlx-vlm's own `LanguageModel.__call__` is bypassed:
it recomputes or reuses stale M-RoPE positions and runs the LM head on every position. Here positions come
from the engine and only the last position of each finishing sequence reaches the LM head.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from batchjob.metal_backend import KVCache, build_attention_metadata

from .attention import AttentionContext, AttentionFn, attention_context
from .qwen2_vision import encode_qwen2
from .qwen25_vision import encode_qwen25
from .scheduler import ScheduledSlice
from .video_features import FeatureRows


@dataclass(frozen=True)
class ForwardOutput:
    """Option logits for the sequences whose last prompt token was computed in this pass."""

    finished_slices: list[int]  # indices into the batch
    logits: np.ndarray  # float32 [len(finished_slices), most options]: option-token logits, row i padded past
    # the options of finished_slices[i] (only these columns ever leave the device)


def encode_video(model: nn.Module, pixel_values: np.ndarray, grid_thw: tuple[int, int, int], dtype) -> mx.array:
    """Vision tower output `[num_video_tokens, hidden]` for one clip (merged patches, LM width)."""
    tower = model.vision_tower
    encode = TOWER_FORWARDS.get(getattr(tower, "model_type", None))
    if encode is not None:  # our packed forward: no host sync per layer
        return encode(tower, mx.array(pixel_values).astype(dtype), [tuple(grid_thw)]).astype(dtype)
    features = tower(mx.array(pixel_values).astype(dtype), mx.array([list(grid_thw)]), output_hidden_states=False)
    if isinstance(features, tuple):
        features = features[0]
    return features.astype(dtype)


TOWER_FORWARDS = {"qwen2_5_vl": encode_qwen25, "qwen2_vl": encode_qwen2}  # other families: mlx-vlm's forward


def _embed(language_model, batch: list[ScheduledSlice], video_features: Mapping[str, FeatureRows]) -> mx.array:
    """Token embeddings of the new tokens, with video placeholders replaced by the clip's vision features."""
    ids = np.concatenate([s.seq.token_ids[s.seq.num_computed:s.seq.num_computed + s.num_new] for s in batch])
    text = language_model.model.embed_tokens(mx.array(ids))
    pieces, flat = [], 0
    for s in batch:
        lo, hi = s.seq.num_computed, s.seq.num_computed + s.num_new
        v_lo, v_hi = max(lo, s.seq.video_span[0]), min(hi, s.seq.video_span[1])
        if v_lo < v_hi:
            start = s.seq.video_span[0]
            pieces.append(text[flat:flat + v_lo - lo])
            pieces.append(video_features[s.seq.media_key].slice(v_lo - start, v_hi - start).astype(text.dtype))
            pieces.append(text[flat + v_hi - lo:flat + s.num_new])
        else:
            pieces.append(text[flat:flat + s.num_new])
        flat += s.num_new
    pieces = [p for p in pieces if p.shape[0]]
    return pieces[0] if len(pieces) == 1 else mx.concatenate(pieces, axis=0)


def forward(
    model: nn.Module,
    batch: list[ScheduledSlice],
    kv_cache: KVCache,
    attention: AttentionFn,
    video_features: Mapping[str, FeatureRows],
) -> ForwardOutput:
    """Run the decoder over the packed batch, writing KV; logits only at finishing sequences' last token."""
    lm = model.language_model
    meta = build_attention_metadata([s.attention_slice() for s in batch], kv_cache.block_size)
    positions = np.concatenate(
        [s.seq.positions[:, s.seq.num_computed:s.seq.num_computed + s.num_new] for s in batch], axis=1)
    h = _embed(lm, batch, video_features)[None]
    rotary = lm.model.layers[0].self_attn.rotary_emb
    position_embeddings = rotary(h, mx.array(positions[:, None, :]))
    with attention_context(AttentionContext(meta, kv_cache, attention)):
        for layer in lm.model.layers:
            h = layer(h, None, None, None, position_embeddings)
    finished = [i for i, s in enumerate(batch) if s.is_last_chunk]
    if not finished:  # a chunk of a long prompt: only the cache writes matter
        mx.eval(kv_cache.k, kv_cache.v)
        return ForwardOutput([], np.zeros((0, 0), np.float32))
    last = mx.array([int(meta.cu_seqlens_q_host[i + 1]) - 1 for i in finished])
    h_last = lm.model.norm(h[0, last])
    logits = lm.model.embed_tokens.as_linear(h_last) if lm.args.tie_word_embeddings else lm.lm_head(h_last)
    options = option_columns([batch[i].seq.option_token_ids for i in finished])
    option_logits = mx.take_along_axis(logits, mx.array(options), axis=1).astype(mx.float32)
    mx.eval(option_logits, kv_cache.k, kv_cache.v)
    return ForwardOutput(finished, np.array(option_logits))


def option_columns(option_ids: list[list[int]]) -> np.ndarray:
    """`[n, most options]` vocabulary ids to gather per row, short rows padded with their own first id."""
    width = max(len(ids) for ids in option_ids)
    return np.array([list(ids) + [ids[0]] * (width - len(ids)) for ids in option_ids], dtype=np.int32)
