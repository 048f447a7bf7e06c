"""Quantized checkpoints as Apple users get them (mlx-community's 4-bit / 8-bit uploads, made by mlx-vlm's converter).

Each tiny random checkpoint is quantized here by mlx-vlm's own converter (`mlx_vlm.convert.convert`, what
`python -m mlx_vlm.convert --quantize --q-bits 4|8` runs; group size 64, bf16 like the hub's checkpoints), then
loaded by the engine and compared with mlx-vlm's own forward on the same quantized weights and the same inputs:
the engine's prompt, pixel values and M-RoPE positions (mlx-vlm's own positions ignore Qwen2.5-VL's time scale,
see PLATFORM.md). mlx-vlm's Qwen3-VL-MoE GELU swap is corrected in the reference (see families/qwen3.py),
nothing else. Besides option log-probs, the whole vocabulary's last-position logits are compared.

The tiny dims are chosen so the converter quantizes what it quantizes in the real models: every language-model
width is a multiple of 64 (hidden 128, MLP 256, experts 192, vocabulary 512), while the vision MLP width (160) is
not, like the real towers' 3420 / 4304. The default converter leaves the vision tower alone; older converters
quantized it too (only the layers whose input width is a multiple of 64), which the `vision` cases reproduce.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx.utils import tree_flatten

from batchjob.engine import Classifier, EngineConfig
from batchjob.engine.footprint import Quantization, stored_tensors, text_settings, weights_bytes
from batchjob.engine.preprocess import plan_video, preprocess_video
from batchjob.synthetic.tiny_model import TinyModelSpec, write_tiny_checkpoint

TOLERANCE = 1e-4  # fp32, as the unquantized parity tests (test_parity.py, test_qwen3.py)
BF16_TOLERANCE = 3e-2  # bf16, as the attention tests' bf16 bound (tests/metal_backend/test_attention.py)

_VISION = dict(vision_depth=2, vision_hidden=64, vision_heads=2, vision_intermediate=160)
SPECS = {
    "qwen2_5_vl": TinyModelSpec(model_type="qwen2_5_vl", hidden_size=128, num_layers=2, num_heads=4, num_kv_heads=2,
                                intermediate_size=256, seed=21, **_VISION),
    # heads x head_dim (64) != hidden (128), as in the 4B and 30B-A3B; tied embeddings, as in the 2B and 4B
    "qwen3_vl": TinyModelSpec(model_type="qwen3_vl", hidden_size=128, num_layers=2, num_heads=2, num_kv_heads=1,
                              head_dim=32, intermediate_size=256, tie_word_embeddings=True, seed=22, **_VISION),
    "qwen3_vl_moe": TinyModelSpec(model_type="qwen3_vl_moe", hidden_size=128, num_layers=2, num_heads=4,
                                  num_kv_heads=2, intermediate_size=256, num_experts=4, num_experts_per_tok=2,
                                  moe_intermediate_size=192, seed=23, **_VISION),
}
CASES = [(family, bits, vision) for family in SPECS for bits in (4, 8) for vision in (False, True)]
IDS = [f"{family}-{bits}bit{'-vision' if vision else ''}" for family, bits, vision in CASES]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """`get(family, bits=None, vision=False)`: the tiny fp32 source checkpoint (bits None) or its conversion."""
    from mlx_vlm.convert import convert

    root = tmp_path_factory.mktemp("quantized")

    @functools.cache
    def get(family: str, bits: int | None = None, vision: bool = False) -> Path:
        if bits is None:
            return write_tiny_checkpoint(root / family, SPECS[family])
        out = root / f"{family}-q{bits}{'-vision' if vision else ''}"
        # quant_predicate=None: the converter's default (language model only); a predicate that accepts every
        # layer makes it quantize the tower too, as converters before mlx-vlm's `skip_vision` did.
        convert(str(get(family)), mlx_path=str(out), quantize=True, q_bits=bits, q_group_size=64,
                dtype="bfloat16", quant_predicate=(lambda path, module: True) if vision else None)
        return out

    return get


def _quantized_modules(model) -> dict[str, int]:
    return {name: module.bits for name, module in model.named_modules() if hasattr(module, "bits")}


def _mlx_vlm_reference(path: Path, dtype):
    """mlx-vlm's own model on the same files, in the engine's dtype (the files are bf16: fp32 is exact)."""
    from mlx_vlm.utils import load_model

    model = load_model(path)
    model.set_dtype(dtype)
    if json.loads((path / "config.json").read_text())["model_type"] == "qwen3_vl_moe":
        tower = model.vision_tower  # mlx-vlm 0.7.10 swaps the tower's two GELUs (families/qwen3.py)
        for block in tower.blocks:
            block.mlp.act_fn = nn.GELU(approx="tanh")
        for merger in [tower.merger, *tower.deepstack_merger_list]:
            merger.act_fn = nn.GELU()
    return model


def _reference_logits(model, clf, request) -> np.ndarray:
    """Last-position logits of mlx-vlm's forward: its vision tower and feature merge, its decoder, the
    engine's token ids and M-RoPE positions."""
    ckpt = clf.checkpoint
    plan = plan_video(request.clip.frames.shape, request.clip.metadata, ckpt.vision)
    prompt = ckpt.family.video_prompt(clf.prompts, request.question, request.options, plan)
    inputs = preprocess_video(request.clip.frames, request.clip.metadata, ckpt.vision)
    ids, grid, pixels = mx.array(prompt.token_ids[None]), mx.array([inputs.grid_thw]), mx.array(inputs.pixel_values)
    if ckpt.model_type.startswith("qwen3"):
        features = model.get_input_embeddings(ids, None, pixel_values_videos=pixels, video_grid_thw=grid)
        deepstack = dict(visual_pos_masks=features.visual_pos_masks,
                         deepstack_visual_embeds=features.deepstack_visual_embeds)
    else:
        features, deepstack = model.get_input_embeddings(ids, pixels, video_grid_thw=grid), {}
    out = model.language_model(ids, inputs_embeds=features.inputs_embeds,
                               position_ids=mx.array(prompt.positions[:, None, :]), **deepstack)
    return np.array(out.logits[0, -1].astype(mx.float32)).astype(np.float64)


