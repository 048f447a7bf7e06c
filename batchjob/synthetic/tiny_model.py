"""Random-weight Qwen2.5-VL / Qwen2-VL / Qwen3-VL (dense and MoE) checkpoints in Hugging Face format, built locally.

No weights can be downloaded in development or CI, so tests, the benchmark and `batchjob demo` build
their checkpoints here. The directory looks like a hub checkpoint on purpose: the *flat* config layout
(text settings at top level, `rope_scaling: {type: mrope, mrope_section}`), hub-style weight names
(`model.layers.*`, `visual.*`, `lm_head.weight`), a tokenizer with the model's special tokens and chat
template, and processor configs. That layout is what both mlx-vlm 0.7.10 and transformers 5 load
identically (a nested transformers-5 `save_pretrained` config is not readable by mlx-vlm).
Qwen3-VL checkpoints on the hub are nested (`text_config` / `vision_config`, written by transformers 4.57) with
`rope_scaling: {rope_type: default, mrope_section, mrope_interleaved: true}` and weights named
`model.language_model.*` / `model.visual.*`; MoE experts fused as `gate_up_proj [E, H, 2I]`, `down_proj [E, I, H]`.

The tokenizer is byte-level BPE (so any text round-trips and single letters are single tokens) with a few
hundred merges learned from a small fixed English corpus, deterministically: common words become one token,
so question and option text is about as many tokens as with the real Qwen tokenizer. Prompt length
matters for what tests and the benchmark measure (prefix sharing saves the video, not the question).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

# Special tokens in the order the real Qwen2-VL tokenizer lists them; ids follow the 256 byte tokens.
SPECIAL_TOKENS = (
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|vision_pad|>",
    "<|image_pad|>",
    "<|video_pad|>",
)

# Functionally the template Qwen2-VL / Qwen2.5-VL checkpoints ship: default system prompt, vision
# placeholders inline in the user turn, generation prompt "<|im_start|>assistant\n".
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if loop.first and message['role'] != 'system' %}"
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n{% endif %}"
    "<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}<|im_end|>\n"
    "{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'image' or 'image' in content %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif content['type'] == 'video' or 'video' in content %}<|vision_start|><|video_pad|><|vision_end|>"
    "{% elif 'text' in content %}{{ content['text'] }}{% endif %}"
    "{% endfor %}<|im_end|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

# Qwen3-VL's template: no default system prompt, otherwise the same placeholders.
CHAT_TEMPLATE_QWEN3 = CHAT_TEMPLATE.replace(
    "{% if loop.first and message['role'] != 'system' %}"
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n{% endif %}", "")

ARCHITECTURES = {
    "qwen2_5_vl": "Qwen2_5_VLForConditionalGeneration",
    "qwen2_vl": "Qwen2VLForConditionalGeneration",
    "qwen3_vl": "Qwen3VLForConditionalGeneration",
    "qwen3_vl_moe": "Qwen3VLMoeForConditionalGeneration",
}
QWEN3_TYPES = ("qwen3_vl", "qwen3_vl_moe")


@dataclass(frozen=True)
class TinyModelSpec:
    """Shape of a random checkpoint. Defaults: a few MB, runs a forward pass in milliseconds."""

    model_type: str = "qwen2_5_vl"  # or "qwen2_vl", "qwen3_vl", "qwen3_vl_moe"
    hidden_size: int = 64
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2  # num_heads / num_kv_heads is the GQA ratio
    head_dim: int | None = None  # None = hidden_size // num_heads (the only layout mlx-vlm supports)
    intermediate_size: int = 128
    vision_depth: int = 2
    vision_hidden: int = 32
    # Qwen2.5-VL / Qwen3-VL vision MLP width; None = 2 x vision_hidden. Real towers use widths that are not
    # multiples of the quantization group (3420, 4304): mlx-vlm then leaves those layers unquantized.
    vision_intermediate: int | None = None
    vision_heads: int = 2
    tokens_per_second: int = 2
    seed: int = 0
    # Larger than the usual 0.02 so option probabilities differ visibly: a parity test on near-uniform
    # probabilities would compare numbers that barely depend on the model.
    initializer_range: float = 0.1
    min_pixels: int = 28 * 28 * 4
    max_pixels: int = 28 * 28 * 16
    fullatt_block_indexes: tuple[int, ...] = field(default=(1,))
    # Qwen3-VL only: vision layers whose outputs are added to the first LM layers (DeepStack), experts (MoE),
    # and the video processor's whole-clip pixel budget (`size.longest_edge`, in pixels over all frames).
    deepstack_visual_indexes: tuple[int, ...] = (0, 1)
    num_experts: int = 4
    num_experts_per_tok: int = 2
    # Not hidden_size / 2: transformers 5 transposes the hub's fused experts on load and cannot tell a square
    # [E, H, 2I] tensor's orientation (the checkpoint then loads silently wrong).
    moe_intermediate_size: int = 48
    tie_word_embeddings: bool = False
    video_max_pixels: int = 32 * 32 * 64
    rope_theta: float | None = None   # None: the family's (1e6 for Qwen2.5-VL, 5e6 for Qwen3-VL)
    # Extra lines the tokenizer's merges are learned from (the demo model's question words become single tokens).
    corpus: tuple[str, ...] = ()

    @property
    def patch_size(self) -> int:
        return 16 if self.model_type in QWEN3_TYPES else 14

    def resolved_vision_intermediate(self) -> int:
        return self.vision_intermediate or 2 * self.vision_hidden

    def resolved_head_dim(self) -> int:
        head_dim = self.head_dim or self.hidden_size // self.num_heads
        if head_dim * self.num_heads != self.hidden_size:
            raise ValueError(
                f"head_dim {head_dim} x num_heads {self.num_heads} != hidden_size {self.hidden_size}: "
                "mlx-vlm's Qwen2-VL attention derives head_dim from hidden_size; pick hidden_size = heads x head_dim"
            )
        if head_dim % 4:
            raise ValueError(f"head_dim {head_dim} must be a multiple of 4 (M-RoPE splits it in three sections)")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads {self.num_heads} must be a multiple of num_kv_heads {self.num_kv_heads}")
        return head_dim


def mrope_section(head_dim: int) -> list[int]:
    """Split head_dim/2 rotary frequencies over (t, h, w) like the real models (128 -> [16, 24, 24])."""
    half = head_dim // 2
    spatial = half * 3 // 8
    return [half - 2 * spatial, spatial, spatial]


# Merges are learned from this text (chat-template words and video-question vocabulary).
CORPUS = (
    "system user assistant You are a helpful assistant.",
    "Answer with the option's letter from the given choices directly.",
    "What is the person doing in the video? What does the man do after he opens the door?",
    "Which object moves first? Where does the action take place? Why did the woman pick up the ball?",
    "How many people are there in the room? What happens right after the dog jumps on the table?",
    "the a an of to in on at with and or but is are was were be been do does did next before after",
    "option for question left right up down red blue green cat dog car person people child play walk run",
)


def build_tokenizer(chat_template: str = CHAT_TEMPLATE, corpus: tuple[str, ...] = ()):
    """Byte-level BPE tokenizer with Qwen's special tokens and chat template (see the module docstring);
    `corpus` adds lines to learn merges from."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    core = Tokenizer(models.BPE())
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=1000, min_frequency=1, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    core.train_from_iterator(CORPUS + tuple(corpus), trainer)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=core, eos_token="<|im_end|>", pad_token="<|endoftext|>", chat_template=chat_template
    )
    tokenizer.add_special_tokens({"additional_special_tokens": list(SPECIAL_TOKENS)})
    return tokenizer


