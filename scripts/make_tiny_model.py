#!/usr/bin/env python
"""Write a seeded random-weight Qwen2.5-VL / Qwen2-VL checkpoint in Hugging Face format.

Thin CLI over `batchjob.synthetic.tiny_model` (tests, the benchmark and `batchjob demo` call the module).
Example: python scripts/make_tiny_model.py /tmp/tiny --model-type qwen2_5_vl --layers 2 --heads 4 --kv-heads 2
"""

from __future__ import annotations

import argparse
import sys

from batchjob.synthetic.tiny_model import TinyModelSpec, write_tiny_checkpoint


def main(argv: list[str] | None = None) -> int:
    defaults = TinyModelSpec()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir")
    parser.add_argument("--model-type", choices=["qwen2_5_vl", "qwen2_vl", "qwen3_vl", "qwen3_vl_moe"],
                        default=defaults.model_type)
    parser.add_argument("--layers", type=int, default=defaults.num_layers)
    parser.add_argument("--heads", type=int, default=defaults.num_heads)
    parser.add_argument("--kv-heads", type=int, default=defaults.num_kv_heads, help="heads / kv-heads = GQA ratio")
    parser.add_argument("--head-dim", type=int, default=None, help="default: 16 (hidden = heads x head-dim)")
    parser.add_argument("--intermediate", type=int, default=None, help="MLP width (default: 2 x hidden)")
    parser.add_argument("--vision-depth", type=int, default=defaults.vision_depth)
    parser.add_argument("--vision-hidden", type=int, default=defaults.vision_hidden)
    parser.add_argument("--max-pixels", type=int, default=defaults.max_pixels)
    parser.add_argument("--seed", type=int, default=defaults.seed)
    args = parser.parse_args(argv)
    head_dim = args.head_dim or 16
    hidden = args.heads * head_dim
    spec = TinyModelSpec(
        model_type=args.model_type, hidden_size=hidden, num_layers=args.layers, num_heads=args.heads,
        num_kv_heads=args.kv_heads, intermediate_size=args.intermediate or 2 * hidden,
        vision_depth=args.vision_depth, vision_hidden=args.vision_hidden, max_pixels=args.max_pixels,
        fullatt_block_indexes=(args.vision_depth - 1,), seed=args.seed)
    try:
        out = write_tiny_checkpoint(args.out_dir, spec)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