def _classify_with_logits(clf, requests, monkeypatch) -> tuple[list, dict[int, np.ndarray]]:
    """The engine's results, plus each request's last-position logits over the whole vocabulary: the runner is
    asked for every vocabulary column after the option columns (the results read only the options)."""
    from batchjob.engine import classifier, runner

    vocab = text_settings(clf.checkpoint.hf_config)["vocab_size"]
    width = max(len(r.options) for r in requests) + vocab

    def columns(option_ids):
        rows = [list(ids) + list(range(vocab)) for ids in option_ids]
        return np.array([row + [row[0]] * (width - len(row)) for row in rows], dtype=np.int32)

    logits, forward = {}, classifier.forward

    def spy(model, batch, *args, **kwargs):
        out = forward(model, batch, *args, **kwargs)
        for row, slot in enumerate(out.finished_slices):
            seq = batch[slot].seq
            logits[seq.index] = out.logits[row, len(seq.option_token_ids):len(seq.option_token_ids) + vocab]
        return out

    monkeypatch.setattr(runner, "option_columns", columns)
    monkeypatch.setattr(classifier, "forward", spy)
    return clf.classify(requests), logits


def _log_softmax(x: np.ndarray) -> np.ndarray:
    shifted = x - x.max()
    return shifted - np.log(np.exp(shifted).sum())


