"""The Hopper paged attention kernel (engine/cuda_attention.py, engine/hopper_kernel.py) without a GPU.

What the kernel computes is checked on Hopper at every engine start against the portable path
(`check_kernel`) and in `scripts/diag_cuda_attention.py`'s results. Here: the source compiles with NVRTC's wheel
for sm_90a in every dtype and head size the engine asks for; the tile plan covers every query row once; the
kernel's tiling (key range, tile skipping, the edge mask, zero rows past a context, the online softmax) stated in
NumPy equals dense attention; its lean loads fetch what the general ones do; the routing between the kernel and
cuDNN's SDPA; the selection and its fallbacks; the layer hands the kernel the rotated q/k stack instead of a copy
of q.
"""
from __future__ import annotations

import re
import types

import mlx.core as mx
import numpy as np
import pytest

from batchjob.engine import classifier, cuda_attention
from batchjob.engine.cuda_attention import (LONG_EQUAL_PROMPT, LONG_PROMPT, HopperAttention, check_kernel, plan_tiles,
                                            prefers_portable, select_hopper_attention)
from batchjob.engine.hopper_kernel import (ARCH, BLOCK_M, BLOCK_N, HEAD_DIMS, THREADS, kernel_source, lean_loads,
                                           shared_memory)
from batchjob.engine.nvrtc import Compiler, NvrtcError, Target, compile_cubin
from batchjob.engine.types import EngineConfig, EngineError
from batchjob.metal_backend import paged_attention
from batchjob.metal_backend.probe import make_ragged_batch


@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float16])
@pytest.mark.parametrize("d", HEAD_DIMS)
def test_the_kernel_compiles_for_hopper_in_every_dtype_and_head_size(dtype, d, rng, wheel_nvrtc):
    lib = wheel_nvrtc
    hkv = int(rng.integers(1, 9))
    hq, block_size = hkv * int(rng.integers(1, 9)), int(rng.choice([16, 32]))
    source, name = kernel_source(dtype, hq, hkv, d, block_size)
    cubin = Compiler(lib, Target(9, 0)).cubin(name, source, ARCH)
    assert cubin[:4] == b"\x7fELF" and b"\x00" + name.encode() + b"\x00" in cubin