def checkpoint_config(spec: TinyModelSpec, token_ids: dict[str, int], vocab_size: int) -> dict:
    """The flat hub-style config.json for `spec`."""
    if spec.model_type not in ARCHITECTURES:
        raise ValueError(f"model_type {spec.model_type!r} is not one of {sorted(ARCHITECTURES)}")
    if spec.model_type in QWEN3_TYPES:
        return qwen3_config(spec, token_ids, vocab_size)
    head_dim = spec.resolved_head_dim()
    if spec.model_type == "qwen2_5_vl":
        vision = {
            "depth": spec.vision_depth, "hidden_size": spec.vision_hidden,
            "intermediate_size": spec.resolved_vision_intermediate(), "num_heads": spec.vision_heads,
            "out_hidden_size": spec.hidden_size, "hidden_act": "silu",
            "patch_size": 14, "spatial_merge_size": 2, "temporal_patch_size": 2, "window_size": 112,
            "fullatt_block_indexes": list(spec.fullatt_block_indexes), "tokens_per_second": spec.tokens_per_second,
            "in_chans": 3, "in_channels": 3, "initializer_range": spec.initializer_range,
        }
    else:
        vision = {
            "depth": spec.vision_depth, "embed_dim": spec.vision_hidden, "hidden_size": spec.hidden_size,
            "mlp_ratio": 2, "num_heads": spec.vision_heads, "hidden_act": "quick_gelu", "patch_size": 14,
            "spatial_merge_size": 2, "temporal_patch_size": 2, "in_chans": 3, "in_channels": 3,
            "initializer_range": spec.initializer_range,
        }
    return {
        "architectures": [ARCHITECTURES[spec.model_type]],
        "model_type": spec.model_type,
        "hidden_size": spec.hidden_size,
        "intermediate_size": spec.intermediate_size,
        "num_hidden_layers": spec.num_layers,
        "num_attention_heads": spec.num_heads,
        "num_key_value_heads": spec.num_kv_heads,
        "hidden_act": "silu",
        "max_position_embeddings": 32768,
        "rms_norm_eps": 1e-6,
        "rope_theta": spec.rope_theta or 1000000.0,
        "rope_scaling": {"type": "mrope", "mrope_section": mrope_section(head_dim)},
        "vocab_size": vocab_size,
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
        "initializer_range": spec.initializer_range,
        "attention_dropout": 0.0,
        "use_sliding_window": False,
        "sliding_window": 32768,
        "max_window_layers": spec.num_layers,
        "bos_token_id": token_ids["<|endoftext|>"],
        "eos_token_id": token_ids["<|im_end|>"],
        "vision_start_token_id": token_ids["<|vision_start|>"],
        "vision_end_token_id": token_ids["<|vision_end|>"],
        "vision_token_id": token_ids["<|vision_pad|>"],
        "image_token_id": token_ids["<|image_pad|>"],
        "video_token_id": token_ids["<|video_pad|>"],
        "vision_config": vision,
    }


