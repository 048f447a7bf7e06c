"""Where one packed LM prefill forward spends its time: each step of a decoder layer timed alone with the
forward's real shapes, the whole layer, the whole forward, and the host's share (graph building, syncs).

What is left after the steps is reported, not hidden: `other_ms` = whole layer - sum of its steps (fusion
losses, allocation, launches between kernels), `outside_layers_ms` = forward - layers x whole layer
(embedding, video rows, positions, LM head, the final sync), and `host_build_ms` (the time to the forward's first
`mx.eval`: unpaced, Python building the whole graph while the GPU idles; paced (`runner.LAYER_LAG`), the first wait
for a layer, by which the GPU has run since the first layer was built).
"""
from __future__ import annotations

import itertools
import time

import numpy as np

from .flops import lm_attention_flops, lm_linear_flops_per_token
from .syncs import count_host_syncs, layers_marked
from .timing import ms_per_call

CATEGORIES = {"matmuls": ("qkv_proj", "o_proj", "mlp_gate_up", "mlp_down"), "attention": ("attention",),
              "norms": ("input_norm", "post_norm", "qk_norm", "qk_norm_rope"), "rotary": ("rope",),
              "kv_write": ("kv_write",), "elementwise": ("mlp_act", "residual_adds")}


def _one_forward_batch(clf, requests):
    """The requests as the engine schedules them, all in one forward (the budget raised to hold them)."""
    from batchjob.engine.scheduler import Scheduler

    call_id = next(clf._call_ids)
    scheduler = Scheduler(clf.pool, 1 << 30)
    for i, r in enumerate(requests):
        scheduler.add(clf._prepare(i, r, call_id))
    batch = scheduler.schedule()
    if scheduler.waiting or any(not s.is_last_chunk for s in batch):
        scheduler.abort_all()
        raise RuntimeError("the profiled requests do not fit one forward (pool too small?)")
    return scheduler, batch