@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float16])
def test_the_kernels_wgmmas_stay_asynchronous_and_nothing_spills(dtype, rng, nvrtc_output):
    """ptxas keeps the wgmmas asynchronous (a tile's k-steps queue back to back, and V's load runs under the
    scores) unless an instruction writes a register a wgmma of the stage reads or reads one it writes before the
    wait: then it serialises them or injects waits itself, saying so only in its report (notices C7513, C7517).
    An edit that does so, or that makes registers spill, still passes the start-up check and only shows as a
    slower kernel. Nor would one that no longer lets three blocks share an SM."""
    hkv = int(rng.integers(1, 9))
    source, _ = kernel_source(dtype, hkv * int(rng.integers(1, 9)), hkv, 128, int(rng.choice([16, 32])))
    report = nvrtc_output(source, [f"--gpu-architecture={ARCH}", "--std=c++17", "--ptxas-options=-v"], "log")
    assert not re.search(r"\(C75\d\d\)", report), report   # C7513 serialised, C7517 a wait injected, ...
    assert "0 bytes spill stores, 0 bytes spill loads" in report, report
    # three blocks an SM, as measured: registers (allocated 8 a thread at a time) and the rings both fit three times
    registers = -(-int(re.search(r"Used (\d+) registers", report).group(1)) // 8) * 8
    assert 3 * registers * THREADS <= 65536 and 3 * shared_memory(128) <= 227 * 1024, report


def test_wgmma_needs_the_hopper_specific_target(wheel_nvrtc):
    """Why the selection asks for compute capability 9.x: the same source is refused for sm_90 and sm_80."""
    lib = wheel_nvrtc
    source, name = kernel_source(mx.bfloat16, 8, 2, 128, 16)
    for target in (Target(9, 0), Target(8, 0)):
        with pytest.raises(NvrtcError, match="wgmma"):
            compile_cubin(lib, source, name, target)


def _tiled(row, d8):
    """hopper_kernel's `tiled`: a (key row, 8-column group)'s element offset in a swizzled tile."""
    return (d8 >> 3) * (BLOCK_N * 64) + row * 64 + (((d8 & 7) ^ (row & 7)) * 8)


def _tile_loads(lean: bool, kstart: int, ctx: int, table, bs: int, hkv: int, kvh: int, d: int = 128) -> dict:
    """Every 16-byte load a block issues for one K (or V) tile, as {shared-memory offset: cache offset or None for
    a zero-filled row}, in either form of the kernel's loader, with its index expressions."""
    dt, loads = d // 8, {}
    for t in range(THREADS):
        if not lean:
            for i in range(BLOCK_N * dt // THREADS):
                c = t + i * THREADS
                d8, row = c % dt, c // dt
                key = kstart + row
                live = key < ctx
                block = table[key // bs] if live else 0
                src = ((block * bs + (key % bs if live else 0)) * hkv + kvh) * d + d8 * 8
                loads[_tiled(row, d8)] = src if live else None
            continue
        d8, row0 = t % dt, t // dt
        rpp, span = THREADS // dt, min(bs, BLOCK_N)
        chunk, dst0 = (row0 * hkv + kvh) * d + d8 * 8, _tiled(row0, d8)
        for j in range(BLOCK_N // span):
            first = kstart + j * span
            base = table[first // bs] * (bs * hkv * d) + (first % bs) * (hkv * d) if first < ctx else 0
            for r in range(span // rpp):
                live = first + r * rpp + row0 < ctx
                loads[dst0 + (j * span + r * rpp) * 64] = base + chunk + r * rpp * hkv * d if live else None
    return loads


@pytest.mark.parametrize("bs", [8, 16, 32, 64, 128, 256])
def test_the_lean_loads_fetch_what_the_general_ones_do(bs, rng):
    """The lean loader (per-thread offsets fixed at the start, one table read per cache block of a tile) against
    the general one (a table read and an address per row) on random tiles, contexts and block tables: the same
    cache rows into the same swizzled places, the same rows zero-filled past the context, every chunk once."""
    assert lean_loads(128, bs)
    hkv = int(rng.integers(1, 9))
    for _ in range(6):
        ctx = int(rng.integers(1, 700))
        blocks = -(-ctx // bs)
        table = rng.permutation(blocks + 5)[:blocks]
        kstart = int(rng.integers(0, -(-ctx // BLOCK_N))) * BLOCK_N
        kvh = int(rng.integers(0, hkv))
        lean = _tile_loads(True, kstart, ctx, table, bs, hkv, kvh)
        assert len(lean) == BLOCK_N * 128 // 8   # every 16-byte chunk of the tile once
        assert lean == _tile_loads(False, kstart, ctx, table, bs, hkv, kvh)


def test_block_sizes_the_lean_loads_do_not_fit_keep_the_general_ones():
    for bs in (1, 4, 12, 24, 48, 96):
        assert not lean_loads(128, bs)
        assert "#define LEAN_LOADS 0" in kernel_source(mx.bfloat16, 8, 2, 128, bs)[0]
    assert "#define LEAN_LOADS 1" in kernel_source(mx.bfloat16, 8, 2, 128, 16)[0]


EDGES = np.array([1, 2, 62, 63, 64, 65, 126, 127, 128, 129])   # lengths around the tiles' edges


def _random_forward(rng, sequences: int, max_new: int = 300, max_cached: int = 200):
    """Prompt and cached lengths, half of them at or next to a multiple of the tile sizes."""
    edge = rng.random(sequences) < 0.5
    q_lens = np.where(edge, rng.choice(EDGES, sequences), rng.integers(1, max_new, sequences))
    cached = np.where(rng.random(sequences) < 0.3, 0, np.where(rng.random(sequences) < 0.5,
                                                               rng.choice(EDGES, sequences) - 1,
                                                               rng.integers(0, max_cached, sequences)))
    cu = np.concatenate([[0], np.cumsum(q_lens)])
    return cu, cached + q_lens


def test_the_tile_plan_covers_every_query_row_once_heaviest_first(rng):
    for _ in range(20):
        cu, ctx = _random_forward(rng, int(rng.integers(1, 12)))
        plan = plan_tiles(cu, ctx)
        q_lens = np.diff(cu)
        covered = {(s, row) for s, start in zip(plan.seq, plan.start)
                   for row in range(start, min(start + BLOCK_M, q_lens[s]))}
        assert len(covered) == q_lens.sum() == len({(s, r) for s in range(len(q_lens)) for r in range(q_lens[s])})
        assert len(plan.seq) == sum(-(-q // BLOCK_M) for q in q_lens)   # no tile twice, none empty
        work = [min(ctx[s], ctx[s] - q_lens[s] + min(start + BLOCK_M, q_lens[s])) for s, start in zip(plan.seq,
                                                                                                      plan.start)]
        assert all(a >= b for a, b in zip(work, work[1:]))
        assert plan.seq.dtype == plan.start.dtype == np.int32


def _kernel_statement(q, k, v, cu, ctx, scale):
    """The kernel's algorithm in NumPy, with its index expressions: per tile of BLOCK_M rows, the keys up to the
    last row's limit in BLOCK_N tiles, the mask only on edge tiles, rows past the context zero, the online
    softmax in base 2 with a -inf maximum taken as 0."""
    out = np.zeros_like(q)
    plan = plan_tiles(cu, ctx)
    log2e = np.log2(np.e)
    for seq, q0 in zip(plan.seq, plan.start):
        tok0, q_len, c = cu[seq], cu[seq + 1] - cu[seq], ctx[seq]
        prefix = c - q_len
        last_row = min(q0 + BLOCK_M, q_len) - 1
        key_end = min(c, prefix + last_row + 1)
        tiles = -(-key_end // BLOCK_N)
        masked_from = prefix + q0 + 1
        rows = np.arange(q0, q0 + BLOCK_M)
        qs = q[tok0 + np.minimum(rows, q_len - 1)]                       # [BLOCK_M, H, D]
        m = np.full((BLOCK_M, q.shape[1]), -np.inf)
        lsum = np.zeros((BLOCK_M, q.shape[1]))
        acc = np.zeros(qs.shape)
        for n in range(tiles):
            keys = np.arange(n * BLOCK_N, (n + 1) * BLOCK_N)
            live = keys < c
            kt = np.where(live[:, None, None], k[seq][np.minimum(keys, c - 1)], 0.0)
            vt = np.where(live[:, None, None], v[seq][np.minimum(keys, c - 1)], 0.0)
            s = np.einsum("rhd,khd->rhk", qs, kt) * scale * log2e
            if (n + 1) * BLOCK_N > masked_from or (n + 1) * BLOCK_N > c:
                hidden = (keys[None, :] >= c) | (keys[None, :] > prefix + rows[:, None])
                s = np.where(hidden[:, None, :], -np.inf, s)
            new_m = np.maximum(m, s.max(-1))
            base = np.where(new_m == -np.inf, 0.0, new_m)
            alpha, p = np.exp2(m - base), np.exp2(s - base[..., None])
            m, lsum = new_m, lsum * alpha + p.sum(-1)
            acc = acc * alpha[..., None] + np.einsum("rhk,khd->rhd", p, vt)
        valid = rows < q_len
        out[tok0 + rows[valid]] = acc[valid] / lsum[valid][..., None]
    return out


def test_the_kernels_tiling_equals_dense_attention(rng):
    """Prompts shorter and longer than a tile, over cached prefixes or none, single tokens: the statement of the
    kernel's tiling against a dense per-sequence causal attention (lower-right aligned)."""
    h, d = 2, 8
    for _ in range(8):
        cu, ctx = _random_forward(rng, int(rng.integers(3, 9)), max_new=200, max_cached=150)
        q = rng.normal(size=(cu[-1], h, d))
        k = [rng.normal(size=(c, h, d)) for c in ctx]
        v = [rng.normal(size=(c, h, d)) for c in ctx]
        got = _kernel_statement(q, k, v, cu, ctx, d ** -0.5)
        for s in range(len(ctx)):
            q_len = cu[s + 1] - cu[s]
            scores = np.einsum("qhd,khd->hqk", q[cu[s]:cu[s + 1]], k[s]) * d ** -0.5
            visible = np.arange(ctx[s])[None, :] <= (ctx[s] - q_len + np.arange(q_len))[:, None]
            scores = np.where(visible[None], scores, -np.inf)
            p = np.exp(scores - scores.max(-1, keepdims=True))
            want = np.einsum("hqk,khd->qhd", p / p.sum(-1, keepdims=True), v[s])
            np.testing.assert_allclose(got[cu[s]:cu[s + 1]], want, rtol=1e-9, atol=1e-12)


def test_cudnn_keeps_long_equal_fresh_prompts_and_long_ones():
    cu = lambda lens: np.concatenate([[0], np.cumsum(lens)])   # noqa: E731
    longer = LONG_EQUAL_PROMPT + 1
    assert prefers_portable(cu([longer] * 4), np.array([longer] * 4))            # one SDPA call over views
    assert not prefers_portable(cu([LONG_EQUAL_PROMPT] * 8), np.array([LONG_EQUAL_PROMPT] * 8))
    assert not prefers_portable(cu([2119] * 8), np.array([2119] * 8))
    assert prefers_portable(cu([LONG_PROMPT + 1, 40]), np.array([LONG_PROMPT + 1, 2140]))
    assert not prefers_portable(cu([longer, 2000]), np.array([longer, 2000]))    # ragged
    assert not prefers_portable(cu([40] * 12), np.array([2140] * 12))            # followers over a cached clip
    assert not prefers_portable(cu([longer] * 2), np.array([longer + 16] * 2))  # equal, but over a cached block
    assert not prefers_portable(cu([LONG_PROMPT, 10]), np.array([LONG_PROMPT, 10]))


class _Recorder:
    def __init__(self, tag, calls):
        self.tag, self.calls = tag, calls

    def __call__(self, q, *args, **kwargs):
        self.calls.append((self.tag, sorted(kwargs)))
        return q


def test_the_engine_attention_routes_each_forward_once(rng):
    calls = []
    attention = HopperAttention(_Recorder("kernel", calls), _Recorder("portable", calls))
    shape = dict(num_q_heads=4, num_kv_heads=2, head_dim=64, block_size=16, dtype=mx.float16)
    ragged = make_ragged_batch(rng, [5, 37, 20], [0, 16, 3], **shape)
    equal = make_ragged_batch(rng, [LONG_EQUAL_PROMPT + 1] * 2, [0, 0], **shape)   # one SDPA call over views
    stack = mx.zeros((ragged.q.shape[0], 8, 64), dtype=mx.float16)
    for _ in range(3):   # three layers of one forward each
        attention(ragged.q, ragged.k_cache, ragged.v_cache, ragged.meta, 0.125, new_kv=None, q_rows=stack)
        attention(equal.q, equal.k_cache, equal.v_cache, equal.meta, 0.125, new_kv=None)
    assert [c[0] for c in calls] == ["kernel", "portable"] * 3
    assert calls[0][1] == ["q_rows"] and calls[1][1] == ["new_kv"]
    assert ragged.meta.plan_cache["hopper_prefers_portable"] is False
    assert equal.meta.plan_cache["hopper_prefers_portable"] is True


def test_the_start_up_check_passes_the_portable_path_and_catches_a_wrong_kernel():
    heads = (4, 2, 64)
    assert check_kernel(lambda q, k, v, meta, scale: paged_attention(q, k, v, meta, scale), mx.float16, heads,
                        16) is None
    wrong_scale = check_kernel(lambda q, k, v, meta, scale: paged_attention(q, k, v, meta, scale * 1.5), mx.float16,
                               heads, 16)
    assert wrong_scale is not None and "differs from the portable path" in wrong_scale
    assert "non-finite" in check_kernel(lambda q, *a: q * np.inf, mx.float16, heads, 16)


def _compiler(major=9, minor=0, compiled=None):
    def cubin(name, source, arch=None):
        if compiled is None:
            raise NvrtcError("compiling: NVRTC_ERROR_COMPILATION")
        compiled.append((name, arch))
        return b"cubin"
    return types.SimpleNamespace(target=Target(major, minor), cubin=cubin)


def test_selection_falls_back_and_says_why(monkeypatch):
    portable = object()
    heads = (28, 4, 128)
    fn, why = select_hopper_attention(mx.float32, heads, 16, portable, compiler=_compiler(compiled=[]))
    assert fn is None and "half precision" in why
    fn, why = select_hopper_attention(mx.bfloat16, (16, 4, 64), 16, portable, compiler=_compiler(compiled=[]))
    assert fn is None and "head size 64" in why and "head size 128" in why
    fn, why = select_hopper_attention(mx.bfloat16, heads, 16, portable, compiler="no NVRTC library in this process")
    assert fn is None and "no NVRTC library" in why
    fn, why = select_hopper_attention(mx.bfloat16, heads, 16, portable, compiler=_compiler(8, 0, compiled=[]))
    assert fn is None and "8.0" in why and "wgmma" in why
    monkeypatch.setattr(cuda_attention, "check_kernel", lambda *a: "differs from the portable path on the probe")
    fn, why = select_hopper_attention(mx.bfloat16, heads, 16, portable, compiler=_compiler(compiled=[]))
    assert fn is None and "differs" in why
    monkeypatch.setattr(cuda_attention, "check_kernel", lambda kernel, *a: kernel._compile("k", "source"))
    fn, why = select_hopper_attention(mx.bfloat16, heads, 16, portable, compiler=_compiler())   # NVRTC refuses
    assert fn is None and "failed to build or run" in why and "NVRTC_ERROR_COMPILATION" in why


def test_selection_compiles_for_sm90a_and_routes_through_the_portable_path(monkeypatch):
    compiled = []
    monkeypatch.setattr(cuda_attention, "check_kernel", lambda kernel, *a: kernel._compile("k", "source") and None)
    portable = object()
    fn, why = select_hopper_attention(mx.float16, (32, 8, 128), 16, portable, compiler=_compiler(9, 0, compiled))
    assert isinstance(fn, HopperAttention) and fn.portable is portable and fn.reads_q_rows
    assert compiled == [("k", "sm_90a")] and "matched the portable path" in why


def test_the_engine_picks_the_kernel_on_cuda_and_honours_the_config(monkeypatch):
    lm = types.SimpleNamespace(model=types.SimpleNamespace(layers=[types.SimpleNamespace(
        self_attn=types.SimpleNamespace(n_heads=28, n_kv_heads=4, head_dim=128))]))
    checkpoint = types.SimpleNamespace(device="cuda", dtype=mx.bfloat16,
                                       model=types.SimpleNamespace(language_model=lm))
    seen = []

    def select(dtype, heads, block_size, portable):
        seen.append((dtype, heads, block_size))
        return (None, "compute capability 8.0: the paged kernel needs Hopper's wgmma (9.x)") if fail else (
            "the kernel", "Hopper paged kernel")

    monkeypatch.setattr(classifier, "select_hopper_attention", select)
    fail = False
    assert classifier._select_attention(EngineConfig(block_size=32), checkpoint)[:2] == ("cuda", "Hopper paged kernel")
    assert seen == [(mx.bfloat16, (28, 4, 128), 32)]
    fail = True
    name, reason, fn = classifier._select_attention(EngineConfig(), checkpoint)
    assert name == "portable" and "cuDNN" in reason and "8.0" in reason and fn.keywords["contiguous_kv"] is False
    with pytest.raises(EngineError, match="attention_backend='cuda' but the kernel is unusable"):
        classifier._select_attention(EngineConfig(attention_backend="cuda"), checkpoint)
    cpu = types.SimpleNamespace(device="cpu", dtype=mx.float32)
    with pytest.raises(EngineError, match="needs an NVIDIA Hopper GPU"):
        classifier._select_attention(EngineConfig(attention_backend="cuda"), cpu)
    assert classifier._select_attention(EngineConfig(attention_backend="portable"), checkpoint)[0] == "portable"
    assert len(seen) == 3   # "portable" asked for nothing to be built


@pytest.mark.parametrize("name", ["qwen2_5_vl-mha", "qwen3_vl"])
def test_the_layer_hands_the_rotated_stack_to_an_attention_that_reads_it(checkpoint_dir, rng, make_clip,
                                                                         make_request, name):
    """An attention marked `reads_q_rows` gets the contiguous stack whose first heads are q (where q/k/v are one
    projection and no q/k norm comes between: Qwen2.5-VL here, Qwen3-VL only through its CUDA q/k kernel), and
    the answers are the same bits as without it."""
    from batchjob.engine import Classifier

    config = EngineConfig(max_model_len=2048, memory_budget_gb=1.0)
    clip = make_clip(rng, "rows", num_frames=2, size=(56, 56))
    requests = [make_request(rng, f"rows-{i}", clip) for i in range(3)]
    want = Classifier.from_pretrained(checkpoint_dir(name), config).classify(requests)
    clf = Classifier.from_pretrained(checkpoint_dir(name), config)
    portable, seen = clf._attention, []

    class ReadsRows:
        reads_q_rows = True

        def __call__(self, q, k_cache, v_cache, meta, scale, *, new_kv=None, q_rows=None):
            if q_rows is not None:
                assert np.array_equal(np.array(q_rows[:, :q.shape[1]].astype(mx.float32)),
                                      np.array(q.astype(mx.float32)))
            seen.append(q_rows is not None)
            return portable(q, k_cache, v_cache, meta, scale, new_kv=new_kv)

    clf._attention = ReadsRows()
    got = clf.classify(requests)
    assert len(seen) >= len(clf.checkpoint.model.language_model.model.layers)
    assert all(seen) if name.startswith("qwen2_5") else not any(seen)
    for g, w in zip(got, want):
        assert g.error is None and g.choice == w.choice
        # to fp32 rounding: two calls, and the CPU's multi-threaded BLAS sums in a different order from run to run
        np.testing.assert_allclose(g.logprobs, w.logprobs, rtol=0, atol=1e-5)
