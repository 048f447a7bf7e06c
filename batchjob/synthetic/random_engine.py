"""The MLX engine with a model built in process from random weights in a real model's shape.

A pipeline benchmark at 7B scale needs the 7B model's compute, not its answers, and no 15 GB checkpoint
can be downloaded or quickly written where it runs. So the checkpoint directory is a tiny random
checkpoint (tokenizer, processor settings: what `load_checkpoint` and the decoders' input preparation
read) plus `random/config.json`, the Hugging Face config of the model to build in its place. Select it in
a job config with `model.engine: batchjob.synthetic.random_engine:RandomWeightsEngine`.
"""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path

RANDOM_DIR = "random"   # <checkpoint>/random/config.json: the shape to build

# Qwen2.5-VL-7B-Instruct's published shape.
QWEN25_VL_7B = dict(hidden=3584, layers=28, heads=28, kv_heads=4, inter=18944, v_depth=32, v_hidden=1280,
                    v_heads=16, v_inter=3420, fullatt=(7, 15, 23, 31))
# The same code path on a CPU in seconds (figures from it mean nothing).
SMOKE = dict(hidden=256, layers=2, heads=4, kv_heads=2, inter=512, v_depth=4, v_hidden=128, v_heads=2,
             v_inter=256, fullatt=(1, 3))
# Qwen3-VL-8B-Instruct's published shape (its config.json: text_config / vision_config).
QWEN3_VL_8B = dict(hidden=4096, layers=36, heads=32, kv_heads=8, head_dim=128, inter=12288, mrope=(24, 20, 20),
                   rope_theta=5e6, v_depth=27, v_hidden=1152, v_heads=16, v_inter=4304, patch=16,
                   deepstack=(8, 16, 24), v_positions=2304)
# vision heads of 72 as in the 8B (their rotary halves get padded: engine/vision_heads.py)
SMOKE_QWEN3 = dict(hidden=256, layers=2, heads=4, kv_heads=2, head_dim=64, inter=512, mrope=(12, 10, 10),
                   rope_theta=5e6, v_depth=4, v_hidden=144, v_heads=2, v_inter=256, patch=16, deepstack=(0, 1, 2),
                   v_positions=64)
SHAPES = {"qwen2_5_vl": (QWEN25_VL_7B, SMOKE), "qwen3_vl": (QWEN3_VL_8B, SMOKE_QWEN3)}   # (published, smoke)


def scaled_config(tiny_config: dict, dims: dict, layers: int, vision_layers: int) -> dict:
    """The tiny checkpoint's config reshaped to `dims`, cut to `layers` text and `vision_layers` vision blocks
    (token ids, vocabulary and processor settings stay the tiny tokenizer's)."""
    if not 1 <= layers or not 1 <= vision_layers:
        raise ValueError(f"layers ({layers}) and vision_layers ({vision_layers}) must be >= 1")
    if tiny_config.get("model_type") == "qwen3_vl":
        return _scaled_qwen3(tiny_config, dims, layers, vision_layers)
    cfg = json.loads(json.dumps(tiny_config))
    head_dim = dims["hidden"] // dims["heads"]
    half = head_dim // 2
    third = half * 3 // 8
    cfg.update(hidden_size=dims["hidden"], num_hidden_layers=layers, num_attention_heads=dims["heads"],
               num_key_value_heads=dims["kv_heads"], intermediate_size=dims["inter"], max_window_layers=layers,
               torch_dtype="bfloat16", initializer_range=0.02)
    cfg["rope_scaling"] = {"type": "mrope", "mrope_section": [half - 2 * third, third, third]}
    cfg["vision_config"].update(depth=vision_layers, hidden_size=dims["v_hidden"], num_heads=dims["v_heads"],
                                intermediate_size=dims["v_inter"], out_hidden_size=dims["hidden"],
                                fullatt_block_indexes=[i for i in dims["fullatt"] if i < vision_layers],
                                initializer_range=0.02)
    return cfg


def _scaled_qwen3(tiny_config: dict, dims: dict, layers: int, vision_layers: int) -> dict:
    """The nested Qwen3-VL layout (text_config / vision_config) reshaped to `dims`; DeepStack taps past the cut
    are dropped."""
    cfg = json.loads(json.dumps(tiny_config))
    cfg["text_config"].update(hidden_size=dims["hidden"], num_hidden_layers=layers, num_attention_heads=dims["heads"],
                              num_key_value_heads=dims["kv_heads"], head_dim=dims["head_dim"],
                              intermediate_size=dims["inter"], rope_theta=dims["rope_theta"], dtype="bfloat16",
                              initializer_range=0.02)
    cfg["text_config"]["rope_scaling"] = {"rope_type": "default", "mrope_section": list(dims["mrope"]),
                                          "mrope_interleaved": True}
    cfg["vision_config"].update(depth=vision_layers, hidden_size=dims["v_hidden"], num_heads=dims["v_heads"],
                                intermediate_size=dims["v_inter"], out_hidden_size=dims["hidden"],
                                patch_size=dims["patch"], num_position_embeddings=dims["v_positions"],
                                deepstack_visual_indexes=[i for i in dims["deepstack"] if i < vision_layers],
                                initializer_range=0.02)
    cfg["dtype"] = "bfloat16"
    return cfg


def write_random_config(checkpoint: str | Path, config: dict) -> Path:
    """Put the shape to build beside a tiny checkpoint (`checkpoint/random/config.json`)."""
    out = Path(checkpoint) / RANDOM_DIR
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(config, indent=1))
    return out


