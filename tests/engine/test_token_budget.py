"""`max_num_batched_tokens: auto`: the rule (a pure function of device, memory and model shape), its wiring into
the engine, and the job config / vLLM mapping."""

from __future__ import annotations

import types

import pytest

from batchjob.engine import token_budget
from batchjob.engine.token_budget import (CPU_TOKENS, GPU_MAX_TOKENS, GPU_MIN_TOKENS, activation_bytes_per_token,
                                          auto_batched_tokens, language_model_shape)

GiB = 2**30
QWEN25_7B = dict(hidden=3584, intermediate=18944, num_heads=28, num_kv_heads=4, head_dim=128)


LAG = 2   # runner.LAYER_LAG as shipped


def test_activation_bytes_follow_the_widest_layer_and_the_layers_in_flight():
    widths = 4 * 3584 + 36 * 128 + 3 * 18944
    for lag in range(5):
        per_token = activation_bytes_per_token(**QWEN25_7B, dtype_bytes=2, layer_lag=lag)
        live = token_budget.LIVE_BASE + token_budget.LIVE_PER_QUEUED_LAYER * lag
        assert per_token == int(live * widths * 2)
        assert abs(activation_bytes_per_token(**QWEN25_7B, dtype_bytes=4, layer_lag=lag) - 2 * per_token) <= 1
        more = activation_bytes_per_token(**QWEN25_7B, dtype_bytes=2, layer_lag=lag + 1)
        assert more > per_token   # every layer queued ahead keeps its activations alive
    assert token_budget.reused_bytes_per_token(**QWEN25_7B, dtype_bytes=2) == int(token_budget.LAYER_REUSE * widths * 2)


# Peak activation bytes per token of a paced forward measured on an H100 (Qwen3-VL-8B's decoder in bf16, equal and
# ragged batches; `scripts/diag_varied_forward.py --lag N`, benchmarks/results/README.md, twelfth session): the
# estimate must cover each of them, or the budget hands the KV pool memory a forward then needs.
QWEN3_8B = dict(hidden=4096, intermediate=12288, num_heads=32, num_kv_heads=8, head_dim=128)
MEASURED_PEAK_PER_TOKEN = {1: (417_500, 443_100), 2: (591_900, 626_000), 3: (767_300, 815_000)}


@pytest.mark.parametrize("lag", sorted(MEASURED_PEAK_PER_TOKEN))
def test_the_estimate_covers_the_measured_peaks(lag):
    estimate = activation_bytes_per_token(**QWEN3_8B, dtype_bytes=2, layer_lag=lag)
    for measured in MEASURED_PEAK_PER_TOKEN[lag]:
        assert measured <= estimate <= 1.25 * measured


# Qwen2.5-VL-7B at lag 2, measured the same way (the thirteenth session's diag_varied_forward, 34,384 equal and
# 13,112 ragged tokens): its wider MLP leaves the estimate above the peak by more than Qwen3's.
MEASURED_PEAK_PER_TOKEN_QWEN25 = {2: (602_100, 642_600)}


def test_the_estimate_covers_qwen25s_measured_peaks():
    estimate = activation_bytes_per_token(**QWEN25_7B, dtype_bytes=2, layer_lag=2)
    for measured in MEASURED_PEAK_PER_TOKEN_QWEN25[2]:
        assert measured <= estimate <= 1.5 * measured


@pytest.mark.parametrize("device", ["cpu"])
def test_cpu_and_unknown_memory_keep_8192(device):
    per_token = activation_bytes_per_token(**QWEN25_7B, dtype_bytes=4, layer_lag=LAG)
    assert auto_batched_tokens("cpu", memory_bytes=512 * GiB, weights_bytes=GiB, bytes_per_token=per_token) == 8192
    assert auto_batched_tokens("cuda", memory_bytes=None, weights_bytes=GiB, bytes_per_token=per_token) == CPU_TOKENS


