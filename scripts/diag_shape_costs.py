"""Diagnostic: what each kind of MLX op costs the first time it meets a shape, against the same call again.

A job's engine calls rarely repeat a shape: questions differ by a few words, so every forward's token count and
the padded attention groups' lengths are new. `diag_classify_overhead.py --vary` measured the sum (calls
70-150 ms slower than the same forward repeated). This splits it: for `--sizes` fresh token counts near a
forward's, each op a forward runs (the four GEMMs, RMSNorm, the compiled SwiGLU and rotary, the q/k norm-rotary
CUDA kernel, gathers, the KV write, the embedding lookup, a DeepStack add, causal and masked SDPA) is timed on its
first call at that size and on three more. A forward pays each op's first-call cost once per distinct shape it
holds, not once per layer.

    python3 scripts/diag_shape_costs.py [--model qwen3_vl] [--tokens 2048] [--sizes 6] [--smoke] [--json F]
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def first_and_again(mx, build, repeats: int = 3) -> tuple[float, float]:
    """ms of `build()` evaluated the first time, and the median of `repeats` more (same shapes, fresh graph)."""
    times = []
    for _ in range(repeats + 1):
        mx.synchronize()
        t0 = time.perf_counter()
        mx.eval(build())
        mx.synchronize()
        times.append((time.perf_counter() - t0) * 1e3)
    return times[0], statistics.median(times[1:])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", choices=("qwen2_5_vl", "qwen3_vl"), default="qwen3_vl")
    ap.add_argument("--tokens", type=int, default=2048, help="token count the fresh sizes start near")
    ap.add_argument("--sizes", type=int, default=6, help="fresh token counts per op")
    ap.add_argument("--smoke", action="store_true", help="the small shape on the CPU (tests)")
    ap.add_argument("--json", type=Path, default=None)
    a = ap.parse_args()
    import mlx.core as mx
    import mlx.nn as nn

    from batchjob.engine import cuda_fused
    from batchjob.engine.fused_ops import rope_heads, swiglu_halves
    from batchjob.metal_backend import write_kv
    from batchjob.metal_backend.attention import take_rows
    from batchjob.synthetic.random_engine import SHAPES

    dims = SHAPES[a.model][1 if a.smoke else 0]
    h, hq, hkv, inter = dims["hidden"], dims["heads"], dims["kv_heads"], dims["inter"]
    d = dims.get("head_dim", h // hq)
    dtype = mx.float32 if a.smoke else mx.bfloat16
    tokens = 48 if a.smoke else a.tokens
    weights = {"qkv": ((hq + 2 * hkv) * d, h), "o": (h, hq * d), "gate_up": (2 * inter, h), "down": (h, inter)}
    w = {k: (mx.random.normal(s) * 0.02).astype(dtype) for k, s in weights.items()}
    norm_w = mx.ones((h,), dtype)
    q_norm, k_norm = nn.RMSNorm(d), nn.RMSNorm(d)
    on_cuda = mx.default_device().type == mx.gpu and not mx.metal.is_available()
    fused = cuda_fused.select_fused_kernels("cuda" if on_cuda else "cpu", dtype, qk_heads=(hq, hkv, d))
    blocks, block_size = 64 if a.smoke else 2048, 16
    k_cache = mx.zeros((blocks, block_size, hkv, d), dtype)
    vocab = mx.random.normal((2048 if a.smoke else 151936, h)).astype(dtype)
    mx.eval(w, norm_w, k_cache, vocab)

    def ops(t: int) -> dict:
        """name -> a function building that op's output for `t` tokens (inputs built outside the timing)."""
        x = mx.random.normal((t, h)).astype(dtype)
        inner = mx.random.normal((t, inter)).astype(dtype)
        gate_up = mx.random.normal((t, 2 * inter)).astype(dtype)
        qkv = mx.random.normal((t, hq + 2 * hkv, d)).astype(dtype)
        cos, sin = mx.cos(mx.arange(t * d).reshape(t, d) * 1e-3), mx.sin(mx.arange(t * d).reshape(t, d) * 1e-3)
        cos, sin = cos.astype(dtype), sin.astype(dtype)
        idx = mx.array(list(range(t))[::-1])
        ids = mx.random.randint(0, vocab.shape[0], (t,))
        meta = SimpleNamespace(num_tokens=t, block_size=block_size, slot_mapping=mx.arange(t) % (blocks * block_size))
        groups, q_len = 4, t // 4
        qg = mx.random.normal((groups, hq, q_len, d)).astype(dtype)
        kg = mx.random.normal((groups, hkv, q_len + 16, d)).astype(dtype)
        visible = mx.where(mx.arange(q_len + 16)[None, :] <= mx.arange(q_len)[:, None] + 16, 0.0, -float("inf"))
        visible = mx.broadcast_to(visible.astype(dtype), (groups, 1, q_len, q_len + 16))
        mx.eval(x, inner, gate_up, qkv, cos, sin, idx, ids, meta.slot_mapping, qg, kg, visible)
        q1 = qkv[None, :, :hq].transpose(0, 2, 1, 3)
        k1 = qkv[None, :, hq:hq + hkv].transpose(0, 2, 1, 3)
        built = {f"gemm_{k}": (lambda k=k, x=x, inner=inner: (inner if k == "down" else x) @ w[k].T) for k in w}
        built.update({
            "rms_norm": lambda: mx.fast.rms_norm(x, norm_w, 1e-6),
            "swiglu": lambda: swiglu_halves(gate_up),
            "rope_compiled": lambda: rope_heads(mx.contiguous(qkv[:, :hq]), hq, cos[:, None], sin[:, None]),
            "take_rows": lambda: take_rows(qkv, idx),
            "embed_take": lambda: mx.take(vocab, ids, axis=0),
            "deepstack_add": lambda: x.at[idx[: t // 2]].add(x[: t // 2]),
            "write_kv": lambda: write_kv(k_cache, k_cache, qkv[:, :hkv], qkv[:, hkv:2 * hkv], meta)[0],
            "sdpa_causal": lambda: mx.fast.scaled_dot_product_attention(q1, k1, k1, scale=d ** -0.5, mask="causal"),
            "sdpa_masked": lambda: mx.fast.scaled_dot_product_attention(qg, kg, kg, scale=d ** -0.5, mask=visible),
        })
        if fused.qk_norm_rope is not None:
            built["qk_norm_rope_kernel"] = lambda: fused.qk_norm_rope(qkv, hq, hkv, q_norm, k_norm, cos, sin)
        return built

    warm = ops(tokens - 16)   # every op once (kernels compiled, libraries loaded) before any size is counted
    for build in warm.values():
        first_and_again(mx, build, repeats=1)
    rows: dict[str, list] = {}
    for i in range(a.sizes):
        t = tokens + 8 * i + 4   # a multiple of four for the padded groups
        for name, build in ops(t).items():
            first, again = first_and_again(mx, build)
            rows.setdefault(name, []).append({"tokens": t, "first_ms": first, "again_ms": again})
    report = {"model": a.model, "device": str(mx.default_device()), "tokens": tokens, "ops": {}}
    print(f"{'op':<22}{'first ms':>10}{'again ms':>10}{'extra ms':>10}   (medians over {a.sizes} fresh sizes)")
    for name, runs in rows.items():
        first = statistics.median(r["first_ms"] for r in runs)
        again = statistics.median(r["again_ms"] for r in runs)
        report["ops"][name] = {"first_ms": first, "again_ms": again, "extra_ms": first - again, "runs": runs}
        print(f"{name:<22}{first:>10.2f}{again:>10.2f}{first - again:>10.2f}")
    if a.json:
        a.json.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