def qwen3_config(spec: TinyModelSpec, token_ids: dict[str, int], vocab_size: int) -> dict:
    """The nested hub config.json of a Qwen3-VL / Qwen3-VL-MoE checkpoint (transformers 4.57 layout)."""
    head_dim = spec.head_dim or spec.hidden_size // spec.num_heads
    if head_dim % 4 or spec.num_heads % spec.num_kv_heads:
        raise ValueError(f"head_dim {head_dim} must be a multiple of 4 and num_heads a multiple of num_kv_heads")
    moe = spec.model_type == "qwen3_vl_moe"
    if moe and spec.hidden_size in (spec.moe_intermediate_size, 2 * spec.moe_intermediate_size):
        raise ValueError(f"moe_intermediate_size {spec.moe_intermediate_size}: neither it nor twice it may equal "
                         f"hidden_size {spec.hidden_size} (transformers cannot orient square expert weights)")
    text = {
        "model_type": "qwen3_vl_moe_text" if moe else "qwen3_vl_text",
        "hidden_size": spec.hidden_size, "intermediate_size": spec.intermediate_size,
        "num_hidden_layers": spec.num_layers, "num_attention_heads": spec.num_heads,
        "num_key_value_heads": spec.num_kv_heads, "head_dim": head_dim, "hidden_act": "silu",
        "max_position_embeddings": 32768, "rms_norm_eps": 1e-6, "rope_theta": spec.rope_theta or 5000000.0,
        "rope_scaling": {"rope_type": "default", "mrope_section": mrope_section(head_dim), "mrope_interleaved": True},
        "vocab_size": vocab_size, "tie_word_embeddings": spec.tie_word_embeddings, "attention_bias": False,
        "attention_dropout": 0.0, "initializer_range": spec.initializer_range, "dtype": "float32",
        "bos_token_id": token_ids["<|endoftext|>"], "eos_token_id": token_ids["<|im_end|>"],
    }
    if moe:
        text.update({"num_experts": spec.num_experts, "num_experts_per_tok": spec.num_experts_per_tok,
                     "moe_intermediate_size": spec.moe_intermediate_size, "decoder_sparse_step": 1,
                     "mlp_only_layers": [], "norm_topk_prob": True})
    vision = {
        "model_type": spec.model_type, "depth": spec.vision_depth, "hidden_size": spec.vision_hidden,
        "intermediate_size": spec.resolved_vision_intermediate(), "num_heads": spec.vision_heads,
        "hidden_act": "gelu_pytorch_tanh", "in_channels": 3, "patch_size": 16, "spatial_merge_size": 2,
        "temporal_patch_size": 2, "out_hidden_size": spec.hidden_size, "num_position_embeddings": 64,
        "deepstack_visual_indexes": list(spec.deepstack_visual_indexes),
        "initializer_range": spec.initializer_range,
    }
    return {
        "architectures": [ARCHITECTURES[spec.model_type]], "model_type": spec.model_type,
        "text_config": text, "vision_config": vision, "tie_word_embeddings": spec.tie_word_embeddings,
        "image_token_id": token_ids["<|image_pad|>"], "video_token_id": token_ids["<|video_pad|>"],
        "vision_start_token_id": token_ids["<|vision_start|>"], "vision_end_token_id": token_ids["<|vision_end|>"],
        "dtype": "float32",
    }