def _assert_runs_the_stored_layers(clf, path: Path, bits: int, vision: bool) -> None:
    """The language model quantized at `bits`, the tower only in the vision cases (the layers whose input width
    the group divides), packed weights and quantization parameters as in the files (cast to the engine's dtype:
    exact from bf16), the weights counted as the footprint formula says."""
    quantized = _quantized_modules(clf.checkpoint.model)
    assert set(quantized.values()) == {bits}
    assert any(name.startswith("language_model.model.layers.1.mlp") for name in quantized)
    tower = {name for name in quantized if name.startswith("vision_tower.")}
    assert bool(tower) == vision and not any(name.endswith((".mlp.down_proj", ".mlp.linear_fc2")) for name in tower)
    # (the paged-attention wrapper holds mlx-vlm's attention module as `.inner`)
    engine_params = {k.replace(".self_attn.inner.", ".self_attn."): v
                     for k, v in tree_flatten(clf.checkpoint.model.parameters())}
    for name, value in mx.load(str(path / "model.safetensors")).items():
        if value.dtype == mx.uint32 or name.endswith((".scales", ".biases")):
            ours = engine_params[name]
            assert ours.dtype == (value.dtype if value.dtype == mx.uint32 else clf.checkpoint.dtype), name
            assert mx.array_equal(ours, value.astype(ours.dtype)).item(), name
    itemsize = mx.zeros((), clf.checkpoint.dtype).itemsize
    assert clf.checkpoint.weights_bytes == weights_bytes(json.loads((path / "config.json").read_text()),
                                                         Quantization(bits, vision=vision), itemsize, engine=True)


def _compare_with_mlx_vlm(clf, reference, requests, monkeypatch, tolerance: float, check_choice):
    """Engine results vs mlx-vlm's forward per request: whole-vocabulary logits and option log-probs within
    `tolerance`, the same choice. Returns (results, max |d logprob|, max |d logit|)."""
    results, logits = _classify_with_logits(clf, requests, monkeypatch)
    assert all(r.error is None for r in results), [r.error for r in results]
    assert any(r.cached_tokens > 0 for r in results)
    worst_logprob = worst_logit = 0.0
    for i, (request, result) in enumerate(zip(requests, results)):
        expected = _reference_logits(reference, clf, request)
        np.testing.assert_allclose(logits[i], expected, rtol=0, atol=tolerance, err_msg=f"r{i}")
        option_logprobs = _log_softmax(expected[clf.prompts.option_token_ids(len(request.options))])
        np.testing.assert_allclose(result.logprobs, option_logprobs, rtol=0, atol=tolerance, err_msg=f"r{i}")
        check_choice(result, option_logprobs, f"r{i}")
        worst_logprob = max(worst_logprob, float(np.abs(np.array(result.logprobs) - option_logprobs).max()))
        worst_logit = max(worst_logit, float(np.abs(logits[i] - expected).max()))
    spread = max(float(np.ptp(r.logprobs)) for r in results)
    assert spread > 1e-2, f"option log-probs nearly uniform (spread {spread}); the check would be weak"
    return results, worst_logprob, worst_logit


def _requests(rng, make_clip, make_request, name: str):
    clips = [make_clip(rng, f"{name}-clip{i}") for i in range(3)]
    return [make_request(rng, f"r{i}", clips[i % 3]) for i in range(5)]  # two clips asked twice: sharing


@pytest.mark.parametrize("family,bits,vision", CASES, ids=IDS)
def test_engine_matches_mlx_vlm_on_the_same_quantized_weights(family, bits, vision, checkpoints, rng, make_clip,
                                                               make_request, monkeypatch, check_choice):
    path = checkpoints(family, bits, vision)
    config = EngineConfig(max_model_len=4096, memory_budget_gb=1.0)   # float32 on this CPU
    clf = Classifier.from_pretrained(path, config)
    _assert_runs_the_stored_layers(clf, path, bits, vision)
    requests = _requests(rng, make_clip, make_request, path.name)
    results, worst_logprob, worst_logit = _compare_with_mlx_vlm(clf, _mlx_vlm_reference(path, mx.float32), requests,
                                                                monkeypatch, TOLERANCE, check_choice)

    # The quantization is visible: the unquantized source checkpoint answers measurably differently, so a
    # quantized checkpoint silently loaded as something else could not pass the comparison above.
    source = Classifier.from_pretrained(checkpoints(family), config).classify(requests)
    moved = max(float(np.abs(np.array(a.logprobs) - np.array(b.logprobs)).max()) for a, b in zip(source, results))
    assert moved > 20 * TOLERANCE, f"quantization moved option log-probs by only {moved}"
    print(f"{family} {bits}-bit{' +vision' if vision else ''} fp32: max |dlogprob| {worst_logprob:.1e}, "
          f"max |dlogit| {worst_logit:.1e}, vs unquantized {moved:.2f}")


