"""The shapes of the supported hub checkpoints: the config.json fields that size their weights and KV cache.

Copied (shape fields only) from each model's published config.json, so memory can be planned for a model that
is not downloaded (footprint.py, scripts/memory_table.py). Qwen2.5-VL configs are flat (text settings at the top
level); Qwen3-VL configs nest them under `text_config`, as the hub files do. The Qwen3-VL text towers have the
shapes of the Qwen3 LLMs of the same size (1.7B for the 2B, 4B, 8B, 32B; the 30B-A3B is Qwen3-30B-A3B's).
"""

from __future__ import annotations


def _qwen25(hidden: int, layers: int, heads: int, kv_heads: int, inter: int, vocab: int, tied: bool,
            vision_inter: int) -> dict:
    return {
        "model_type": "qwen2_5_vl", "hidden_size": hidden, "num_hidden_layers": layers,
        "num_attention_heads": heads, "num_key_value_heads": kv_heads, "intermediate_size": inter,
        "vocab_size": vocab, "tie_word_embeddings": tied,
        "rope_scaling": {"type": "mrope", "mrope_section": [16, 24, 24]},
        "vision_config": {"depth": 32, "hidden_size": 1280, "intermediate_size": vision_inter, "num_heads": 16,
                          "out_hidden_size": hidden, "patch_size": 14, "spatial_merge_size": 2,
                          "temporal_patch_size": 2, "in_channels": 3, "fullatt_block_indexes": [7, 15, 23, 31]},
    }


def _qwen3(hidden: int, layers: int, heads: int, kv_heads: int, inter: int, tied: bool, vision: str,
           moe: dict | None = None) -> dict:
    small = vision == "small"   # the 2B / 4B tower: 24 blocks of 1024; the others: 27 blocks of 1152
    text = {"hidden_size": hidden, "num_hidden_layers": layers, "num_attention_heads": heads,
            "num_key_value_heads": kv_heads, "head_dim": 128, "intermediate_size": inter, "vocab_size": 151936,
            "tie_word_embeddings": tied, "attention_bias": False, "rope_theta": 5000000,
            "rope_scaling": {"rope_type": "default", "mrope_section": [24, 20, 20], "mrope_interleaved": True},
            "model_type": "qwen3_vl_moe_text" if moe else "qwen3_vl_text", **(moe or {})}
    return {
        "model_type": "qwen3_vl_moe" if moe else "qwen3_vl", "tie_word_embeddings": tied, "text_config": text,
        "vision_config": {"depth": 24 if small else 27, "hidden_size": 1024 if small else 1152,
                          "intermediate_size": 4096 if small else 4304, "num_heads": 16, "out_hidden_size": hidden,
                          "patch_size": 16, "spatial_merge_size": 2, "temporal_patch_size": 2, "in_channels": 3,
                          "num_position_embeddings": 2304,
                          "deepstack_visual_indexes": [5, 11, 17] if small else [8, 16, 24]},
    }


# Hub id -> shape. Qwen2.5-VL-32B / 72B publish a vision MLP width of 3456, the 3B / 7B 3420.
PUBLISHED_CONFIGS: dict[str, dict] = {
    "Qwen/Qwen2.5-VL-3B-Instruct": _qwen25(2048, 36, 16, 2, 11008, 151936, True, 3420),
    "Qwen/Qwen2.5-VL-7B-Instruct": _qwen25(3584, 28, 28, 4, 18944, 152064, False, 3420),
    "Qwen/Qwen2.5-VL-32B-Instruct": _qwen25(5120, 64, 40, 8, 27648, 152064, False, 3456),
    "Qwen/Qwen2.5-VL-72B-Instruct": _qwen25(8192, 80, 64, 8, 29568, 152064, False, 3456),
    "Qwen/Qwen3-VL-2B-Instruct": _qwen3(2048, 28, 16, 8, 6144, True, "small"),
    "Qwen/Qwen3-VL-4B-Instruct": _qwen3(2560, 36, 32, 8, 9728, True, "small"),
    "Qwen/Qwen3-VL-8B-Instruct": _qwen3(4096, 36, 32, 8, 12288, False, "large"),
    "Qwen/Qwen3-VL-32B-Instruct": _qwen3(5120, 64, 64, 8, 25600, False, "large"),
    "Qwen/Qwen3-VL-30B-A3B-Instruct": _qwen3(2048, 48, 32, 4, 6144, False, "large", moe={
        "num_experts": 128, "num_experts_per_tok": 8, "moe_intermediate_size": 768, "decoder_sparse_step": 1,
        "mlp_only_layers": [], "norm_topk_prob": True}),
}
