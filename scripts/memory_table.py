#!/usr/bin/env python
"""The memory each supported model needs at bf16 / 8-bit / 4-bit, and the smallest `model.memory_budget_gb`.

Weights come from the published configs' shapes (batchjob/engine/published_configs.py) through
batchjob/engine/footprint.py: mlx-vlm's layout, quantized as its converter quantizes (language model only,
group size 64, bf16 scales and biases), plus what the engine adds at load (vision MLPs padded to the GEMM tile).
The KV cache is bf16 (the GPU dtype). The engine refuses a budget below the weights, one forward's activations
and the KV cache of one `max_model_len` request (engine/memory_budget.py); the 16-frame prompt is the shipped configs' worst case
(every frame at `max_pixels`) plus TEXT_TOKENS of text.

    python scripts/memory_table.py            # print the table
    python scripts/memory_table.py --readme   # rewrite the table in README.md
"""

from __future__ import annotations

import argparse
import math
import re
import sys
from dataclasses import dataclass
from pathlib import Path

import yaml

from batchjob.engine.runner import LAYER_LAG
from batchjob.engine.token_budget import activation_bytes_per_token, auto_batched_tokens, smallest_budget
from batchjob.engine.footprint import (Quantization, kv_bytes_per_token, kv_layout, parameter_counts, text_settings,
                                      weights_bytes)
from batchjob.engine.published_configs import PUBLISHED_CONFIGS
from batchjob.engine.types import EngineConfig
from batchjob.metal_backend.memory import kv_bytes_per_block

ROOT = Path(__file__).resolve().parents[1]
SHIPPED = {"qwen2_5_vl": ROOT / "configs/nextqa.yaml", "qwen3_vl": ROOT / "configs/nextqa-qwen3vl.yaml"}
TEXT_TOKENS = 256        # chat template, question, five options (and Qwen3-VL's timestamps): ~100-200 in practice
SHORT_CONTEXT = 4096     # a max_model_len that still holds the 16-frame prompt
GIB = 2**30              # memory_budget_gb counts in 2**30 bytes
PRECISIONS = {"bf16": None, "8-bit": Quantization(8), "4-bit": Quantization(4)}
START, END = "<!-- memory-table:start -->", "<!-- memory-table:end -->"


