"""Time alternative formulations of the engine's memory-bound steps on the GPU at the 7B/8B shapes, to choose what the
engine uses. Sections (`--sections`): `upload` (float32 patches vs patch bytes, a second stream), `vrope` (rotate-
half with a concatenation vs a pair swap; SDPA on strided vs contiguous inputs), `gelu`, `lm` (q/k norms, rotary, KV
write), `v2` (Qwen3-VL's head_dim 72, GELU in fp32, fused norm + rotary), `v3` (the q/k RMSNorm's row reduction),
`kv` (the KV scatter in bf16 vs as 32-bit words), `upload_ab` (the engine end to end with patch bytes through
managed memory vs a file in shared memory), `fused` (engine/cuda_fused.py's kernel vs the portable form; the KV
scatter as 32-bit words), `tower_batch` (a step's 8 clips through the vision tower one by one vs in groups of 2, 4
and 8 in one planned forward). Prints ms per call (medians of 5) and writes gpu_probe_ops.json.

    python3 scripts/gpu_probe_ops.py --out DIR [--sections ...] [--small]
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchlib.timing import ms_per_call  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, default=Path("."))
    ap.add_argument("--small", action="store_true", help="tiny shapes (checks the script on CPU)")
    ap.add_argument("--sections", nargs="+", default=["upload", "vrope", "gelu", "lm", "v2"])
    args = ap.parse_args()
    import mlx.core as mx
    import mlx.nn as nn

    from batchjob.engine.fused_ops import rotate_half_rope
    from batchjob.engine.patchify import _byte_offsets, normalize_table

    bf = mx.bfloat16
    div = 16 if args.small else 1
    rows: dict[str, float] = {}

    def t(name, fn, inner=10):
        rows[name] = round(ms_per_call(fn, inner=inner, repeats=5), 4)
        print(f"{name:60s} {rows[name]:9.4f} ms", flush=True)

    rng = np.random.default_rng(0)
    table = normalize_table((0.48, 0.46, 0.41), (0.27, 0.26, 0.28))
    tbl32 = mx.array(table.reshape(-1))
    tbl16 = tbl32.astype(bf)

    @mx.compile
    def pair_swap_rope(x5, cos, sin_signed):
        """x5 [..., 2, half]: out = x * cos + swap(x) * (-sin, sin); no concatenation."""
        return (x5 * cos + x5[..., ::-1, :] * sin_signed).astype(x5.dtype)

    # --- upload: one clip's patches (Qwen2.5-VL 8192 x 1176; Qwen3-VL 6272 x 1536)
    if "upload" in args.sections:
        for tag, (n, w) in {"q25": (8192 // div, 1176), "q3": (6272 // div, 1536)}.items():
            u8 = rng.integers(0, 256, (n, w), dtype=np.uint8)
            f32 = table.reshape(-1)[u8 + _byte_offsets(w, 3)]
            offs = mx.array(_byte_offsets(w, 3))
            t(f"upload.{tag}.float32_then_bf16", lambda: mx.array(f32).astype(bf))
            t(f"upload.{tag}.bytes_take_f32_then_bf16",
              lambda: mx.take(tbl32, mx.array(u8).astype(mx.uint32) + offs).astype(bf))
            t(f"upload.{tag}.bytes_take_bf16", lambda: mx.take(tbl16, mx.array(u8).astype(mx.uint32) + offs))
            t(f"upload.{tag}.bytes_only_touch", lambda: mx.array(u8) + 1)
            shm = Path("/dev/shm/probe_u8.npy")
            np.save(shm, u8)
            t(f"upload.{tag}.bytes_via_mx_load", lambda: mx.take(tbl16, mx.load(str(shm)).astype(mx.uint32) + offs))
            # overlap: a tower-sized matmul chain on the default stream, the upload on a second stream
            side = mx.new_stream(mx.default_device())
            a = mx.random.normal((n, 1280)).astype(bf)
            wts = [mx.random.normal((1280, 1280)).astype(bf) * 0.03 for _ in range(4)]
            mx.eval(a, wts)

            def chain():
                h = a
                for _ in range(1 if args.small else 24):
                    for wt in wts:
                        h = h @ wt
                return h

            def up_side():
                with mx.stream(side):
                    return mx.take(tbl16, mx.array(u8).astype(mx.uint32) + offs)

            t(f"overlap.{tag}.compute_alone", chain, inner=2)
            t(f"overlap.{tag}.upload_side_alone", up_side, inner=2)
            t(f"overlap.{tag}.compute_plus_upload_side", lambda: [chain(), up_side()], inner=2)
            t(f"overlap.{tag}.compute_plus_upload_same", lambda: [chain(), mx.take(
                tbl16, mx.array(u8).astype(mx.uint32) + offs)], inner=2)

    # --- vision rotary (q/k of the stacked qkv), SDPA on the layouts it can get
    if "vrope" in args.sections:
        for tag, (n, h, d) in {"q25": (8192 // div, 16, 80), "q3": (6272 // div, 16, 72)}.items():
            qkv = mx.random.normal((n, 3, h, d)).astype(bf)
            ang = mx.random.uniform(shape=(n, d // 2)) * 6.0
            cos = mx.concatenate([mx.cos(ang)] * 2, -1)[:, None, None, :]
            sin = mx.concatenate([mx.sin(ang)] * 2, -1)[:, None, None, :]
            c5 = mx.cos(ang)[:, None, None, None, :]
            s5 = mx.stack([-mx.sin(ang), mx.sin(ang)], axis=-2)[:, None, None]
            mx.eval(qkv, cos, sin, c5, s5)
            t(f"vrope.{tag}.rotate_half_concat", lambda: rotate_half_rope(qkv[:, :2], cos, sin))
            x5 = qkv.reshape(n, 3, h, 2, d // 2)
            t(f"vrope.{tag}.pair_swap", lambda: pair_swap_rope(x5[:, :2], c5, s5))
            ref = rotate_half_rope(qkv[:, :2], cos, sin)
            got = pair_swap_rope(x5[:, :2], c5, s5).reshape(ref.shape)
            diff = mx.abs(ref.astype(mx.float32) - got.astype(mx.float32)).max()
            rows[f"vrope.{tag}.pair_swap_max_abs_diff"] = float(diff)
            # transposed output: (2, heads, tokens, 2, half) contiguous = q and k as SDPA's [B, H, L, D]
            xt = x5.transpose(1, 2, 0, 3, 4)
            c5t, s5t = c5.transpose(1, 2, 0, 3, 4), s5.transpose(1, 2, 0, 3, 4)
            t(f"vrope.{tag}.pair_swap_head_major_out", lambda: pair_swap_rope(xt[:2], c5t, s5t))
            groups = 8
            L = n // groups
            q = mx.random.normal((groups, h, L, d)).astype(bf)
            mx.eval(q)
            t(f"vsdpa.{tag}.contiguous_BHLD", lambda: mx.fast.scaled_dot_product_attention(q, q, q, scale=0.1))
            tok = mx.random.normal((groups, L, h, d)).astype(bf)
            mx.eval(tok)
            tv = tok.transpose(0, 2, 1, 3)
            t(f"vsdpa.{tag}.strided_from_BLHD", lambda: mx.fast.scaled_dot_product_attention(tv, tv, tv, scale=0.1))
            hm = mx.random.normal((h, n, d)).astype(bf)
            mx.eval(hm)
            hv = hm.reshape(h, groups, L, d).transpose(1, 0, 2, 3)
            t(f"vsdpa.{tag}.strided_from_HTD", lambda: mx.fast.scaled_dot_product_attention(hv, hv, hv, scale=0.1))
            o = mx.fast.scaled_dot_product_attention(q, q, q, scale=0.1)
            t(f"vsdpa.{tag}.out_transpose_copy", lambda: o.transpose(0, 2, 1, 3).reshape(n, h * d) + 0)

    # --- GELU on Qwen3-VL's vision MLP (6272 x 4352)
    if "gelu" in args.sections:
        g = mx.random.normal((6272 // div, 4352)).astype(bf)
        mx.eval(g)

        @mx.compile
        def gelu_tanh_cube(x):
            return 0.5 * x * (1 + mx.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * (x * x * x))))

        @mx.compile
        def gelu_erf(x):
            return x * (1 + mx.erf(x / math.sqrt(2))) / 2

        t("gelu.mlx_gelu_approx_shapeless", lambda: nn.gelu_approx(g))
        t("gelu.mlx_gelu_erf_shapeless", lambda: nn.gelu(g))
        t("gelu.compiled_tanh_cube", lambda: gelu_tanh_cube(g))
        t("gelu.compiled_erf", lambda: gelu_erf(g))
        t("gelu.copy_baseline", lambda: g + 1)
        rows["gelu.tanh_cube_vs_mlx_max_abs_diff"] = float(mx.abs(gelu_tanh_cube(g).astype(mx.float32)
                                                                 - nn.gelu_approx(g).astype(mx.float32)).max())

    # --- LM: q/k norms + rotary (Qwen3 T=13896, 32/8 heads; Qwen2.5 T=16952, 28/4 heads), KV write
    if "lm" in args.sections:
        for tag, (T, hq, hkv) in {"q3": (13896 // div, 32, 8), "q25": (16952 // div, 28, 4)}.items():
            d = 128
            qkv = mx.random.normal((T, hq + 2 * hkv, d)).astype(bf)
            ang = mx.random.uniform(shape=(T, d // 2)) * 6.0
            cos = mx.concatenate([mx.cos(ang)] * 2, -1)[:, None, :]
            sin = mx.concatenate([mx.sin(ang)] * 2, -1)[:, None, :]
            c4 = mx.cos(ang)[:, None, None, :]
            s4 = mx.stack([-mx.sin(ang), mx.sin(ang)], axis=-2)[:, None]
            wq, wk = mx.random.uniform(shape=(d,)).astype(bf), mx.random.uniform(shape=(d,)).astype(bf)
            w_qk = mx.concatenate([mx.broadcast_to(wq, (hq, d)), mx.broadcast_to(wk, (hkv, d))])
            w_qk = w_qk.reshape(hq + hkv, 2, d // 2)
            mx.eval(qkv, cos, sin, c4, s4, w_qk)
            q, k, v = qkv[:, :hq], qkv[:, hq:hq + hkv], qkv[:, hq + hkv:]
            if tag == "q3":
                t(f"lm.{tag}.qk_norm_separate", lambda: [mx.fast.rms_norm(q, wq, 1e-6), mx.fast.rms_norm(k, wk, 1e-6)])
                t(f"lm.{tag}.qk_norm_one_call_noweight", lambda: mx.fast.rms_norm(qkv[:, :hq + hkv], None, 1e-6))
                t(f"lm.{tag}.qk_norm_contig_input", lambda: mx.fast.rms_norm(qkv, None, 1e-6))
            t(f"lm.{tag}.rope_concat_q_and_k", lambda: [rotate_half_rope(q, cos, sin), rotate_half_rope(k, cos, sin)])
            x4 = qkv.reshape(T, hq + 2 * hkv, 2, d // 2)
            t(f"lm.{tag}.rope_pair_swap_qk_one_call", lambda: pair_swap_rope(x4[:, :hq + hkv], c4, s4))

            @mx.compile
            def norm_w_rope(n4, w, cos4, sin4):
                y = n4 * w
                return (y * cos4 + y[..., ::-1, :] * sin4).astype(n4.dtype)

            if tag == "q3":
                t(f"lm.{tag}.norm_then_weight_rope_fused", lambda: norm_w_rope(
                    mx.fast.rms_norm(qkv[:, :hq + hkv], None, 1e-6).reshape(T, hq + hkv, 2, d // 2), w_qk, c4, s4))
            # KV write: scatter into a realistic cache (about 1 GB per layer), slots contiguous per sequence
            bs = 16
            nb = max(T // bs * 4, 4096 // div)
            kc = mx.zeros((nb, bs, hkv, d), dtype=bf)
            vc = mx.zeros((nb, bs, hkv, d), dtype=bf)
            mx.eval(kc, vc)
            slots = mx.array(np.arange(T, dtype=np.int32) + 64 * bs)
            state = {"k": kc, "v": vc}
            kk = mx.contiguous(k)
            mx.eval(kk)

            def scatter():
                kf = state["k"].reshape(nb * bs, hkv, d)
                vf = state["v"].reshape(nb * bs, hkv, d)
                kf[slots] = kk
                vf[slots] = v
                state["k"], state["v"] = kf.reshape(nb, bs, hkv, d), vf.reshape(nb, bs, hkv, d)
                return [state["k"], state["v"]]

            t(f"lm.{tag}.kv_write_scatter", scatter, inner=1)

            def slice_update():
                kf = state["k"].reshape(nb * bs, hkv, d)
                vf = state["v"].reshape(nb * bs, hkv, d)
                kf = mx.slice_update(kf, kk, mx.array([64 * bs]), axes=(0,))
                vf = mx.slice_update(vf, v, mx.array([64 * bs]), axes=(0,))
                state["k"], state["v"] = kf.reshape(nb, bs, hkv, d), vf.reshape(nb, bs, hkv, d)
                return [state["k"], state["v"]]

            t(f"lm.{tag}.kv_write_one_slice_update", slice_update, inner=1)
            t(f"lm.{tag}.sync_only", lambda: [kk + 0], inner=1)
            del state, kc, vc

    if "v2" in args.sections:   # second round: what the first left open
        import io

        n, w = 8192 // div, 1176
        u8 = rng.integers(0, 256, (n, w), dtype=np.uint8)
        offs = mx.array(_byte_offsets(w, 3))

        def via_bytesio():
            buf = io.BytesIO()
            np.save(buf, u8)
            buf.seek(0)
            return mx.take(tbl16, mx.load(buf, format="npy").astype(mx.uint32) + offs)

        t("v2.upload.q25.bytes_via_bytesio_load", via_bytesio)
        t("v2.upload.q25.bytes_take_bf16", lambda: mx.take(tbl16, mx.array(u8).astype(mx.uint32) + offs))
        # Qwen3-VL vision rotary (head_dim 72): layouts
        n, h, d = 6272 // div, 16, 72
        qkv = mx.random.normal((n, 3, h, d)).astype(bf)
        ang = mx.random.uniform(shape=(n, d // 2)) * 6.0
        cos = mx.concatenate([mx.cos(ang)] * 2, -1)[:, None, None, :]
        sin = mx.concatenate([mx.sin(ang)] * 2, -1)[:, None, None, :]
        qk_c = mx.contiguous(qkv[:, :2])
        mx.eval(qkv, cos, sin, qk_c)
        c5, s5 = cos.reshape(n, 1, 1, 2, d // 2), sin.reshape(n, 1, 1, 2, d // 2)
        sign = mx.array([[-1.0], [1.0]])

        @mx.compile
        def swap_sign(x5, c, s, sg):
            return (x5 * c + x5[..., ::-1, :] * (s * sg)).astype(x5.dtype)

        t("v2.vrope.q3.concat_strided", lambda: rotate_half_rope(qkv[:, :2], cos, sin))
        t("v2.vrope.q3.concat_contiguous", lambda: rotate_half_rope(qk_c, cos, sin))
        x5 = qkv.reshape(n, 3, h, 2, d // 2)
        t("v2.vrope.q3.pair_swap_full_tables", lambda: swap_sign(x5[:, :2], c5, s5, sign))
        t("v2.vrope.q3.pair_swap_contiguous", lambda: swap_sign(qk_c.reshape(n, 2, h, 2, d // 2), c5, s5, sign))
        xi = qkv.reshape(n, 3, h, d // 2, 2)   # pairs adjacent (q/k weight rows permuted at load)
        ci = mx.stack([mx.cos(ang)] * 2, -1)[:, None, None]
        si = mx.stack([-mx.sin(ang), mx.sin(ang)], -1)[:, None, None]
        mx.eval(ci, si)

        @mx.compile
        def adjacent_swap(x, c, s):
            return (x * c + x[..., ::-1] * s).astype(x.dtype)

        t("v2.vrope.q3.adjacent_pairs", lambda: adjacent_swap(xi[:, :2], ci, si))
        x25 = mx.random.normal((8192 // div, 3, 16, 80)).astype(bf)
        ang25 = mx.random.uniform(shape=(8192 // div, 40)) * 6.0
        c25 = mx.concatenate([mx.cos(ang25)] * 2, -1).reshape(-1, 1, 1, 2, 40)
        s25 = mx.concatenate([mx.sin(ang25)] * 2, -1).reshape(-1, 1, 1, 2, 40)
        mx.eval(x25, c25, s25)
        t("v2.vrope.q25.pair_swap_full_tables", lambda: swap_sign(x25.reshape(-1, 3, 16, 2, 40)[:, :2], c25, s25,
                                                                   sign))
        # GELU (tanh) computed in fp32 inside one compiled kernel
        g = mx.random.normal((6272 // div, 4352)).astype(bf)
        mx.eval(g)

        @mx.compile
        def gelu_tanh_f32(x):
            xf = x.astype(mx.float32)
            return (0.5 * xf * (1 + mx.tanh(math.sqrt(2 / math.pi) * (xf + 0.044715 * (xf * xf * xf))))).astype(x.dtype)

        t("v2.gelu.tanh_f32_inside", lambda: gelu_tanh_f32(g))
        # Qwen3 LM: q/k RMSNorm + rotary fused (a row reduction, then one elementwise kernel)
        T, hq, hkv, d = 13896 // div, 32, 8, 128
        qkv = mx.random.normal((T, hq + 2 * hkv, d)).astype(bf)
        ang = mx.random.uniform(shape=(T, d // 2)) * 6.0
        cos = mx.concatenate([mx.cos(ang)] * 2, -1)[:, None, :]
        sin = mx.concatenate([mx.sin(ang)] * 2, -1)[:, None, :]
        wq, wk = mx.random.uniform(shape=(d,)).astype(bf), mx.random.uniform(shape=(d,)).astype(bf)
        mx.eval(qkv, cos, sin, wq, wk)
        c4, s4 = cos.reshape(T, 1, 2, d // 2), sin.reshape(T, 1, 2, d // 2)

        @mx.compile
        def norm_rope(x4, r, w4, c, s, sg):
            y = (x4 * r).astype(x4.dtype) * w4
            return (y * c + y[..., ::-1, :] * (s * sg)).astype(x4.dtype)

        def fused(x, w):
            r = mx.rsqrt(mx.mean(mx.square(x.astype(mx.float32)), axis=-1, keepdims=True) + 1e-6)
            return norm_rope(x.reshape(*x.shape[:-1], 2, d // 2), r[..., None], w.reshape(2, d // 2), c4, s4, sign)

        q, k = qkv[:, :hq], qkv[:, hq:hq + hkv]
        t("v2.lm.q3.norm_rope_fused_q_and_k", lambda: [fused(q, wq), fused(k, wk)])
        t("v2.lm.q3.norm_then_pair_swap", lambda: [
            swap_sign(mx.fast.rms_norm(q, wq, 1e-6).reshape(T, hq, 2, d // 2), c4, s4, sign),
            swap_sign(mx.fast.rms_norm(k, wk, 1e-6).reshape(T, hkv, 2, d // 2), c4, s4, sign)])
        t("v2.lm.q3.rms_reduce_only", lambda: mx.mean(mx.square(qkv[:, :hq + hkv].astype(mx.float32)), axis=-1))
        ref = [mx.fast.rms_norm(q, wq, 1e-6), mx.fast.rms_norm(k, wk, 1e-6)]
        got = [fused(q, wq), fused(k, wk)]
        refr = [rotate_half_rope(ref[0], cos, sin), rotate_half_rope(ref[1], cos, sin)]
        rows["v2.lm.q3.norm_rope_fused_max_abs_diff"] = max(float(mx.abs(
            a.astype(mx.float32) - b.reshape(a.shape).astype(mx.float32)).max()) for a, b in zip(refr, got))

    if "v3" in args.sections:   # Qwen3 LM q/k RMSNorm: the row reduction over 128-wide rows
        T, hq, hkv, d = 13896 // div, 32, 8, 128
        qkv = mx.random.normal((T, hq + 2 * hkv, d)).astype(bf)
        w = mx.random.uniform(shape=(d,)).astype(bf)
        ones32, ones16 = mx.ones((d, 1)), mx.ones((d, 1), dtype=bf)
        qk_c = mx.contiguous(qkv[:, :hq + hkv])
        mx.eval(qkv, w, qk_c, ones32, ones16)
        qk = qkv[:, :hq + hkv]
        t("v3.rms.fast_rms_norm_strided", lambda: mx.fast.rms_norm(qk, w, 1e-6))
        t("v3.rms.fast_rms_norm_contiguous", lambda: mx.fast.rms_norm(qk_c, w, 1e-6))
        t("v3.rms.fast_rms_norm_flat_2d", lambda: mx.fast.rms_norm(qk_c.reshape(-1, d), w, 1e-6))
        t("v3.rms.sum_sq_reduce_f32", lambda: mx.sum(mx.square(qk_c.astype(mx.float32)), axis=-1))
        t("v3.rms.sum_sq_gemv_f32", lambda: mx.square(qk_c.astype(mx.float32)).reshape(-1, d) @ ones32)
        t("v3.rms.sum_sq_gemv_bf16", lambda: mx.square(qk_c).reshape(-1, d) @ ones16)
        t("v3.rms.copy_baseline", lambda: qk_c + 1)
        ref = mx.sum(mx.square(qk_c.astype(mx.float32)), axis=-1).reshape(-1)
        got = (mx.square(qk_c.astype(mx.float32)).reshape(-1, d) @ ones32).reshape(-1)
        rows["v3.rms.gemv_f32_max_rel_diff"] = float((mx.abs(ref - got) / ref).max())

    if "upload_ab" in args.sections:   # the engine end to end, patch bytes up through managed memory vs a file
        import tempfile as _tf

        from batchjob.engine import patchify
        from batchjob.synthetic.random_engine import SHAPES
        from benchlib.workload import build_model, fresh, make_workload

        for model_type in ("qwen2_5_vl", "qwen3_vl"):
            dims = dict(SHAPES[model_type][1 if args.small else 0])
            engine = dict(device="auto" if args.small else "gpu", max_model_len=8192)
            bench = build_model(model_type, dims, 4, dims["v_depth"], 16, (448, 448), Path(_tf.mkdtemp()),
                                "float32" if args.small else "bfloat16", engine)
            work = make_workload(bench, rng, 4 if args.small else 48, 4, 16, (448, 448), "ab")
            real = patchify.upload_bytes
            times: dict = {"array": [], "file": []}
            for i in range(7):
                for route in ("array", "file"):
                    patchify.upload_bytes = (lambda b, r=route, **k: real(b, via_file=(r == "file"), **k))
                    t0 = time.perf_counter()
                    out = bench.classifier.classify(fresh(work, f"{route}{i}"))
                    if i:   # the first round warms both
                        times[route].append(time.perf_counter() - t0)
                    assert all(o.error is None for o in out)
            patchify.upload_bytes = real
            for route, ts in times.items():
                rows[f"upload_ab.{model_type}.e2e_{route}_s"] = round(float(np.median(ts)), 4)
                print(f"upload_ab.{model_type}.e2e_{route}_s {np.median(ts):.4f} {[round(x, 3) for x in ts]}",
                      flush=True)
            del bench

    if "kv" in args.sections:   # the KV write: a bf16 scatter vs the same bytes scattered as wider words
        for tag, (T, hq, hkv) in {"q3": (13896 // div, 32, 8), "q25": (16952 // div, 28, 4)}.items():
            d, bs = 128, 16
            nb = max(T // bs * 4, 4096 // div)
            qkv = mx.random.normal((T, hq + 2 * hkv, d)).astype(bf)
            kc, vc = mx.zeros((nb, bs, hkv, d), dtype=bf), mx.zeros((nb, bs, hkv, d), dtype=bf)
            perm = np.random.default_rng(1).permutation(nb)[: -(-T // bs)]
            slots_np = (perm[np.arange(T) // bs] * bs + np.arange(T) % bs).astype(np.int32)
            slots = mx.array(slots_np)
            mx.eval(qkv, kc, vc, slots)
            k, v = qkv[:, hq:hq + hkv], qkv[:, hq + hkv:]   # strided views, as the layer has them
            state = {"k": kc, "v": vc}

            def write(word):
                def run():
                    out = []
                    for name, new in (("k", k), ("v", v)):
                        flat = state[name].reshape(nb * bs, hkv * d)
                        if word is None:
                            flat[slots] = new.reshape(T, hkv * d)
                        else:
                            flat = flat.view(word)
                            flat[slots] = mx.contiguous(new).reshape(T, hkv * d).view(word)
                            flat = flat.view(bf)
                        state[name] = flat.reshape(nb, bs, hkv, d)
                        out.append(state[name])
                    return out
                return run

            for word, label in ((None, "bf16"), (mx.uint32, "u32")):
                try:
                    t(f"kv.{tag}.scatter_{label}", write(word), inner=1)
                except Exception as exc:   # a dtype the backend cannot scatter
                    rows[f"kv.{tag}.scatter_{label}_error"] = f"{type(exc).__name__}: {exc}"[:200]
            ref = np.array(write(None)()[0].astype(mx.float32))
            got = np.array(write(mx.uint32)()[0].astype(mx.float32))   # (MLX's GPU scatter has no uint64)
            rows[f"kv.{tag}.u32_equal"] = bool(np.array_equal(ref, got))
            t(f"kv.{tag}.sync_only", lambda: [k + 0], inner=1)
            del state, kc, vc

    # --- fused: the hand-written CUDA kernels (cuda_fused.py, vision_rope.py) vs the portable forms, and the KV scatter
    # through 32-bit words
    if "fused" in args.sections:
        from batchjob.engine import cuda_fused, kernel_build
        start = time.perf_counter()
        kernels = cuda_fused.select_fused_kernels("cuda", bf)
        rows["fused.select_s"] = round(time.perf_counter() - start, 3)
        rows["fused.summary"] = kernels.summary()
        print(kernels.summary(), flush=True)
        qk_kernel = cuda_fused.qk_norm_rope_with(cuda_fused._qk_norm_rope_kernel())
        from batchjob.engine import vision_rope
        from batchjob.engine.vision_attention import rope_tables, rotated_qkv
        vision_kernel = vision_rope.vision_rope_with(vision_rope.build_kernel())
        for tag, (n, heads, d) in {"v25": (8192 // div, 16, 80), "v3": (6272 // div, 16, 80)}.items():
            qkv = (mx.random.normal((n, 3 * heads * d)) * 2).astype(bf)
            tables = rope_tables(mx.random.uniform(0, 40, (n, d // 2)))
            mx.eval(qkv, tables.cos, tables.sin, *tables.halves)
            t(f"fused.{tag}.vision_rope_portable", lambda: rotated_qkv(qkv, heads, d, tables)[:2])   # none active
            t(f"fused.{tag}.vision_rope_kernel", lambda: vision_kernel(qkv, heads, d, *tables.halves))
            rows[f"fused.{tag}.vision_rope_ulps"] = kernel_build.ulps_apart(
                vision_kernel(qkv, heads, d, *tables.halves), mx.stack(rotated_qkv(qkv, heads, d, tables)[:2], axis=1),
                bf)
            del qkv
        for tag, (T, hq, hkv) in {"q25": (16952 // div, 28, 4), "q3": (13896 // div, 32, 8)}.items():
            d = 128
            qkv = (mx.random.normal((T, hq + 2 * hkv, d)) * 2).astype(bf)
            ang = mx.random.uniform(0, 6.3, (T, d // 2))
            cos2 = mx.concatenate([mx.cos(ang)] * 2, axis=1).astype(bf)
            sin2 = mx.concatenate([mx.sin(ang)] * 2, axis=1).astype(bf)
            qn = cuda_fused._Norm((mx.random.normal((d,)) * 0.3 + 1).astype(bf), 1e-6)
            kn = cuda_fused._Norm((mx.random.normal((d,)) * 0.3 + 1).astype(bf), 1e-6)
            from batchjob.engine.fused_ops import split_tables
            tables = split_tables(cos2[:, None, :], sin2[:, None, :])
            mx.eval(qkv, cos2, sin2, qn.weight, kn.weight, tables.cos, tables.sin)
            t(f"fused.{tag}.qk_norm_rope_portable",
              lambda: cuda_fused.portable_qk_norm_rope(qkv, hq, hkv, qn, kn, cos2, sin2, tables))
            t(f"fused.{tag}.qk_norm_rope_kernel", lambda: qk_kernel(qkv, hq, hkv, qn, kn, cos2, sin2))
            rows[f"fused.{tag}.qk_norm_rope_ulps"] = kernel_build.ulps_apart(
                qk_kernel(qkv, hq, hkv, qn, kn, cos2, sin2),
                cuda_fused.portable_qk_norm_rope(qkv, hq, hkv, qn, kn, cos2, sin2, tables), bf)
            # KV write: the scatter as bf16 elements vs 32-bit words, small and large caches
            k_new = mx.contiguous(qkv[:, hq:hq + hkv])
            mx.eval(k_new)
            for blocks_per_token, label in ((1, "cache1x"), (8, "cache8x")):
                bs = 16
                nb = max(T * blocks_per_token // bs, 64)
                state = {"k": mx.zeros((nb, bs, hkv, d), dtype=bf)}
                mx.eval(state["k"])
                slots = mx.array(np.arange(T, dtype=np.int32))

                def write(word, state=state, nb=nb, bs=bs, slots=slots):
                    def run():
                        flat = state["k"].reshape(nb * bs, hkv * d)
                        if word is None:
                            flat[slots] = k_new.reshape(T, hkv * d)
                        else:
                            flat = flat.view(word)
                            flat[slots] = k_new.reshape(T, hkv * d).view(word)
                            flat = flat.view(bf)
                        state["k"] = flat.reshape(nb, bs, hkv, d)
                        return [state["k"]]
                    return run

                for word, wl in ((None, "bf16"), (mx.uint32, "u32")):
                    try:
                        t(f"fused.{tag}.kv_{label}_{wl}", write(word), inner=1)
                    except Exception as exc:
                        rows[f"fused.{tag}.kv_{label}_{wl}_error"] = f"{type(exc).__name__}: {exc}"[:200]
                try:
                    ref = np.array(write(None)()[0].astype(mx.float32))
                    got = np.array(write(mx.uint32)()[0].astype(mx.float32))
                    rows[f"fused.{tag}.kv_{label}_u32_equal"] = bool(np.array_equal(ref, got))
                except Exception as exc:
                    rows[f"fused.{tag}.kv_{label}_u32_equal_error"] = f"{type(exc).__name__}: {exc}"[:200]
                del state
            del qkv

    # --- tower_batch: a step's clips through the vision tower one by one (each started with async_eval, as the
    # classifier runs them) vs concatenated into one planned forward over all their grids
    if "tower_batch" in args.sections:
        import tempfile as _tf

        from batchjob.engine.patchify import device_pixels
        from batchjob.engine.qwen3_vision import encode_qwen3
        from batchjob.engine.qwen25_vision import encode_qwen25
        from batchjob.synthetic.random_engine import SHAPES
        from benchlib.workload import build_model, make_workload

        for model_type in ("qwen2_5_vl", "qwen3_vl"):
            dims = dict(SHAPES[model_type][1 if args.small else 0])
            engine = dict(device="auto" if args.small else "gpu", max_model_len=8192)
            bench = build_model(model_type, dims, 1, dims["v_depth"], 16, (448, 448), Path(_tf.mkdtemp()),
                                "float32" if args.small else "bfloat16", engine)
            ckpt = bench.checkpoint
            tower, dtype = ckpt.model.vision_tower, ckpt.dtype
            work = make_workload(bench, rng, 8, 1, 16, (448, 448), "tb")
            clips = [r.clip.inputs for r in work]

            def singles():
                out = []
                for inputs in clips:
                    out.append(ckpt.encode_clip(inputs))
                    mx.async_eval(out[-1])
                return out

            def batched(count):
                def run():
                    outs = []
                    for start in range(0, len(clips), count):
                        group = clips[start:start + count]
                        pixels = mx.concatenate([device_pixels(c) for c in group]).astype(dtype)
                        grids = [tuple(c.grid_thw) for c in group]
                        if model_type == "qwen3_vl":
                            features, deep = encode_qwen3(tower, pixels, grids)
                            outs.append(mx.concatenate([features, *deep], axis=-1))
                        else:
                            outs.append(encode_qwen25(tower, pixels, grids))
                        mx.async_eval(outs[-1])
                    return outs
                return run

            t(f"tower_batch.{model_type}.singles_8", singles, inner=2)
            for count in (2, 4, 8):
                t(f"tower_batch.{model_type}.batched_{count}x{8 // count}", batched(count), inner=2)
            one = mx.concatenate(singles(), axis=0)
            together = mx.concatenate(batched(8)(), axis=0)
            rows[f"tower_batch.{model_type}.max_abs_diff"] = float(mx.max(mx.abs(
                one.astype(mx.float32) - together.astype(mx.float32))).item())
            rows[f"tower_batch.{model_type}.max_abs"] = float(mx.max(mx.abs(one.astype(mx.float32))).item())
            del bench, ckpt, tower, work, clips

    env = {"device": str(mx.default_device()), "mlx": mx.__version__, "time": time.strftime("%Y-%m-%d %H:%M:%S")}
    try:
        import subprocess
        env["gpu"] = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
                                    capture_output=True, text=True).stdout.strip()
    except OSError:
        pass
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "gpu_probe_ops.json").write_text(json.dumps({"environment": env, "ms": rows,
                                                             "command": " ".join(sys.argv)}, indent=1))
    print(json.dumps(env))


if __name__ == "__main__":
    main()
