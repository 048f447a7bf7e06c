"""Session 18 probe: ceiling methods, KV scatter word width, addmm residual, SwiGLU layouts (Qwen3/Qwen2.5 shapes)."""
import json
import sys
import time

import mlx.core as mx
import numpy as np

sys.path.insert(0, "scripts")
from benchlib.timing import ms_per_call  # noqa: E402

out = {}
bf = mx.bfloat16


def rec(k, v):
    out[k] = v
    print(f"{k}: {v}", flush=True)


# 1. ceilings
n = 8192
a = mx.random.normal((n, n)).astype(bf)
b = mx.random.normal((n, n)).astype(bf)
mx.eval(a, b)
for _ in range(3):
    mx.eval(a @ b)
for trial in range(3):
    ts = []
    for _ in range(10):
        t0 = time.perf_counter()
        mx.eval(a @ b)
        ts.append(time.perf_counter() - t0)
    rec(f"ceiling.synced.{trial}", 2 * n**3 / float(np.median(ts)) / 1e12)
for _ in range(20):
    mx.eval([a @ b for _ in range(5)])
for trial in range(3):
    ms = ms_per_call(lambda: a @ b, inner=10, repeats=5)
    rec(f"ceiling.queued.{trial}", 2 * n**3 / (ms / 1e3) / 1e12)
for (m, k, nn) in ((13896, 4096, 24576), (13896, 12288, 4096), (16952, 3584, 37888), (16952, 18944, 3584)):
    x = mx.random.normal((m, k)).astype(bf)
    w = mx.random.normal((nn, k)).astype(bf) * 0.01
    mx.eval(x, w)
    ms = ms_per_call(lambda: x @ w.T, inner=10, repeats=5)
    rec(f"matmul.{m}x{k}x{nn}", 2 * m * k * nn / (ms / 1e3) / 1e12)
del a, b
try:
    import torch
    ta = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    tb = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    for _ in range(20):
        ta @ tb
    torch.cuda.synchronize()
    for trial in range(3):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        for _ in range(20):
            ta @ tb
        e.record()
        torch.cuda.synchronize()
        rec(f"ceiling.torch_queued.{trial}", 2 * n**3 * 20 / (s.elapsed_time(e) / 1e3) / 1e12)
    del ta, tb
    torch.cuda.empty_cache()
except Exception as err:
    rec("torch_error", str(err))

# 2. KV scatter: u32 vs u64 words; the cache cycled over layers so no call copies a whole layer
for tag, T, hkv in (("q3", 13896, 8), ("q25", 16952, 4)):
    d, bs = 128, 16
    nb = 8192
    layers = 6
    ks = [mx.zeros((nb, bs, hkv, d), dtype=bf) for _ in range(layers)]
    vs = [mx.zeros((nb, bs, hkv, d), dtype=bf) for _ in range(layers)]
    k = mx.random.normal((T, hkv, d)).astype(bf)
    v = mx.random.normal((T, hkv, d)).astype(bf)
    perm = np.random.default_rng(0).permutation(nb)[: (T + bs - 1) // bs]
    slots_np = (perm[:, None] * bs + np.arange(bs)[None]).reshape(-1)[:T].astype(np.int32)
    slots = mx.array(slots_np)
    mx.eval(ks, vs, k, v, slots)
    width = hkv * d
    for word, wname in ((mx.uint32, "u32"), (mx.uint64, "u64")):
        it = iter(range(10**9))

        def write():
            i = next(it) % layers
            res = []
            for store, new in ((ks, k), (vs, v)):
                flat = store[i].reshape(nb * bs, width).view(word)
                flat[slots] = new.reshape(T, width).view(word)
                store[i] = flat.view(bf).reshape(nb, bs, hkv, d)
                res.append(store[i])
            return res
        try:
            rec(f"kv_write.{tag}.{wname}", ms_per_call(write, inner=5, repeats=5))
        except Exception as err:
            rec(f"kv_write.{tag}.{wname}_error", str(err)[:200])
    # check u64 = u32 result
    i0 = 0
    rec(f"kv_write.{tag}.copy_baseline", ms_per_call(lambda: [k + 0, v + 0], inner=5, repeats=5))
    got = np.array(ks[0].reshape(nb * bs, width).view(mx.uint16))[slots_np]
    want = np.array(k.reshape(T, width).view(mx.uint16))
    rec(f"kv_write.{tag}.exact", bool((got == want).all()))
    del ks, vs

# 3. addmm residual
for tag, T, kin, nout in (("q3_o", 13896, 4096, 4096), ("q3_down", 13896, 12288, 4096),
                         ("q25_o", 16952, 3584, 3584), ("q25_down", 16952, 18944, 3584)):
    x = mx.random.normal((T, nout)).astype(bf)
    h = mx.random.normal((T, kin)).astype(bf)
    w = (mx.random.normal((nout, kin)) * 0.02).astype(bf)
    mx.eval(x, h, w)
    rec(f"residual.{tag}.matmul_only", ms_per_call(lambda: h @ w.T, inner=10, repeats=5))
    rec(f"residual.{tag}.matmul_plus_add", ms_per_call(lambda: x + h @ w.T, inner=10, repeats=5))
    try:
        rec(f"residual.{tag}.addmm", ms_per_call(lambda: mx.addmm(x, h, w.T), inner=10, repeats=5))
        diff = mx.abs(mx.addmm(x, h, w.T).astype(mx.float32) - (x + h @ w.T).astype(mx.float32)).max()
        rec(f"residual.{tag}.addmm_maxdiff", float(diff))
    except Exception as err:
        rec(f"residual.{tag}.addmm_error", str(err)[:200])

# 4. SwiGLU layouts
import mlx.nn as nn  # noqa: E402


@mx.compile
def swiglu_halves(gu):
    half = gu.shape[-1] // 2
    return nn.silu(gu[..., :half]) * gu[..., half:]


@mx.compile
def swiglu_two(g, u):
    return nn.silu(g) * u


for tag, T, inter in (("q3", 13896, 12288), ("q25", 16952, 18944)):
    gu = mx.random.normal((1, T, 2 * inter)).astype(bf)
    g, u = mx.contiguous(gu[..., :inter]), mx.contiguous(gu[..., inter:])
    mx.eval(gu, g, u)
    rec(f"swiglu.{tag}.halves", ms_per_call(lambda: swiglu_halves(gu), inner=10, repeats=5))
    rec(f"swiglu.{tag}.two_contiguous", ms_per_call(lambda: swiglu_two(g, u), inner=10, repeats=5))
    rec(f"swiglu.{tag}.add_baseline", ms_per_call(lambda: g + u, inner=10, repeats=5))
    gbytes = T * inter * 2 * 3
    rec(f"swiglu.{tag}.bytes_gb", gbytes / 1e9)
    del gu, g, u

json.dump(out, open(sys.argv[1], "w"), indent=1)