def prompt_tokens(config: dict) -> int:
    """At most this many tokens in a 16-frame prompt of the shipped config for the model's family."""
    family = "qwen3_vl" if config["model_type"].startswith("qwen3") else "qwen2_5_vl"
    job = yaml.safe_load(SHIPPED[family].read_text())
    frames, max_pixels = job["loader"]["num_frames"], job["model"]["max_pixels"]
    vision = config["vision_config"]
    temporal, side = vision["temporal_patch_size"], vision["patch_size"] * vision["spatial_merge_size"]
    per_frame = max_pixels // frames if family == "qwen3_vl" else max_pixels  # Qwen3-VL bounds the whole clip
    return math.ceil(frames / temporal) * (per_frame // side**2) + TEXT_TOKENS


def _per_token(config: dict, dtype_bytes: int) -> int:
    """One forward's activation bytes per token, by the engine's own estimate (engine/token_budget.py)."""
    text = text_settings(config)
    layers, kv_heads, head_dim = kv_layout(config)
    moe = text.get("moe_intermediate_size", 0) * text.get("num_experts_per_tok", 0)
    return activation_bytes_per_token(hidden=text["hidden_size"], intermediate=max(
        text.get("intermediate_size", 0), moe), num_heads=text["num_attention_heads"], num_kv_heads=kv_heads,
        head_dim=head_dim, dtype_bytes=dtype_bytes, layer_lag=LAYER_LAG)


def _shipped_tokens(config: dict) -> int | None:
    """The shipped config's `max_num_batched_tokens` for the model's family; None for `auto`."""
    family = "qwen3_vl" if config["model_type"].startswith("qwen3") else "qwen2_5_vl"
    tokens = yaml.safe_load(SHIPPED[family].read_text())["model"].get("max_num_batched_tokens", "auto")
    return None if tokens == "auto" else int(tokens)


def forward_activations(config: dict, budget_bytes: int, weights: int, dtype_bytes: int = 2) -> int:
    """One forward's activations on a GPU under a budget of `budget_bytes`, at the shipped config's token budget
    (`auto` follows the budget, as in the engine)."""
    per_token = _per_token(config, dtype_bytes)
    tokens = _shipped_tokens(config)
    if tokens is None:
        tokens = auto_batched_tokens("cuda", memory_bytes=budget_bytes, weights_bytes=weights,
                                     bytes_per_token=per_token)
    return tokens * per_token


def minimum_budget_bytes(config: dict, weights: int, max_model_len: int, block_size: int = 16,
                         dtype_bytes: int = 2) -> int:
    """The engine's start-up rule (batchjob/engine/memory_budget.py) at its least budget: the weights, one
    forward's activations and the KV blocks of one `max_model_len`-token request."""
    layers, kv_heads, head_dim = kv_layout(config)
    per_block = kv_bytes_per_block(num_layers=layers, num_kv_heads=kv_heads, head_dim=head_dim,
                                   dtype_bytes=dtype_bytes, block_size=block_size)
    return smallest_budget(weights_bytes=weights, kv_request_bytes=-(-max_model_len // block_size) * per_block,
                           bytes_per_token=_per_token(config, dtype_bytes), tokens=_shipped_tokens(config))


@dataclass(frozen=True)
class Row:
    model: str
    params: tuple[int, int]              # language model, vision tower
    weights: dict[str, int]              # precision -> bytes
    kv_prompt: int                       # KV bytes of the 16-frame prompt
    kv_request: int                      # KV bytes of one max_model_len request
    budget: dict[str, int]               # precision -> smallest memory_budget_gb (bytes) at max_model_len
    budget_short: dict[str, int]         # the same at SHORT_CONTEXT


def row(name: str, config: dict, max_model_len: int) -> Row:
    weights = {p: weights_bytes(config, q, 2, engine=True) for p, q in PRECISIONS.items()}
    return Row(model=name.split("/")[-1].removesuffix("-Instruct"), params=parameter_counts(config), weights=weights,
               kv_prompt=prompt_tokens(config) * kv_bytes_per_token(config),
               kv_request=max_model_len * kv_bytes_per_token(config),
               budget={p: minimum_budget_bytes(config, w, max_model_len) for p, w in weights.items()},
               budget_short={p: minimum_budget_bytes(config, w, SHORT_CONTEXT) for p, w in weights.items()})


def _gib(values, digits: int = 1, up: bool = False) -> str:
    """GiB figures; `up` rounds up (a budget rounded down would be refused)."""
    scale = 10**digits
    return " / ".join(f"{(math.ceil(v / GIB * scale) if up else round(v / GIB * scale)) / scale:.{digits}f}"
                      for v in values)


def table(max_model_len: int = EngineConfig().max_model_len) -> str:
    rows = [row(name, config, max_model_len) for name, config in PUBLISHED_CONFIGS.items()]
    lines = [f"| model | parameters (LM + vision) | weights, GiB: bf16 / 8-bit / 4-bit | KV cache, GiB: 16-frame "
             f"prompt / {max_model_len:,}-token request | min `memory_budget_gb`: bf16 / 8-bit / 4-bit | "
             f"the same with `max_model_len: {SHORT_CONTEXT}` |",
             "|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r.model} | {r.params[0] / 1e9:.2f}B + {r.params[1] / 1e9:.2f}B | {_gib(r.weights.values())} "
                     f"| {_gib([r.kv_prompt, r.kv_request], 2)} | {_gib(r.budget.values(), up=True)} "
                     f"| {_gib(r.budget_short.values(), up=True)} |")
    return "\n".join(lines)


def replace_in_readme(text: str, new_table: str) -> str:
    pattern = re.compile(re.escape(START) + r".*?" + re.escape(END), re.S)
    if not pattern.search(text):
        raise ValueError(f"README.md has no {START} ... {END} block")
    return pattern.sub(lambda _: f"{START}\n{new_table}\n{END}", text)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--readme", action="store_true", help="rewrite the table between the markers in README.md")
    args = parser.parse_args(argv)
    out = table()
    if args.readme:
        readme = ROOT / "README.md"
        readme.write_text(replace_in_readme(readme.read_text(), out))
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
