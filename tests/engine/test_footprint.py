"""footprint.py (weights and KV cache from a config alone) and the README's memory table built on it.

References: mlx-vlm's own models built from the published configs (lazily: shapes only, nothing materialized)
and quantized by mlx-vlm's own `quantize_model` with its converter's default predicate; the parameter counts the
hub's model pages list; the engine's own KV cache and weight count on tiny checkpoints; the engine's start-up
budget rule. The byte-exact check against files a real conversion wrote is in test_quantized.py.
"""

from __future__ import annotations

import copy
import importlib.util
import json
import sys
from pathlib import Path

import pytest
from mlx.utils import tree_flatten

from batchjob.engine.footprint import (Quantization, checkpoint_tensors, kv_bytes_per_token, kv_layout,
                                       parameter_counts, stored_tensors, weights_bytes)
from batchjob.engine.published_configs import PUBLISHED_CONFIGS
from batchjob.engine import memory_budget as mb
from batchjob.engine import token_budget
from batchjob.metal_backend.memory import kv_bytes_per_block

ROOT = Path(__file__).resolve().parents[2]

# "Model size" on each model's hub page (three significant digits).
HUB_PARAMETERS = {
    "Qwen/Qwen2.5-VL-3B-Instruct": 3.75e9, "Qwen/Qwen2.5-VL-7B-Instruct": 8.29e9,
    "Qwen/Qwen2.5-VL-32B-Instruct": 33.5e9, "Qwen/Qwen2.5-VL-72B-Instruct": 73.4e9,
    "Qwen/Qwen3-VL-2B-Instruct": 2.13e9, "Qwen/Qwen3-VL-4B-Instruct": 4.44e9, "Qwen/Qwen3-VL-8B-Instruct": 8.77e9,
    "Qwen/Qwen3-VL-32B-Instruct": 33.4e9, "Qwen/Qwen3-VL-30B-A3B-Instruct": 31.1e9,
}


