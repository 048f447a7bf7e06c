"""The whole engine (planned vision towers, stacked projections, compiled rotary, grouped and folded paged
attention, DeepStack) against mlx-vlm's own untouched modules, request by request (fp32, CPU, <= 1e-5).

The reference loads the checkpoint afresh with mlx-vlm and runs its own vision tower (mlx-vlm's known bugs
corrected as PLATFORM.md records: empty windows dropped, Qwen3-VL-MoE's GELUs swapped back) and its own
contiguous decoder forward on one request at a time, with the engine's prompt and M-RoPE positions (those are
checked against transformers in test_parity.py and test_qwen3.py). Anything the engine does for speed must
leave the option log-probs where mlx-vlm's plain forward puts them.
"""

from __future__ import annotations

import functools
import uuid
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

from batchjob.engine import Classifier, EngineConfig
from batchjob.engine.preprocess import preprocess_video
from batchjob.metal_backend import paged_attention
from batchjob.metal_backend.attention_plan import GPU_SHAPE_BUCKETS
from batchjob.metal_backend.selection import GPU_GROUP_ROWS, GPU_QUERY_CHUNK

NAMES = ["qwen2_5_vl-gqa", "qwen2_vl-mha", "qwen3_vl", "qwen3_vl_moe"]
# CUDA's attention settings (one call over whole groups padded to repeating lengths, K/V views, followers folded)
# in fp32 on the CPU.
GPU_ATTENTION = functools.partial(paged_attention, query_chunk=GPU_QUERY_CHUNK, group_rows=GPU_GROUP_ROWS,
                                  contiguous_kv=False, fold_followers=True, shape_buckets=GPU_SHAPE_BUCKETS)


def _mlx_vlm_model(path: str, model_type: str):
    from mlx_vlm.utils import load_model

    from batchjob.engine.qwen25_vision import patch_window_index

    model = load_model(Path(path))
    tower = model.vision_tower
    if model_type == "qwen2_5_vl":
        patch_window_index(tower)
    if model_type.startswith("qwen3"):
        for merger in [tower.merger, *tower.deepstack_merger_list]:
            merger.act_fn = nn.GELU()
        for block in tower.blocks:
            block.mlp.act_fn = nn.GELU(approx="tanh")
    return model


def _reference_logprobs(model, clf, request) -> np.ndarray:
    family, vision = clf.checkpoint.family, clf.checkpoint.vision
    inputs = preprocess_video(request.clip.frames, request.clip.metadata, vision)
    prompt = family.video_prompt(clf.prompts, request.question, request.options, inputs)
    outputs = model.vision_tower(mx.array(inputs.pixel_values), mx.array([list(inputs.grid_thw)]))
    features, deepstack = outputs if isinstance(outputs, tuple) else (outputs, [])
    lm = model.language_model
    ids = mx.array(prompt.token_ids)
    h = lm.model.embed_tokens(ids)
    rows = np.asarray(prompt.video_rows)
    where = mx.array(np.flatnonzero(rows >= 0).astype(np.int32))
    h[where] = features[mx.array(rows[rows >= 0].astype(np.int32))]
    kwargs = {}
    if deepstack:
        kwargs = dict(visual_pos_masks=mx.array(rows >= 0)[None], deepstack_visual_embeds=deepstack)
    out = lm.model(None, inputs_embeds=h[None], position_ids=mx.array(prompt.positions[:, None, :]), **kwargs)
    last = out[0, -1]
    logits = lm.model.embed_tokens.as_linear(last) if lm.args.tie_word_embeddings else lm.lm_head(last)
    chosen = np.array(logits[mx.array(clf.prompts.option_token_ids(len(request.options)))]).astype(np.float64)
    shifted = chosen - chosen.max()
    return shifted - np.log(np.exp(shifted).sum())


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("attention", ["cpu", "gpu_settings"])
def test_engine_answers_like_mlx_vlm_forward(name, attention, checkpoint_dir, specs, rng, make_clip, make_request,
                                            monkeypatch, check_choice):
    from batchjob.metal_backend import attention_plan

    # Clips long next to their questions, as real ones are (so followers fold), within a few seconds of CPU.
    config = EngineConfig(max_model_len=4096, memory_budget_gb=1.0, max_pixels=224 * 224 * 8)
    clf = Classifier.from_pretrained(checkpoint_dir(name), config)
    folds = []
    if attention == "gpu_settings":
        clf._attention = GPU_ATTENTION
        real_fold = attention_plan._fold_call
        monkeypatch.setattr(attention_plan, "_fold_call", lambda seqs, *a: folds.append(seqs) or real_fold(seqs, *a))
    # Clips of two sizes (two vision plans), several questions each: leaders packed together, followers folded
    # over their clip's cached prefix (GPU settings), a clip asked once.
    clips = [make_clip(rng, f"{name}-{uuid.uuid4().hex}", num_frames=int(rng.integers(4, 8)), size=size)
             for size in [(224, 224), (224, 224), (140, 252)]]
    requests = [make_request(rng, f"r{c}-{q}", clip) for c, clip in enumerate(clips) for q in range(4 if c < 2 else 1)]
    results = clf.classify(requests)
    assert all(r.error is None for r in results), [r.error for r in results]
    assert sum(r.cached_tokens > 0 for r in results) >= 4   # followers did read their clip's cached prefix
    assert bool(folds) == (attention == "gpu_settings")      # ... folded into one call per clip on the GPU path
    model = _mlx_vlm_model(checkpoint_dir(name), specs[name].model_type)
    worst = 0.0
    for request, result in zip(requests, results):
        want = _reference_logprobs(model, clf, request)
        err = float(np.abs(np.array(result.logprobs) - want).max())
        worst = max(worst, err)
        assert err <= 1e-5, (name, attention, request.request_id, err)
        check_choice(result, want, (name, attention, request.request_id))
    spread = max(float(np.ptp(r.logprobs)) for r in results)
    assert spread > 1e-2, f"option log-probs nearly uniform (spread {spread}); the check would be weak"
    print(f"{name} {attention}: worst |dlogprob| vs mlx-vlm = {worst:.2e}")