def test_a_big_gpu_holds_a_batch_of_clips_in_one_forward():
    """H100 80 GB, 7B bf16 (15 GB of weights): 8 prompts of 2,135 tokens (17,080) are one forward."""
    per_token = activation_bytes_per_token(**QWEN25_7B, dtype_bytes=2, layer_lag=LAG)
    tokens = auto_batched_tokens("cuda", memory_bytes=80 * GiB, weights_bytes=15 * GiB, bytes_per_token=per_token)
    assert tokens == GPU_MAX_TOKENS >= 8 * 2135


@pytest.mark.parametrize("memory_gb,weights_gb", [(16, 15), (24, 15), (32, 15), (48, 15), (80, 70), (192, 140)])
def test_the_budget_is_bounded_by_activation_memory_and_aligned(memory_gb, weights_gb):
    per_token = activation_bytes_per_token(**QWEN25_7B, dtype_bytes=2, layer_lag=LAG)
    for block in (16, 32):
        tokens = auto_batched_tokens("metal", memory_bytes=memory_gb * GiB, weights_bytes=weights_gb * GiB,
                                     bytes_per_token=per_token, block_size=block)
        assert tokens % block == 0 and GPU_MIN_TOKENS <= tokens <= GPU_MAX_TOKENS
        fit = token_budget.ACTIVATION_SHARE * (memory_gb - weights_gb) * GiB / per_token
        assert tokens <= max(fit, GPU_MIN_TOKENS)   # never more activations than the share allows (above the floor)
    more = auto_batched_tokens("metal", memory_bytes=(memory_gb + 8) * GiB, weights_bytes=weights_gb * GiB,
                               bytes_per_token=per_token)
    assert more >= tokens   # more memory never shrinks the budget


def test_the_decoders_own_widths_drive_the_rule():
    """Qwen2.5-VL-7B's widths on an 80 GB GPU reach the cap; on 20 GB they do not; an MoE decoder's active
    experts (8 x 768) are narrower than a dense 18,944, so it packs more tokens."""
    args = types.SimpleNamespace(hidden_size=3584, intermediate_size=18944, num_attention_heads=28)
    lm = types.SimpleNamespace(args=args)

    def tokens(memory_gb):
        per_token = activation_bytes_per_token(**language_model_shape(lm, (4, 128)), dtype_bytes=2, layer_lag=LAG)
        return auto_batched_tokens("cuda", memory_bytes=memory_gb * GiB, weights_bytes=15 * GiB,
                                   bytes_per_token=per_token)
    assert tokens(80) == GPU_MAX_TOKENS
    small = tokens(20)
    assert small < GPU_MAX_TOKENS
    lm.args = types.SimpleNamespace(hidden_size=3584, intermediate_size=0, moe_intermediate_size=768,
                                    num_experts_per_tok=8, num_attention_heads=28)
    assert tokens(20) > small


def test_the_engine_reads_the_device_through_mlx_for_auto(tiny_classifier, monkeypatch):
    """`auto` on a GPU: the device's memory comes from `mx.device_info` (faked there), once, with the budget."""
    import mlx.core as mx

    from batchjob.engine import EngineConfig
    from batchjob.engine.classifier import plan_engine_memory

    calls = []
    monkeypatch.setattr(mx, "device_info", lambda d=None: calls.append(d) or {
        "device_name": "Fake GPU", "total_memory": 80 * GiB, "free_memory": 70 * GiB})
    ckpt = tiny_classifier().checkpoint
    monkeypatch.setattr(ckpt, "device", "cuda")
    plan, tokens = plan_engine_memory(ckpt, EngineConfig(), num_layers=2)
    assert len(calls) == 1 and tokens == GPU_MAX_TOKENS          # a tiny model: the cap
    assert plan.activation_bytes > 0 and plan.device.name == "Fake GPU"
    fixed, _ = plan_engine_memory(ckpt, EngineConfig(max_num_batched_tokens=512), num_layers=2)
    assert fixed.activation_bytes * GPU_MAX_TOKENS == plan.activation_bytes * 512