def build_random_model(config_dir: Path, dtype):
    """mlx-vlm's model for `config_dir/config.json`, random weights materialized in `dtype`."""
    import mlx.core as mx
    from mlx_vlm.utils import get_model_and_args, load_config, update_module_configs

    config = load_config(config_dir)
    model_class, _ = get_model_and_args(config=config, model_path=config_dir)
    config.setdefault("text_config", {})
    config.setdefault("vision_config", {})
    model_config = update_module_configs(model_class.ModelConfig.from_dict(config), model_class, config,
                                         ["text", "vision"])
    model = model_class.Model(model_config)
    model.set_dtype(dtype)
    mx.eval(model.parameters())
    return model


# Qwen3-VL's published video processor bounds (`size`, over the whole clip) and image processor maximum, so a
# random checkpoint reads like a downloaded one where a job config leaves them unset (a tiny spec has one minimum
# for both processors: the video's, which a video job reads).
QWEN3_VL_PROCESSOR = dict(min_pixels=4096, max_pixels=16777216, video_max_pixels=25165824)


def tiny_spec(model_type: str, max_pixels: int | None = None):
    """The tiny checkpoint a random one borrows its tokenizer and processor settings from. `max_pixels`: the
    processor's default bound (per frame for Qwen2.5-VL, the whole clip for Qwen3-VL); None = the hub's."""
    from batchjob.synthetic.tiny_model import TinyModelSpec

    if model_type == "qwen2_5_vl":
        return TinyModelSpec(model_type=model_type, max_pixels=max_pixels or 448 * 448, min_pixels=28 * 28 * 4)
    if model_type == "qwen3_vl":
        p = QWEN3_VL_PROCESSOR
        return TinyModelSpec(model_type=model_type, min_pixels=p["min_pixels"], max_pixels=p["max_pixels"],
                             video_max_pixels=max_pixels or p["video_max_pixels"])
    raise ValueError(f"model_type {model_type!r}: random checkpoints are written for {', '.join(SHAPES)}")


def write_random_checkpoint(path: str | Path, dims: dict, layers: int, vision_layers: int, *,
                            max_pixels: int | None = None, dtype: str = "bfloat16",
                            model_type: str = "qwen2_5_vl") -> Path:
    """A real checkpoint directory on disk in `dims`' shape: the tiny checkpoint's tokenizer and processor
    settings (`tiny_spec`), the scaled config (`model_type`'s layout: flat for Qwen2.5-VL, nested for Qwen3-VL),
    random weights saved as safetensors shards by mlx-vlm (its own layout, as mlx-community's checkpoints are).
    What a user's downloaded checkpoint is to `batchjob run`, at that size."""
    import shutil

    import mlx.core as mx
    from mlx_vlm.utils import save_weights

    from batchjob.synthetic.tiny_model import write_tiny_checkpoint

    path = Path(path)
    spec = tiny_spec(model_type, max_pixels)
    if path.exists():
        shutil.rmtree(path)
    write_tiny_checkpoint(path, spec)
    tiny = json.loads((path / "config.json").read_text())
    for f in path.glob("*.safetensors*"):
        f.unlink()
    (path / "config.json").write_text(json.dumps(scaled_config(tiny, dims, layers, vision_layers), indent=1))
    model = build_random_model(path, getattr(mx, dtype))
    save_weights(path, model, donate_weights=True)
    return path


def random_classifier(checkpoint: str | Path, config):
    """A `Classifier` over the random model described in `checkpoint/random/config.json`.

    The tiny checkpoint is loaded first, so device, dtype, tokenizer, vision settings and the model family
    (prompts, positions, the packed vision forward: nothing there depends on the model's width or depth)
    come from the engine's own loading path; only the model and its config are replaced.
    """
    from mlx.utils import tree_flatten

    from batchjob.engine import Classifier
    from batchjob.engine.checkpoint import load_checkpoint
    from batchjob.engine.types import EngineError

    path = Path(checkpoint)
    config_dir = path / RANDOM_DIR
    if not (config_dir / "config.json").is_file():
        raise EngineError(f"{path}: no {RANDOM_DIR}/config.json; write one with "
                          "batchjob.synthetic.random_engine.write_random_config")
    tiny = load_checkpoint(path, config)
    big = json.loads((config_dir / "config.json").read_text())
    if big.get("model_type") != tiny.model_type:
        raise EngineError(f"{config_dir / 'config.json'}: model_type {big.get('model_type')!r} differs from the "
                          f"checkpoint's {tiny.model_type!r}")
    model = build_random_model(config_dir, tiny.dtype)
    tiny.family.hf_config = big   # what the family reads of the model (DeepStack taps) is the big model's
    tiny.family.fix_model(model)
    ckpt = dataclasses.replace(tiny, model=model, hf_config=big, model_id=f"random:{path.name}",
                               weights_bytes=sum(v.nbytes for _, v in tree_flatten(model.parameters())))
    return Classifier(ckpt, config)


def __getattr__(name: str):
    """`RandomWeightsEngine` on first use: it is a pipeline engine (pydantic, the contract), while the shapes and
    builders above are all a GPU benchmark needs, on a machine whose image may lack the pipeline's packages."""
    if name == "RandomWeightsEngine":
        from .random_weights_engine import RandomWeightsEngine

        return RandomWeightsEngine
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
