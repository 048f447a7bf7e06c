"""Qwen3-VL and Qwen3-VL-MoE: prompts, option log-probs and positions against transformers 5.23 (fp32, CPU),
batch invariance of the packed/chunked/shared paths, and the keyframes' real times in the prompt.

The reference prompt is built by transformers' own `Qwen3VLProcessor.replace_video_token` (timestamps and
per-group vision tokens), placed in Qwen's original layout: the group text replaces the chat template's
`<|vision_start|><|video_pad|><|vision_end|>` (transformers 5.23 keeps that outer pair; vLLM and Qwen's
processor drop it). transformers computes its own M-RoPE positions (from `mm_token_type_ids`), DeepStack and
MoE routing. Pixel values are the engine's (its PIL preprocessing is checked against transformers' image
processor in test_preprocess.py; the Qwen3-VL video processor needs torchvision, absent here), and the
clip-level resize rule is checked against transformers' own function below.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import re
import shutil
import types
import uuid

import numpy as np
import pytest
import torch

from batchjob.engine import ClassifyRequest, Classifier, Clip, EngineConfig, EngineError
from batchjob.engine.preprocess import clip_smart_resize, group_timestamps, plan_video, preprocess_video

torch.set_grad_enabled(False)
QWEN3 = ["qwen3_vl", "qwen3_vl_moe"]
OUTER = "<|vision_start|><|video_pad|><|vision_end|>"
# Below this gap between the k-th and the (k+1)-th router probability of a token, fp32 rounding (the engine's and
# transformers' sums run in different orders) may send the token to another expert: the two models then compute
# different functions, and no tolerance on the outputs is meaningful. A request whose outputs differ is excused
# only where its reference routing came this close to a tie (random tiny MoE models differ so in about one run of
# the test in a thousand; a gap under 1e-5 came up in 1 of 12 runs measured, and its outputs still agreed).
ROUTE_TIE = 1e-4


@contextlib.contextmanager
def _route_margins(hf_model):
    """Collects, per forward, the smallest gap between the k-th and (k+1)-th router probability over every token
    and MoE layer of `hf_model` (none for a dense model): how close its routing came to a tie."""
    margins: list[float] = []

    def hook(module, args, output):
        probs = torch.softmax(output[0].double(), dim=-1).sort(dim=-1, descending=True).values
        gap = float((probs[:, module.top_k - 1] - probs[:, module.top_k]).min())
        margins[-1] = min(margins[-1], gap)

    def start(module, args):      # the first MoE layer: a new forward
        margins.append(float("inf"))

    routers = [m for m in hf_model.modules() if type(m).__name__.endswith("TopKRouter")]
    handles = [r.register_forward_hook(hook) for r in routers] + [
        r.register_forward_pre_hook(start) for r in routers[:1]]
    try:
        yield margins
    finally:
        for h in handles:
            h.remove()


def _processor_placeholder(grid_thw, metadata: dict) -> str:
    """transformers' Qwen3VLProcessor.replace_video_token on a stand-in `self` (its video processor needs
    torchvision; the placeholder text needs only merge and temporal patch sizes)."""
    from transformers.models.qwen3_vl.processing_qwen3_vl import Qwen3VLProcessor
    from transformers.video_utils import VideoMetadata

    proc = types.SimpleNamespace(video_processor=types.SimpleNamespace(merge_size=2, temporal_patch_size=2),
                                 vision_start_token="<|vision_start|>", vision_end_token="<|vision_end|>",
                                 video_token="<|video_pad|>")
    proc._calculate_timestamps = functools.partial(Qwen3VLProcessor._calculate_timestamps, proc)
    meta = VideoMetadata(total_num_frames=metadata["total_num_frames"], fps=metadata["fps"],
                         frames_indices=list(metadata["frames_indices"]))
    return Qwen3VLProcessor.replace_video_token(
        proc, {"video_grid_thw": torch.tensor([grid_thw]), "video_metadata": [meta]}, 0)


def _uniform_clip(rng, media_id: str, num_frames: int, size: tuple[int, int]) -> Clip:
    """Frames sampled as the processor samples them (linspace over the clip), with their real times."""
    fps = float(rng.choice([24.0, 25.0, 30.0]))
    total = int(rng.integers(max(num_frames, 40), 400))
    indices = np.linspace(0, total - 1, num_frames).round().astype(int).tolist()
    frames = rng.integers(0, 256, (num_frames, *size, 3), dtype=np.uint8)
    metadata = {"fps": fps, "total_num_frames": total, "frames_indices": indices, "duration": total / fps,
                "frames_timestamps": [i / fps for i in indices], "video_backend": "synthetic"}
    return Clip(frames=frames, metadata=metadata, media_id=media_id)


def _reference(hf_model, clf, request):
    """(prompt ids in Qwen's layout, option log-probs) from transformers' processor text and forward."""
    tok = clf.checkpoint.tokenizer
    inputs = preprocess_video(request.clip.frames, request.clip.metadata, clf.checkpoint.vision)
    rendered = clf.prompts.rendered(request.question, request.options)
    placeholder = _processor_placeholder(inputs.grid_thw, request.clip.metadata)
    ids = torch.tensor([tok.encode(rendered.replace(OUTER, placeholder), add_special_tokens=False)])
    # transformers' own layout differs only by the outer pair around the groups.
    hf_layout = tok.encode(rendered.replace("<|video_pad|>", placeholder), add_special_tokens=False)
    start, end = tok.convert_tokens_to_ids(["<|vision_start|>", "<|vision_end|>"])
    at = len(tok.encode(rendered[:rendered.index(OUTER)], add_special_tokens=False))
    assert hf_layout[at] == start
    stripped = hf_layout[:at] + hf_layout[at + 1:]
    double = next(i for i in range(len(stripped) - 1) if stripped[i] == stripped[i + 1] == end)
    assert stripped[:double] + stripped[double + 1:] == ids[0].tolist()
    video = hf_model.config.video_token_id
    logits = hf_model(input_ids=ids, pixel_values_videos=torch.from_numpy(inputs.pixel_values),
                      video_grid_thw=torch.tensor([inputs.grid_thw]),
                      mm_token_type_ids=(ids == video).to(torch.int32) * 2).logits[0, -1].double()
    chosen = logits[clf.prompts.option_token_ids(len(request.options))]
    return ids[0].numpy(), torch.log_softmax(chosen, dim=0).numpy()


@pytest.mark.parametrize("name", QWEN3)
def test_prompts_and_logprobs_match_transformers(name, checkpoint_dir, tiny_classifier, rng, make_request,
                                                 check_choice):
    from transformers import AutoModelForImageTextToText

    clf = tiny_classifier(name)
    # 1, 2, 3, 16, 17 frames (odd counts pad the last temporal group); sides not multiples of 28 or 32.
    shapes = [(1, (50, 70)), (2, (90, 131)), (3, (61, 97)), (16, (100, 150)), (17, (77, 111))]
    clips = [_uniform_clip(rng, f"{name}-{uuid.uuid4().hex}", n, (h + int(rng.integers(0, 9)), w))
             for n, (h, w) in shapes]
    requests = [make_request(rng, f"r{i}", clip, num_options=4 + i % 2) for i, clip in enumerate(clips)]
    requests.append(make_request(rng, "follower", clips[3], num_options=5))  # a second question: shared prefix
    results = clf.classify(requests)
    assert all(r.error is None for r in results), [r.error for r in results]
    assert results[-1].cached_tokens > 0

    hf_model = AutoModelForImageTextToText.from_pretrained(checkpoint_dir(name), dtype=torch.float32).eval()
    family, vision = clf.checkpoint.family, clf.checkpoint.vision
    worst, excused = 0.0, []
    for request, result in zip(requests, results):
        with _route_margins(hf_model) as margins:
            ids, expected = _reference(hf_model, clf, request)
        for rule in ("actual", "nominal"):  # uniform clip: real times are the nominal ones
            plan = plan_video(request.clip.frames.shape, request.clip.metadata,
                              dataclasses.replace(vision, timestamps=rule))
            ours = family.video_prompt(clf.prompts, request.question, request.options, plan).token_ids
            np.testing.assert_array_equal(ours, ids, err_msg=f"{name} {request.request_id} {rule}")
        assert result.prompt_tokens == len(ids)
        try:
            np.testing.assert_allclose(result.logprobs, expected, atol=1e-4, err_msg=f"{name} {request.request_id}")
            check_choice(result, expected, (name, request.request_id))
        except AssertionError:
            if min(margins, default=float("inf")) >= ROUTE_TIE:
                raise
            excused.append((request.request_id, min(margins)))   # a routing near-tie: they may rightly differ
            continue
        worst = max(worst, float(np.abs(np.array(result.logprobs) - expected).max()))
    spread = max(float(np.ptp(r.logprobs)) for r in results)
    assert spread > 1e-2, f"option log-probs nearly uniform (spread {spread}); the check would be weak"
    assert len(excused) <= 2, f"{name}: outputs differ at routing near-ties in {excused}: too many to be chance"
    print(f"{name}: worst |dlogprob| = {worst:.2e}; differing at a routing near-tie: {excused}")


def test_clip_budget_resize_matches_transformers(rng):
    from transformers.models.qwen3_vl.video_processing_qwen3_vl import smart_resize

    for _ in range(300):
        t = int(rng.integers(2, 40))
        h, w = int(rng.integers(20, 700)), int(rng.integers(20, 700))
        lo = int(rng.integers(1, 64)) * 32 * 32
        hi = lo + int(rng.integers(0, 4000)) * 32 * 32
        assert clip_smart_resize(t, h, w, 32, lo, hi) == smart_resize(t, h, w, factor=32, min_pixels=lo,
                                                                      max_pixels=hi), (t, h, w, lo, hi)
    # The budget bounds the whole clip: 16 frames get about a quarter of the pixels 4 frames get.
    few, many = clip_smart_resize(4, 480, 640, 32, 1024, 32 * 32 * 256), clip_smart_resize(16, 480, 640, 32, 1024,
                                                                                         32 * 32 * 256)
    assert few[0] * few[1] >= 3 * many[0] * many[1]


def test_nominal_timestamps_equal_the_processor(rng):
    from transformers.models.qwen3_vl.processing_qwen3_vl import Qwen3VLProcessor

    calc = functools.partial(Qwen3VLProcessor._calculate_timestamps, None)
    for _ in range(200):
        n = int(rng.integers(1, 40))
        indices = np.sort(rng.integers(0, 5000, n)).tolist()
        fps = float(rng.choice([23.976, 24.0, 25.0, 29.97, 30.0, 60.0]))
        meta = {"fps": fps, "frames_indices": indices,
                "frames_timestamps": (np.array(indices) / fps + rng.uniform(0, 3, n)).tolist()}
        assert group_timestamps(meta, n, 2, "nominal") == tuple(calc(list(indices), fps, 2))
        # actual: the same group rule over the frames' own times
        times = list(meta["frames_timestamps"]) + ([meta["frames_timestamps"][-1]] if n % 2 else [])
        expected = tuple((times[i] + times[i + 1]) / 2 for i in range(0, len(times), 2))
        assert group_timestamps(meta, n, 2, "actual") == expected


def _fresh(clip: Clip) -> Clip:
    return dataclasses.replace(clip, media_id=f"{clip.media_id}-{uuid.uuid4().hex[:8]}")


def _with_clip(request: ClassifyRequest, clip: Clip) -> ClassifyRequest:
    return dataclasses.replace(request, clip=clip)


def test_batch_invariance_chunks_and_sharing(tiny_classifier, rng, make_clip, make_request, check_choice):
    """Packed, alone, chunked (edges inside a timestamp and inside the video) and unshared all agree; the
    followers of a clip report the shared blocks as cached, and nothing beyond the common prefix."""
    from batchjob.engine.mrope import placeholder_runs

    clf = tiny_classifier("qwen3_vl")
    clip = _uniform_clip(rng, "inv", 6, (int(rng.integers(60, 120)), int(rng.integers(120, 200))))
    request = make_request(rng, "target", _fresh(clip))
    plan = plan_video(clip.frames.shape, clip.metadata, clf.checkpoint.vision)
    prompt = clf.checkpoint.family.video_prompt(clf.prompts, request.question, request.options, plan)
    runs = placeholder_runs(prompt.token_ids, clf.checkpoint.video_token_id)
    assert len(runs) == 3
    video_start = prompt.video_span[0]
    alone = clf.classify([request])[0]
    assert alone.error is None and alone.cached_tokens <= video_start

    others = [make_request(rng, f"o{i}", make_clip(rng, f"other-{uuid.uuid4().hex}")) for i in range(3)]
    packed = clf.classify(others[:1] + [_with_clip(request, _fresh(clip))] + others[1:])[1]
    assert packed.cached_tokens <= video_start

    # Second group's timestamp text lies between the first run's <|vision_end|> and the second's <|vision_start|>.
    stamp = range(runs[0][1] + 1, runs[1][0] - 1)
    assert len(stamp) >= 2
    # Text blocks before the video are the same for every clip (cached by the calls above): chunks start there.
    cached = video_start // clf.config.block_size * clf.config.block_size
    budgets = {"inside a timestamp": stamp[1] - cached, "inside the video": runs[0][0] + 3 - cached}
    chunked = {}
    saved = clf.config.max_num_batched_tokens
    try:
        for where, budget in budgets.items():
            clf.config.max_num_batched_tokens = budget
            chunked[where] = clf.classify([_with_clip(request, _fresh(clip))])[0]
            assert chunked[where].cached_tokens == cached  # so the first chunk edge falls where intended
    finally:
        clf.config.max_num_batched_tokens = saved
    unshared = tiny_classifier("qwen3_vl", enable_prefix_sharing=False).classify([_with_clip(request, _fresh(clip))])[0]
    assert unshared.cached_tokens == 0
    hit = clf.classify([request])[0]  # same media id as `alone`: its blocks are cached
    assert hit.cached_tokens > runs[-1][1] // clf.config.block_size * clf.config.block_size - 1 > video_start
    for other in (packed, *chunked.values(), unshared, hit):
        np.testing.assert_allclose(other.probs, alone.probs, rtol=0, atol=1e-5)
        check_choice(other, alone.logprobs)
        assert other.prompt_tokens == alone.prompt_tokens

    # Followers of one clip: one vision run, every full block of the common prefix reused, no more.
    clip2 = _uniform_clip(rng, f"share-{uuid.uuid4().hex}", 5, (96, 160))
    requests = [make_request(rng, f"q{i}", clip2) for i in range(3)]
    before = clf.vision_calls
    results = clf.classify(requests)
    assert clf.vision_calls - before == 1
    plan2 = plan_video(clip2.frames.shape, clip2.metadata, clf.checkpoint.vision)
    prompts = [clf.checkpoint.family.video_prompt(clf.prompts, r.question, r.options, plan2) for r in requests]
    block = clf.config.block_size
    assert results[0].cached_tokens <= prompts[0].video_span[0]
    for p, r in zip(prompts[1:], results[1:]):
        a, b = p.token_ids, prompts[0].token_ids
        common = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        assert common >= p.video_span[1]
        assert r.cached_tokens == min(common, len(a) - 1) // block * block
    # A later call about the same clip needs no vision run (the last partial block's rows were kept).
    before = clf.vision_calls
    again = clf.classify([requests[1]])[0]
    assert clf.vision_calls == before and again.cached_tokens >= prompts[1].video_span[1] // block * block
    np.testing.assert_allclose(again.probs, results[1].probs, rtol=0, atol=1e-5)


def test_prepared_inputs_answer_like_frames(tiny_classifier, checkpoint_dir, rng, make_request):
    """The pipeline's decoder-side preparation (clip budget, patch 16) gives the frames' answers."""
    from pathlib import Path

    from batchjob.config import ModelConfig
    from batchjob.contract import ClipMetadata
    from batchjob.pipeline.mlx_engine import MlxEngine

    clf = tiny_classifier("qwen3_vl_moe")
    preparer = MlxEngine.input_preparer(ModelConfig(checkpoint=checkpoint_dir("qwen3_vl_moe")))
    assert preparer.settings == clf.checkpoint.vision and preparer.settings.pixel_budget == "clip"
    assert Path(checkpoint_dir("qwen3_vl_moe")).is_dir()
    clip = _uniform_clip(rng, f"prep-{uuid.uuid4().hex}", 5, (70, 90))
    request = make_request(rng, "p", clip)
    from_frames = clf.classify([request])[0]
    prepared = Clip(None, clip.metadata, f"prep-{uuid.uuid4().hex}", inputs=preparer(clip.frames, ClipMetadata.from_loader(clip.metadata)))
    from_inputs = clf.classify([_with_clip(request, prepared)])[0]
    assert from_inputs.error is None and from_inputs.prompt_tokens == from_frames.prompt_tokens
    np.testing.assert_allclose(from_inputs.probs, from_frames.probs, rtol=0, atol=1e-6)


def test_keyframe_clip_carries_real_times(tiny_classifier, tmp_path):
    """Irregularly timed keyframes (variable frame rate): the loader's `frames_timestamps` are the frames' real
    presentation times (checked against a full decode), the prompt writes each group's real time, and those
    differ from what transformers derives from indices and the average fps."""
    import av

    from batchjob.loaders import load_video
    from batchjob.synthetic.clips import make_clip as encode_clip

    info = encode_clip(tmp_path / "vfr.mp4", seconds=4, fps=10, gop_seconds=0.5, bframes=2, vfr=True, seed=7)
    frames, meta = load_video(info.path, backend="pyav_keyframes", num_frames=6)
    with av.open(info.path) as container:
        times = sorted(float(f.time) for f in container.decode(video=0))
    real = [times[i] for i in meta["frames_indices"]]
    np.testing.assert_allclose(meta["frames_timestamps"], real, rtol=0, atol=1e-9)

    clf = tiny_classifier("qwen3_vl")
    request = ClassifyRequest("k", Clip(frames, meta, "vfr"), "What happens?", ("a", "b", "c", "d"))
    stamps = {}
    for rule in ("actual", "nominal"):
        plan = plan_video(frames.shape, meta, dataclasses.replace(clf.checkpoint.vision, timestamps=rule))
        ids = clf.checkpoint.family.video_prompt(clf.prompts, request.question, request.options, plan).token_ids
        stamps[rule] = re.findall(r"<([0-9.]+) seconds>", clf.checkpoint.tokenizer.decode(ids))
    expected = [f"{(real[i] + real[min(i + 1, len(real) - 1)]) / 2:.1f}" for i in range(0, len(real), 2)]
    assert stamps["actual"] == expected
    nominal = [i / meta["fps"] for i in meta["frames_indices"]]
    assert stamps["nominal"] == [f"{(nominal[i] + nominal[i + 1]) / 2:.1f}" for i in range(0, len(real), 2)]
    assert stamps["actual"] != stamps["nominal"], "the clip's times should not be its nominal ones"
    result = clf.classify([request])[0]
    assert result.error is None


def test_unsupported_and_misread_configs_fail_at_start(checkpoint_dir, tmp_path):
    path = tmp_path / "ckpt"
    shutil.copytree(checkpoint_dir("qwen3_vl"), path)
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "model_type": "qwen3_5"}))
    with pytest.raises(EngineError, match="qwen3_5.*not supported yet.*recurrent state.*qwen3_vl"):
        Classifier.from_pretrained(path)
    (path / "config.json").write_text(json.dumps({**config, "model_type": "gemma3"}))
    with pytest.raises(EngineError, match="'gemma3' is not supported.*qwen2_5_vl.*qwen3_vl_moe"):
        Classifier.from_pretrained(path)
    # transformers 5's save_pretrained writes rope_parameters, which mlx-vlm would silently ignore.
    text = {k: v for k, v in config["text_config"].items() if k not in ("rope_scaling", "rope_theta")}
    text["rope_parameters"] = {**config["text_config"]["rope_scaling"], "rope_theta": 5e6}
    (path / "config.json").write_text(json.dumps({**config, "text_config": text}))
    with pytest.raises(EngineError, match="mrope_section"):
        Classifier.from_pretrained(path, EngineConfig(memory_budget_gb=1.0))


def test_positions_equal_transformers_get_rope_index(rng):
    """Interleaved groups (timestamp text, vision_start, rows x cols tokens, vision_end), random sizes: the
    engine's positions equal transformers' Qwen3-VL get_rope_index exactly."""
    from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLModel

    from batchjob.engine.families.qwen3 import qwen3_positions

    video, start, end = 7, 5, 6
    stand_in = types.SimpleNamespace(config=types.SimpleNamespace(vision_config=types.SimpleNamespace(
        spatial_merge_size=2)))
    stand_in.get_vision_position_ids = functools.partial(Qwen3VLModel.get_vision_position_ids, stand_in)
    for _ in range(20):
        groups, rows, cols = int(rng.integers(1, 6)), int(rng.integers(1, 5)), int(rng.integers(1, 5))
        ids = list(rng.integers(10, 50, int(rng.integers(0, 6))))
        for _ in range(groups):
            ids += list(rng.integers(10, 50, int(rng.integers(1, 5)))) + [start] + [video] * rows * cols + [end]
        ids += list(rng.integers(10, 50, int(rng.integers(1, 8))))
        ids = torch.tensor([ids])
        expected, _ = Qwen3VLModel.get_rope_index(
            stand_in, ids, (ids == video).to(torch.int32) * 2,
            video_grid_thw=torch.tensor([[groups, 2 * rows, 2 * cols]]))
        np.testing.assert_array_equal(qwen3_positions(ids[0].numpy(), video, rows, cols), expected[:, 0].numpy())