def test_a_budget_set_below_the_device_sizes_the_forwards(tiny_classifier, monkeypatch, rng):
    """`memory_budget_gb` lower than the GPU: `auto`'s tokens follow the budget, so the forward's activations fit
    in it beside the weights and the KV cache (sized from the whole device they would be refused)."""
    import mlx.core as mx

    from batchjob.engine import EngineConfig
    from batchjob.engine import classifier as classifier_module

    ckpt = tiny_classifier().checkpoint   # loaded before the fakes below (run alone, this test builds it)
    monkeypatch.setattr(mx, "device_info", lambda d=None: {
        "device_name": "Fake GPU", "total_memory": 80 * GiB, "free_memory": 78 * GiB})
    per_token = int(rng.integers(400_000, 900_000))   # a 7-8B decoder's paced forward, per token
    monkeypatch.setattr(classifier_module, "activation_bytes_per_token", lambda **_: per_token)
    features = int(rng.integers(7_000, 33_000))   # the next step's vision features per token (intake.py)
    monkeypatch.setattr(classifier_module, "lookahead_feature_bytes", lambda *_: features)
    monkeypatch.setattr(ckpt, "device", "cuda")
    whole, tokens = classifier_module.plan_engine_memory(ckpt, EngineConfig(max_model_len=4096), num_layers=2)
    assert tokens == GPU_MAX_TOKENS and whole.activation_bytes == tokens * (per_token + features)
    budget_gb = float(rng.uniform(4, 20))
    plan, budget_tokens = classifier_module.plan_engine_memory(
        ckpt, EngineConfig(max_model_len=4096, memory_budget_gb=budget_gb), num_layers=2)
    assert budget_tokens == auto_batched_tokens("cuda", memory_bytes=int(budget_gb * GiB),
                                                weights_bytes=ckpt.weights_bytes, bytes_per_token=per_token)
    assert budget_tokens < tokens and plan.activation_bytes == budget_tokens * (per_token + features)
    assert plan.weights_bytes + plan.activation_bytes + plan.kv_bytes <= plan.budget_bytes == int(budget_gb * GiB)


def test_engine_resolves_auto_and_honours_numbers(tiny_classifier, checkpoint_dir):
    from batchjob.engine import Classifier, EngineConfig, EngineError

    clf = tiny_classifier()
    assert clf.config.max_num_batched_tokens == "auto" and clf.max_num_batched_tokens == CPU_TOKENS
    fixed = Classifier.from_pretrained(checkpoint_dir("qwen2_5_vl-gqa"),
                                       EngineConfig(max_num_batched_tokens=300, memory_budget_gb=1.0))
    assert fixed.max_num_batched_tokens == 300
    for bad in (0, "Auto", "8192", 1.5):
        with pytest.raises(EngineError, match="max_num_batched_tokens must be 'auto' or an integer"):
            EngineConfig(max_num_batched_tokens=bad).validate()


def test_job_config_maps_auto_to_both_engines():
    from pydantic import ValidationError

    from batchjob.config import ModelConfig, PromptConfig
    from batchjob.pipeline.mlx_engine import engine_config
    from batchjob.pipeline.vllm_engine import llm_kwargs

    auto = ModelConfig(checkpoint="x")
    assert auto.max_num_batched_tokens == "auto"
    assert engine_config(auto, PromptConfig()).max_num_batched_tokens == "auto"
    assert "max_num_batched_tokens" not in llm_kwargs(ModelConfig(checkpoint="x", engine="vllm"))
    assert llm_kwargs(ModelConfig(checkpoint="x", engine="vllm", max_num_batched_tokens=4096))[
        "max_num_batched_tokens"] == 4096
    assert engine_config(ModelConfig(checkpoint="x", max_num_batched_tokens=4096), PromptConfig()) \
        .max_num_batched_tokens == 4096
    for bad in ("Auto", 8, "4096"):
        with pytest.raises(ValidationError):
            ModelConfig(checkpoint="x", max_num_batched_tokens=bad)