def _memory_table():
    spec = importlib.util.spec_from_file_location("memory_table", ROOT / "scripts" / "memory_table.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module   # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def _lazy_mlx_vlm_model(config: dict):
    """mlx-vlm's model for `config`; its random initial weights stay unevaluated (72B costs nothing)."""
    from mlx_vlm.utils import get_model_and_args, update_module_configs

    config = copy.deepcopy(config)
    runtime = {"rms_norm_eps": 1e-6, "rope_theta": 1e6, "max_position_embeddings": 32768, "hidden_act": "silu"}
    if "text_config" in config:   # settings that do not change any shape
        config["text_config"] = {**runtime, **config["text_config"]}
    else:
        config = {**runtime, **config}
    model_class, _ = get_model_and_args(config=config)
    config.setdefault("text_config", {})
    model_config = update_module_configs(model_class.ModelConfig.from_dict(config), model_class, config,
                                         ["text", "vision"])
    return model_class.Model(model_config)


@pytest.mark.parametrize("name", sorted(PUBLISHED_CONFIGS))
def test_tensors_and_quantized_bytes_equal_mlx_vlms_model(name):
    import mlx.core as mx
    from mlx_vlm.quant_utils import quantize_model
    from mlx_vlm.utils import skip_multimodal_module

    config = PUBLISHED_CONFIGS[name]
    model = _lazy_mlx_vlm_model(config)
    assert {k: tuple(v.shape) for k, v in tree_flatten(model.parameters())} == \
        {spec.name: spec.shape for spec in checkpoint_tensors(config)}

    # The converter's default: quantize everything quantize_model accepts outside the vision tower.
    model.set_dtype(mx.bfloat16)
    quantize_model(model, copy.deepcopy(config), 64, 4,
                   quant_predicate=lambda path, module: not skip_multimodal_module(path))
    assert {k: v.nbytes for k, v in tree_flatten(model.parameters())} == stored_tensors(config, Quantization(4), 2)


@pytest.mark.parametrize("name", sorted(PUBLISHED_CONFIGS))
def test_parameter_counts_match_the_hub(name):
    language, vision = parameter_counts(PUBLISHED_CONFIGS[name])
    assert float(f"{language + vision:.3g}") == HUB_PARAMETERS[name]
    assert 0.4e9 < vision < 0.72e9  # the towers: 24 x 1024 (Qwen3-VL 2B/4B) to 32 x 1280 (Qwen2.5-VL)


def test_quantized_weights_are_packed_bits_plus_two_bf16_per_group():
    config = PUBLISHED_CONFIGS["Qwen/Qwen2.5-VL-7B-Instruct"]
    language, vision = parameter_counts(config)
    bf16, q8, q4 = (weights_bytes(config, q) for q in (None, Quantization(8), Quantization(4)))
    assert bf16 == 2 * (language + vision)
    # Everything in the language model but norms and biases is quantized; the tower stays bf16.
    unquantized = sum(s.size for s in checkpoint_tensors(config) if s.vision or s.module == "other")
    for bits, total in ((8, q8), (4, q4)):
        assert total == 2 * unquantized + (language + vision - unquantized) * (bits / 8 + 4 / 64)


@pytest.mark.parametrize("name", ["qwen2_5_vl-gqa", "qwen3_vl", "qwen3_vl_moe"])
def test_kv_per_token_and_weights_are_the_engines(name, tiny_classifier):
    """The engine's KV cache per slot and its weight count (fp32 on this CPU, vision MLPs padded at load)."""
    clf = tiny_classifier(name)
    cache = clf.kv_cache
    slots = cache.k[0].shape[0] * cache.k[0].shape[1]
    assert (len(cache.k), *cache.k[0].shape[2:]) == kv_layout(clf.checkpoint.hf_config)
    cache_bytes = sum(k.nbytes + v.nbytes for k, v in zip(cache.k, cache.v))
    assert cache_bytes == slots * kv_bytes_per_token(clf.checkpoint.hf_config, dtype_bytes=4)
    assert clf.checkpoint.weights_bytes == weights_bytes(clf.checkpoint.hf_config, None, 4, engine=True)
    assert weights_bytes(clf.checkpoint.hf_config, None, 4) < clf.checkpoint.weights_bytes  # padding happened


def test_minimum_budget_is_the_engines_start_rule(rng):
    """The table's minimum passes the engine's start-up check, so does every larger budget, and a budget a little
    smaller (more than one 16-token step of `auto`'s activations) is refused."""
    table = _memory_table()
    for name, config in PUBLISHED_CONFIGS.items():
        weights = weights_bytes(config, Quantization(int(rng.choice([4, 8]))), engine=True)
        max_model_len = int(rng.integers(16, 65536))
        need = table.minimum_budget_bytes(config, weights, max_model_len)
        layers, kv_heads, head_dim = kv_layout(config)
        per_block = kv_bytes_per_block(num_layers=layers, num_kv_heads=kv_heads, head_dim=head_dim, dtype_bytes=2,
                                       block_size=16)
        blocks = -(-max_model_len // 16)
        device = mb.DeviceMemory("cuda", "big", 2**50, None, "test")

        def plan(budget_bytes: int):
            return mb.plan_memory(device=device, requested_gb=budget_bytes / 2**30, weights_bytes=weights,
                                  activation=table.forward_activations(config, budget_bytes, weights),
                                  kv_block_bytes=per_block, block_size=16, blocks_per_request=blocks, max_blocks=10**9)
        for budget in [need, *(need + rng.integers(1, 64 * 2**30, 8))]:
            assert plan(int(budget)).kv_blocks >= blocks, name
        step = 16 * table._per_token(config, 2)   # auto's tokens come in multiples of 16
        with pytest.raises(mb.MemoryBudgetError):
            plan(need - int(step / (1 - token_budget.ACTIVATION_SHARE)) - 2)
        assert table.prompt_tokens(config) <= table.SHORT_CONTEXT


def test_readme_table_is_current():
    """README.md shows what scripts/memory_table.py prints (regenerate with `--readme`)."""
    table = _memory_table()
    readme = (ROOT / "README.md").read_text()
    assert table.replace_in_readme(readme, table.table()) == readme, \
        "README.md's memory table is stale: run python scripts/memory_table.py --readme"


def test_unsupported_model_types_are_named():
    with pytest.raises(ValueError, match="qwen2_vl.*qwen2_5_vl, qwen3_vl, qwen3_vl_moe"):
        weights_bytes({"model_type": "qwen2_vl", "hidden_size": 64})
    with pytest.raises(ValueError, match="no <!-- memory-table:start -->"):
        _memory_table().replace_in_readme("# no table here", "| a |")


def test_published_configs_are_hub_layouts(tmp_path):
    """The shapes load as checkpoints do: flat Qwen2.5-VL configs, nested Qwen3-VL configs (the engine's checks)."""
    from batchjob.engine.families import family_for

    for name, config in PUBLISHED_CONFIGS.items():
        (tmp_path / "config.json").write_text(json.dumps(config))
        assert config["model_type"] in family_for(config, tmp_path).model_types, name


def test_moe_dense_layers_follow_mlx_vlm():
    """`mlp_only_layers` and `decoder_sparse_step` (none of the published MoE configs uses them) pick dense layers."""
    config = copy.deepcopy(PUBLISHED_CONFIGS["Qwen/Qwen3-VL-30B-A3B-Instruct"])
    config["text_config"].update(num_hidden_layers=6, mlp_only_layers=[0], decoder_sparse_step=2)
    model = _lazy_mlx_vlm_model(config)
    assert {k: tuple(v.shape) for k, v in tree_flatten(model.parameters())} == \
        {spec.name: spec.shape for spec in checkpoint_tensors(config)}
    experts = {s.name.split(".")[3] for s in checkpoint_tensors(config) if s.module == "experts"}
    assert experts == {"1", "3", "5"}


@pytest.mark.parametrize("tiny,model", [("qwen2_5_vl-gqa", "Qwen/Qwen2.5-VL-7B-Instruct"),
                                        ("qwen3_vl", "Qwen/Qwen3-VL-8B-Instruct")])
def test_the_table_bounds_any_16_frame_clip(tiny, model, checkpoint_dir, rng):
    """The engine's own plan for 16 frames of any size, at the shipped config's max_pixels, stays within the
    table's video tokens (the tiny checkpoints share the real processors' patch, merge and temporal sizes)."""
    import yaml

    from batchjob.engine.preprocess import load_vision_settings, plan_video

    table = _memory_table()
    config = PUBLISHED_CONFIGS[model]
    family = "qwen3_vl" if config["model_type"].startswith("qwen3") else "qwen2_5_vl"
    max_pixels = yaml.safe_load(table.SHIPPED[family].read_text())["model"]["max_pixels"]
    settings = load_vision_settings(Path(checkpoint_dir(tiny)), None, max_pixels, "nominal", "actual")
    bound, most = table.prompt_tokens(config) - table.TEXT_TOKENS, 0
    for _ in range(200):
        shape = (16, int(rng.integers(64, 2160)), int(rng.integers(64, 3840)), 3)
        plan = plan_video(shape, {"fps": 30.0, "total_num_frames": 300, "frames_indices": list(range(16))}, settings)
        most = max(most, plan.num_tokens)
    assert bound * 0.9 <= most <= bound