@pytest.mark.parametrize("family", SPECS)
def test_in_bf16_the_gpu_dtype(family, checkpoints, rng, make_clip, make_request, monkeypatch):
    """As on Apple and NVIDIA GPUs: bf16 activations, scales and biases kept as stored. bf16 rounds differently in
    any two implementations (the engine fuses q/k/v and the rotary step), so the bar is mlx-vlm's own bf16 error:
    against mlx-vlm in fp32 on the same files, the engine's bf16 logits are no further off than twice mlx-vlm's
    bf16 forward is (plus a floor of a few bf16 steps)."""
    path = checkpoints(family, 4)
    clf = Classifier.from_pretrained(path, EngineConfig(max_model_len=4096, memory_budget_gb=1.0, dtype="bfloat16"))
    _assert_runs_the_stored_layers(clf, path, 4, False)
    requests = _requests(rng, make_clip, make_request, f"{path.name}-bf16")
    results, logits = _classify_with_logits(clf, requests, monkeypatch)
    assert all(r.error is None for r in results) and any(r.cached_tokens > 0 for r in results)
    exact, bf16 = _mlx_vlm_reference(path, mx.float32), _mlx_vlm_reference(path, mx.bfloat16)
    engine_errs, mlx_vlm_errs = [], []
    for i, request in enumerate(requests):
        want = _reference_logits(exact, clf, request)
        engine_errs.append(float(np.abs(logits[i] - want).max()))
        mlx_vlm_errs.append(float(np.abs(_reference_logits(bf16, clf, request) - want).max()))
    engine_err, mlx_vlm_err = max(engine_errs), max(mlx_vlm_errs)
    print(f"{family} 4-bit bf16 vs fp32: engine {engine_err:.3f} (median {np.median(engine_errs):.3f}), "
          f"mlx-vlm {mlx_vlm_err:.3f} (median {np.median(mlx_vlm_errs):.3f})")
    assert mlx_vlm_err > 0
    if "moe" in family:
        # A router choice near a tie flips under bf16 in any implementation, in each at other tokens: the worst
        # request measures which routes flipped, not the arithmetic. The typical request is held to the bar.
        assert np.median(engine_errs) <= 2 * np.median(mlx_vlm_errs) + 0.05, (engine_errs, mlx_vlm_errs)
    else:
        assert engine_err <= 2 * mlx_vlm_err + 0.05, (engine_err, mlx_vlm_err)


@pytest.mark.parametrize("family,bits,vision", CASES, ids=IDS)
def test_the_footprint_formula_gives_the_converted_files(family, bits, vision, checkpoints):
    """Every tensor the converter wrote, byte for byte, as footprint.stored_tensors predicts it from the config."""
    from safetensors import safe_open

    path = checkpoints(family, bits, vision)
    itemsize = {"BF16": 2, "F16": 2, "F32": 4, "U32": 4}
    with safe_open(str(path / "model.safetensors"), "np") as f:
        actual = {name: int(np.prod(f.get_slice(name).get_shape())) * itemsize[f.get_slice(name).get_dtype()]
                  for name in f.keys()}
    predicted = stored_tensors(json.loads((path / "config.json").read_text()), Quantization(bits, vision=vision),
                               dtype_bytes=2)
    assert predicted == actual