def _hub_weight_name(name: str) -> str:
    """transformers-5 module names -> the names hub checkpoints (and mlx-vlm's sanitize) use."""
    if name.startswith("model.language_model."):
        return "model." + name[len("model.language_model."):]
    if name.startswith("model.visual."):
        return "visual." + name[len("model.visual."):]
    return name


def write_tiny_checkpoint(out_dir: str | Path, spec: TinyModelSpec = TinyModelSpec()) -> Path:
    """Write a seeded random checkpoint for `spec` into `out_dir` and return the directory."""
    import torch
    from safetensors.torch import save_file
    from transformers import AutoConfig, AutoModelForImageTextToText

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    qwen3 = spec.model_type in QWEN3_TYPES
    tokenizer = build_tokenizer(CHAT_TEMPLATE_QWEN3 if qwen3 else CHAT_TEMPLATE, spec.corpus)
    token_ids = {t: tokenizer.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS}
    vocab_size = (len(tokenizer) + 63) // 64 * 64  # padded like real checkpoints: logits exist for unused ids
    config = checkpoint_config(spec, token_ids, vocab_size)
    (out / "config.json").write_text(json.dumps(config, indent=2))
    tokenizer.save_pretrained(out)
    processor = {
        "image_processor_type": "Qwen2VLImageProcessor",
        "processor_class": "Qwen2_5_VLProcessor" if spec.model_type == "qwen2_5_vl" else "Qwen2VLProcessor",
        "min_pixels": spec.min_pixels, "max_pixels": spec.max_pixels,
        "patch_size": 14, "temporal_patch_size": 2, "merge_size": 2,
        "image_mean": [0.48145466, 0.4578275, 0.40821073], "image_std": [0.26862954, 0.26130258, 0.27577711],
        "do_rescale": True, "rescale_factor": 1 / 255, "do_normalize": True, "do_resize": True, "resample": 3,
    }
    if qwen3:
        processor.update({"image_processor_type": "Qwen2VLImageProcessorFast", "processor_class": "Qwen3VLProcessor",
                          "patch_size": 16, "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5],
                          "size": {"shortest_edge": spec.min_pixels, "longest_edge": spec.max_pixels}})
        del processor["min_pixels"], processor["max_pixels"]
        video = {**processor, "video_processor_type": "Qwen3VLVideoProcessor", "fps": 2, "do_sample_frames": False,
                 "size": {"shortest_edge": spec.min_pixels, "longest_edge": spec.video_max_pixels}}
        del video["image_processor_type"]
        (out / "video_preprocessor_config.json").write_text(json.dumps(video, indent=2))
    (out / "preprocessor_config.json").write_text(json.dumps(processor, indent=2))
    (out / "generation_config.json").write_text(json.dumps({"eos_token_id": token_ids["<|im_end|>"]}))

    torch.manual_seed(spec.seed)
    model = AutoModelForImageTextToText.from_config(AutoConfig.from_pretrained(out), dtype=torch.float32)
    if qwen3:  # hub names already match transformers 5; fused experts are stored transposed on the hub
        state = {k: (v.transpose(1, 2) if k.endswith(("experts.gate_up_proj", "experts.down_proj")) else v)
                 .detach().contiguous() for k, v in model.state_dict().items()
                 if not (spec.tie_word_embeddings and k == "lm_head.weight")}  # tied: hub files omit it
    else:
        state = {_hub_weight_name(k): v.detach().contiguous() for k, v in model.state_dict().items()}
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out
