"""Parity with Hugging Face transformers (torch, CPU, fp32) on the same checkpoint, frames and prompt.

The reference builds its own prompt (chat template + expanded video placeholder), computes its own M-RoPE
positions with transformers' get_rope_index (given `second_per_grid_ts` and `mm_token_type_ids`), and runs
one request at a time. Both models get identical pixel values: the engine's preprocessing is proved equal to
transformers' image processor in test_preprocess.py (the video processor needs torchvision, absent here).
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from batchjob.engine.preprocess import preprocess_video

torch.set_grad_enabled(False)


def _sampled_spg(metadata: dict, temporal_patch: int = 2) -> float:
    """transformers' own temporal step: temporal_patch / VideoMetadata.sampled_fps (n / total * fps)."""
    from transformers.video_utils import VideoMetadata

    meta = VideoMetadata(total_num_frames=metadata["total_num_frames"], fps=metadata["fps"],
                         frames_indices=list(metadata["frames_indices"]))
    return temporal_patch / meta.sampled_fps


def reference_logprobs(hf_model, tokenizer, config, clip, request, vision_settings, model_type) -> np.ndarray:
    inputs = preprocess_video(clip.frames, clip.metadata, vision_settings)
    options = "\n".join(f"{label}. {text}" for label, text in zip(config.option_labels, request.options))
    text = config.prompt_template.format(question=request.question, options=options)
    messages = [{"role": "user", "content": [{"type": "video"}, {"type": "text", "text": text}]}]
    rendered = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    rendered = rendered.replace("<|video_pad|>", "<|video_pad|>" * inputs.num_tokens)
    ids = torch.tensor([tokenizer.encode(rendered, add_special_tokens=False)])
    video_id = hf_model.config.video_token_id
    kwargs = dict(
        input_ids=ids,
        pixel_values_videos=torch.from_numpy(inputs.pixel_values),
        video_grid_thw=torch.tensor([inputs.grid_thw]),
        mm_token_type_ids=(ids == video_id).to(torch.int32) * 2,
    )
    if model_type == "qwen2_5_vl":
        kwargs["second_per_grid_ts"] = torch.tensor([_sampled_spg(clip.metadata)], dtype=torch.float32)
    logits = hf_model(**kwargs).logits[0, -1].double()
    label_ids = [tokenizer.encode(label, add_special_tokens=False)[0] for label in config.option_labels]
    chosen = logits[label_ids[: len(request.options)]]
    return torch.log_softmax(chosen, dim=0).numpy()


def _parity_clip(make_clip, rng, media_id):
    """A clip whose temporal extent stays below its spatial one (see mrope.py: there transformers 5.23 and
    the reference rule agree), and whose temporal positions differ from plain 0, 1, 2, ... so that ignoring
    the clip's time scale (mlx-vlm's own get_rope_index does) would fail this test."""
    for _ in range(100):
        clip = make_clip(rng, media_id, num_frames=int(rng.integers(2, 7)))
        gt = math.ceil(len(clip.frames) / 2)
        interval = 2 * _sampled_spg(clip.metadata)
        steps_differ = any(int(np.float32(i) * np.float32(interval)) != i for i in range(gt))
        if steps_differ and int((gt - 1) * interval) <= 5:
            return clip
    raise AssertionError("could not draw a parity clip")


@pytest.mark.parametrize("name", ["qwen2_5_vl-gqa", "qwen2_5_vl-mha", "qwen2_vl-gqa", "qwen2_vl-mha"])
def test_packed_batch_matches_transformers(name, checkpoint_dir, tiny_classifier, rng, specs, parity_max_pixels,
                                           make_clip, make_request, check_choice):
    from transformers import AutoModelForImageTextToText

    clf = tiny_classifier(name, max_pixels=parity_max_pixels)
    clips = [_parity_clip(make_clip, rng, f"{name}-clip{i}") for i in range(5)]
    requests = [make_request(rng, f"r{i}", clips[i % len(clips)]) for i in range(10)]
    results = clf.classify(requests)
    assert all(r.error is None for r in results), [r.error for r in results]

    hf_model = AutoModelForImageTextToText.from_pretrained(checkpoint_dir(name), dtype=torch.float32).eval()
    tokenizer = clf.checkpoint.tokenizer
    worst = 0.0
    for request, result in zip(requests, results):
        expected = reference_logprobs(hf_model, tokenizer, clf.config, request.clip, request,
                                      clf.checkpoint.vision, specs[name].model_type)
        assert len(result.probs) == len(request.options)
        np.testing.assert_allclose(result.logprobs, expected, atol=1e-4, err_msg=f"{name} {request.request_id}")
        np.testing.assert_allclose(np.log(result.probs), expected, atol=1e-4)
        check_choice(result, expected, (name, request.request_id))
        worst = max(worst, float(np.abs(np.array(result.logprobs) - expected).max()))
    # The options must not be trivially uniform, or the comparison would say little about the model.
    spread = max(float(np.ptp(r.logprobs)) for r in results)
    assert spread > 1e-2, f"option log-probs nearly uniform (spread {spread}); the check would be weak"
    # Packing really happened: clips were shared, so later questions report cached tokens.
    assert any(r.cached_tokens > 0 for r in results)
    print(f"{name}: worst |dlogprob| = {worst:.2e}")