def profile_lm(clf, requests, dims: dict, ceiling: float, *, inner: int, repeats: int) -> dict:
    """Profile one forward over `requests` (distinct clips: no prefix to wait for; their vision features
    should already be cached, so no tower runs inside)."""
    import mlx.core as mx

    from batchjob.engine import runner
    from batchjob.metal_backend import build_attention_metadata

    model, cache = clf.checkpoint.model, clf.kv_cache
    lm = model.language_model
    num_layers, deepstack = len(lm.model.layers), clf.checkpoint.family.num_deepstack
    out: dict = {}
    with mx.stream(clf._device):
        scheduler, batch = _one_forward_batch(clf, requests)
        try:
            video = clf._video_rows(batch, requests)

            def forward():
                return runner.forward(model, batch, cache, clf._attention, video, deepstack)

            forward()
            times = []
            for _ in range(repeats):
                t0 = time.perf_counter()
                forward()
                times.append((time.perf_counter() - t0) * 1e3)
            out["forward_ms"] = sorted(times)[len(times) // 2]
            with count_host_syncs() as log, layers_marked(log, lm.model.layers):
                t0 = time.perf_counter()
                forward()
                total = time.perf_counter() - t0
            out.update(log.as_dict())
            out["host_build_ms"] = (log.first_eval_s or total) * 1e3
            meta = build_attention_metadata([s.attention_slice() for s in batch], cache.block_size)
            tokens = meta.num_tokens
            out.update(tokens=tokens, sequences=len(batch), layers=num_layers,
                       sdpa_calls_per_layer=None)
            layer_ms = _layer_steps(clf, batch, video, meta, out, inner=inner, repeats=repeats)
        finally:
            scheduler.abort_all()
    # FLOPs of one layer at this batch, the per-category split, and what the steps leave unexplained
    linear = tokens * lm_linear_flops_per_token(dims)
    attention = sum(lm_attention_flops(s.num_new, s.seq.num_computed, dims) for s in batch)
    steps = out["steps_ms"]
    out["categories_ms"] = {c: sum(steps.get(k, 0.0) for k in ks) for c, ks in CATEGORIES.items()}
    out["other_ms"] = layer_ms - sum(out["categories_ms"].values())
    out["outside_layers_ms"] = out["forward_ms"] - num_layers * layer_ms
    out["layer_flops"] = {"linear": linear, "attention": attention}
    out["ideal_layer_ms"] = (linear + attention) / ceiling * 1e3
    out["mfu_layer"] = out["ideal_layer_ms"] / layer_ms
    out["mfu_forward"] = num_layers * out["ideal_layer_ms"] / out["forward_ms"]
    mm = out["categories_ms"]["matmuls"]
    out["matmul_tflops"] = linear / mm / 1e9 if mm else None
    att = steps.get("attention")
    out["attention_tflops"] = attention / att / 1e9 if att else None
    return out


def _layer_steps(clf, batch, video, meta, out: dict, *, inner: int, repeats: int) -> float:
    """Time each step of layer 0 on the forward's real inputs; fills out["steps_ms"], returns the whole layer."""
    import mlx.core as mx

    from batchjob.engine import runner
    from batchjob.engine.attention import (AttentionContext, attention_context, attention_hints, fused_qk_norm_rope,
                                            rotate_qk)
    from batchjob.engine.decoder_layer import run_layer
    from batchjob.engine.fused_ops import folds_residual, linear_plus, pairs_suit, split_tables, swiglu_halves
    from batchjob.metal_backend import write_kv
    from batchjob.metal_backend.attention_plan import AttentionPlan

    lm, cache = clf.checkpoint.model.language_model, clf.kv_cache
    layer = lm.model.layers[0]
    attn = getattr(layer.self_attn, "inner", layer.self_attn)
    hq, hkv, d = attn.n_heads, attn.n_kv_heads, attn.head_dim
    injection = runner._video_injection(batch, video)
    x = runner._embed(lm, batch, injection)[None]
    positions = np.concatenate([s.seq.positions[:, s.seq.num_computed:s.seq.num_computed + s.num_new]
                                for s in batch], axis=1)
    cos, sin = layer.self_attn.rotary_emb(x, mx.array(positions[:, None, :]))
    mx.eval(x, cos, sin)
    t = x.shape[1]
    time_ = lambda fn, n=inner: ms_per_call(fn, inner=n, repeats=repeats)  # noqa: E731
    steps: dict = {}
    ctx = AttentionContext(meta, cache, clf._attention)
    with attention_context(ctx):
        steps["input_norm"] = time_(lambda: layer.input_layernorm(x))
        xn = layer.input_layernorm(x)
        c, s = cos[0][:, None, :], sin[0][:, None, :]
        tables = split_tables(c, s) if pairs_suit(d) else None   # once per forward, as runner.forward does
        if "qkv_proj" in attn:
            steps["qkv_proj"] = time_(lambda: attn.qkv_proj(xn))
            qkv = attn.qkv_proj(xn).reshape(t, hq + 2 * hkv, d)
            q, k, v = qkv[:, :hq], qkv[:, hq:hq + hkv], qkv[:, hq + hkv:]
        else:
            steps["qkv_proj"] = time_(lambda: [attn.q_proj(xn), attn.k_proj(xn), attn.v_proj(xn)])
            q, k, v = (p(xn).reshape(t, h, d) for p, h in ((attn.q_proj, hq), (attn.k_proj, hkv), (attn.v_proj, hkv)))
            qkv = None
        fused = fused_qk_norm_rope(attn, qkv)
        if fused is not None:
            # the engine's CUDA kernel (cuda_fused): norms and rotary in one pass
            norm_rope = lambda: fused(qkv, hq, hkv, attn.q_norm, attn.k_norm, cos[0], sin[0])  # noqa: E731
            steps["qk_norm_rope"] = time_(norm_rope)
            qk = norm_rope()
            q, k = qk[:, :hq], qk[:, hq:]
        else:
            if hasattr(attn, "q_norm"):
                steps["qk_norm"] = time_(lambda: [attn.q_norm(q), attn.k_norm(k)])
                q, k = attn.q_norm(q), attn.k_norm(k)
                qkv = None
            # the engine's rotary (attention.PagedAttention): q and k in one kernel when nothing came between
            steps["rope"] = time_(lambda: [x for x in rotate_qk(q, k, c, s, tables, stacked=qkv) if x is not None])
            q, k, qk = rotate_qk(q, k, c, s, tables, stacked=qkv)
        hints = attention_hints(clf._attention, qk)   # as the layer calls it
        mx.eval(q, k, v)

        written = itertools.count()

        def kv_write():   # in place, as the layer writes it: each queued call another layer's cache, whose old
            # array nothing else holds (see _cycling_cache_layers), so no call copies a whole cache layer
            i = next(written) % len(cache.k)
            cache.k[i], cache.v[i] = write_kv(cache.k[i], cache.v[i], k, v, meta)
            return [cache.k[i], cache.v[i]]

        steps["kv_write"] = time_(kv_write)
        clf._attention(q, cache.k[0], cache.v[0], meta, attn.scale, new_kv=(k, v), **hints)   # plan built once
        steps["attention"] = time_(lambda: clf._attention(q, cache.k[0], cache.v[0], meta, attn.scale, new_kv=(k, v),
                                                          **hints))
        plans = [p for p in meta.plan_cache.values() if isinstance(p, AttentionPlan)]
        if plans:
            out["sdpa_calls_per_layer"] = plans[0].num_calls
        a = clf._attention(q, cache.k[0], cache.v[0], meta, attn.scale, new_kv=(k, v), **hints).reshape(1, t, -1)
        # the output projection and the MLP's down projection as the layer runs them: with the residual added in
        # the GEMM where linear_plus folds it there; only the adds it does not fold are timed as passes of their own
        mlp = layer.mlp
        o_folds, down_folds = folds_residual(attn.o_proj), hasattr(mlp, "gate_up") and folds_residual(mlp.down)
        steps["o_proj"] = time_(lambda: linear_plus(attn.o_proj, a, x if o_folds else None))
        h1 = linear_plus(attn.o_proj, a, x)
        hn = layer.post_attention_layernorm(h1)
        mx.eval(h1, hn)
        steps["post_norm"] = time_(lambda: layer.post_attention_layernorm(h1))
        if not (o_folds and down_folds):
            steps["residual_adds"] = (2 - o_folds - down_folds) * time_(lambda: x + h1)
        if hasattr(mlp, "gate_up"):
            steps["mlp_gate_up"] = time_(lambda: mlp.gate_up(hn))
            gu = mlp.gate_up(hn)
            mx.eval(gu)
            steps["mlp_act"] = time_(lambda: swiglu_halves(gu))
            act = swiglu_halves(gu)
            mx.eval(act)
            steps["mlp_down"] = time_(lambda: linear_plus(mlp.down, act, h1 if down_folds else None))
            del gu, act
        else:   # a MoE block (or unfused MLP): timed whole, as matmuls
            steps["mlp_gate_up"] = time_(lambda: mlp(hn))
        num_layers = len(lm.model.layers)
        whole = time_(_cycling_cache_layers(layer, num_layers, lambda: run_layer(layer, x, (cos, sin))))
    out["steps_ms"] = steps
    out["layer_ms"] = whole
    return whole


def _cycling_cache_layers(layer, num_layers: int, call):
    """`call` with the layer's KV write aimed at the next layer's cache each time (then back at its own).

    Why: calls queued together would otherwise each write layer 0's cache, and the attention of one call still
    holds the array the next call's write takes as input, so MLX copies the whole cache layer (hundreds of MB)
    in every call: time the real forward never spends, since it writes each layer's cache once."""
    attn = layer.self_attn
    counter = itertools.count()

    def cycled():
        own = attn.layer_index
        attn.layer_index = next(counter) % num_layers
        try:
            return call()
        finally:
            attn.layer_index = own

    return cycled
