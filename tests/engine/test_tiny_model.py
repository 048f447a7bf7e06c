"""The random checkpoint builder: seeded, hub layout, loadable by transformers and mlx-vlm alike."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from batchjob.synthetic.tiny_model import TinyModelSpec, mrope_section, write_tiny_checkpoint


def test_seeded_and_hub_layout(tmp_path):
    spec = TinyModelSpec(model_type="qwen2_vl", hidden_size=48, num_heads=6, num_kv_heads=2, num_layers=1, seed=7)
    a = write_tiny_checkpoint(tmp_path / "a", spec)
    b = write_tiny_checkpoint(tmp_path / "b", spec)
    c = write_tiny_checkpoint(tmp_path / "c", TinyModelSpec(**{**spec.__dict__, "seed": 8}))
    weights = [(p / "model.safetensors").read_bytes() for p in (a, b, c)]
    assert weights[0] == weights[1] != weights[2]
    assert sum(f.stat().st_size for f in a.iterdir()) < 5_000_000

    config = json.loads((a / "config.json").read_text())
    assert config["hidden_size"] == 48 and config["num_key_value_heads"] == 2 and "text_config" not in config
    assert config["rope_scaling"] == {"type": "mrope", "mrope_section": mrope_section(8)}
    assert sum(mrope_section(8)) == 4

    from safetensors import safe_open

    with safe_open(str(a / "model.safetensors"), "np") as f:
        names = set(f.keys())
    assert "lm_head.weight" in names and any(n.startswith("visual.") for n in names)
    assert any(n.startswith("model.layers.0.self_attn.k_proj") for n in names)
    assert not any(n.startswith("model.language_model.") for n in names)

    from transformers import AutoModelForImageTextToText, AutoTokenizer

    _, info = AutoModelForImageTextToText.from_pretrained(a, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    tokenizer = AutoTokenizer.from_pretrained(a)
    for token, key in [("<|video_pad|>", "video_token_id"), ("<|vision_start|>", "vision_start_token_id"),
                       ("<|vision_end|>", "vision_end_token_id"), ("<|image_pad|>", "image_token_id")]:
        assert tokenizer.convert_tokens_to_ids(token) == config[key] < config["vocab_size"]
    text = "Which? A. x ünï"
    assert tokenizer.decode(tokenizer.encode(text, add_special_tokens=False)) == text


@pytest.mark.parametrize("bad", [dict(num_heads=4, num_kv_heads=3), dict(hidden_size=60, num_heads=4),
                                 dict(model_type="llava")])
def test_bad_specs_are_rejected(bad, tmp_path):
    with pytest.raises(ValueError):
        write_tiny_checkpoint(tmp_path, TinyModelSpec(**bad))


def test_cli(tmp_path, capsys):
    script = Path(__file__).resolve().parents[2] / "scripts" / "make_tiny_model.py"
    spec = importlib.util.spec_from_file_location("make_tiny_model", script)
    cli = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(cli)
    assert cli.main([str(tmp_path / "m"), "--model-type", "qwen2_5_vl", "--heads", "2", "--kv-heads", "1",
                     "--head-dim", "32", "--layers", "1"]) == 0
    assert capsys.readouterr().out.strip() == str(tmp_path / "m")
    assert cli.main([str(tmp_path / "bad"), "--heads", "4", "--kv-heads", "3"]) == 2
    assert "multiple of num_kv_heads" in capsys.readouterr().err
    config = json.loads((tmp_path / "m" / "config.json").read_text())
    assert (config["hidden_size"], config["num_attention_heads"], config["num_key_value_heads"]) == (64, 2, 1)


@pytest.mark.parametrize("model_type", ["qwen3_vl", "qwen3_vl_moe"])
def test_qwen3_hub_layout_loads_in_transformers_and_mlx_vlm(model_type, tmp_path):
    """Qwen3-VL's hub layout: nested config with rope_scaling (mlx-vlm reads it; transformers converts it), weights
    named as transformers 5 names them, MoE experts fused and stored transposed [E, H, 2I] / [E, I, H]."""
    import numpy as np
    from safetensors import safe_open
    from transformers import AutoModelForImageTextToText

    spec = TinyModelSpec(model_type=model_type, hidden_size=64, num_heads=4, num_kv_heads=2, head_dim=32,
                         num_layers=1, vision_depth=2, deepstack_visual_indexes=(1,), seed=3)
    path = write_tiny_checkpoint(tmp_path / "m", spec)
    config = json.loads((path / "config.json").read_text())
    text = config["text_config"]
    assert "hidden_size" not in config and text["head_dim"] == 32
    assert text["rope_scaling"] == {"rope_type": "default", "mrope_section": mrope_section(32),
                                    "mrope_interleaved": True}
    video = json.loads((path / "video_preprocessor_config.json").read_text())
    assert video["size"]["longest_edge"] == spec.video_max_pixels
    model, info = AutoModelForImageTextToText.from_pretrained(path, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    assert model.config.text_config.rope_parameters["mrope_section"] == mrope_section(32)
    with safe_open(str(path / "model.safetensors"), "np") as f:
        names = set(f.keys())
        assert any(n.startswith("model.visual.deepstack_merger_list.0") for n in names)
        if model_type == "qwen3_vl_moe":
            stored = f.get_tensor("model.language_model.layers.0.mlp.experts.gate_up_proj")
            assert stored.shape == (spec.num_experts, 64, 2 * spec.moe_intermediate_size)
            loaded = model.model.language_model.layers[0].mlp.experts.gate_up_proj.detach().numpy()
            np.testing.assert_array_equal(loaded, stored.transpose(0, 2, 1))

    from mlx_vlm.utils import load_model

    mlx_model = load_model(path)
    attn = mlx_model.language_model.model.layers[0].self_attn
    assert (attn.head_dim, attn.n_kv_heads) == (32, 2)
    assert len(mlx_model.vision_tower.deepstack_merger_list) == 1


def test_moe_square_experts_are_rejected(tmp_path):
    with pytest.raises(ValueError, match="moe_intermediate_size"):
        write_tiny_checkpoint(tmp_path, TinyModelSpec(model_type="qwen3_vl_moe", hidden_size=64,
                                                      moe_intermediate_size=32))
