"""Backend selection and fallback, with an injected "Metal device" and injected kernels."""

from __future__ import annotations

import logging

import mlx.core as mx
import numpy as np
import pytest

from batchjob.metal_backend import SeqSlice, build_attention_metadata, paged_attention, select_attention_backend
from batchjob.metal_backend.kernels.index_math import find_seq_for_token, kv_slot, visible_kv_len


def emulated_kernel(off_by_one: int = 0):
    """An independent per-token implementation driven by the kernels' index twins (host numpy, fp64).

    With `off_by_one` it lets every query see that many positions more (or fewer): the kind of bug a real
    kernel would have, which the probe must catch.
    """

    def kernel(q, k_cache, v_cache, meta, scale):
        qh = np.array(q.astype(mx.float32)).astype(np.float64)
        kc = np.array(k_cache.astype(mx.float32)).reshape(-1, *k_cache.shape[2:])
        vc = np.array(v_cache.astype(mx.float32)).reshape(-1, *v_cache.shape[2:])
        cu, ctx, tables = meta.cu_seqlens_q_host, meta.context_lens_host, meta.block_tables_host
        group = q.shape[1] // k_cache.shape[2]
        out = np.zeros_like(qh)
        for t in range(q.shape[0]):
            s = find_seq_for_token(cu, meta.num_seqs, t)
            n = visible_kv_len(int(ctx[s]), int(cu[s + 1] - cu[s]), t - int(cu[s])) + off_by_one
            slots = [kv_slot(tables[s], p, meta.block_size) for p in range(max(n, 1))]
            for h in range(q.shape[1]):
                k, v = kc[slots, h // group], vc[slots, h // group]
                w = np.exp((k @ qh[t, h]) * scale - ((k @ qh[t, h]) * scale).max())
                out[t, h] = (w / w.sum()) @ v
        return mx.array(out.astype(np.float32)).astype(q.dtype)

    return kernel


def select(kernel=None, loader=None, probe=True):
    calls = []

    def load():
        calls.append(1)
        if loader is not None:
            return loader()
        return kernel

    backend = select_attention_backend(probe, dtype=mx.float32, metal_available=lambda: True, load_kernel=load)
    return backend, calls


def test_without_metal_the_portable_path_is_used_and_kernels_are_not_built():
    calls = []
    backend = select_attention_backend(metal_available=lambda: False, load_kernel=lambda: calls.append(1))
    assert backend.name == "portable" and "no Metal device" in backend.reason and not calls
    assert backend.fn is paged_attention


def test_genuine_kernels_on_this_machine(caplog):
    """With no Metal (Linux CI) the genuine kernels build but raise, and the probe must fall back; on an Apple
    GPU the same test checks them for real against the portable path."""
    if mx.metal.is_available():
        backend = select_attention_backend(dtype=mx.float32)
        assert backend.name == "metal", backend.reason
        return
    with caplog.at_level(logging.WARNING, logger="batchjob.metal_backend.selection"):
        backend = select_attention_backend(dtype=mx.float32, metal_available=lambda: True)
    assert backend.name == "portable" and "No Metal back-end" in backend.reason
    assert any("No Metal back-end" in r.message for r in caplog.records)


def test_a_correct_kernel_is_selected_and_called(rng):
    calls = []
    right = emulated_kernel()

    def counting(*args):
        calls.append(1)
        return right(*args)

    backend, _ = select(counting)
    assert backend.name == "metal", backend.reason
    n = len(calls)
    # any batch (the fixture's fresh one): the backend must route to the kernel it selected
    q = mx.array(rng.standard_normal((3, 2, 64)).astype(np.float32))
    meta = build_attention_metadata([SeqSlice([0], 0, 3)], 16)
    cache = mx.array(rng.standard_normal((1, 16, 1, 64)).astype(np.float32))
    got = backend(q, cache, cache, meta, 0.125)
    assert len(calls) == n + 1
    assert mx.abs(got - paged_attention(q, cache, cache, meta, 0.125)).max().item() < 1e-4


@pytest.mark.parametrize("off_by_one", [-1, 1])
def test_an_off_by_one_kernel_is_rejected(caplog, off_by_one):
    with caplog.at_level(logging.WARNING, logger="batchjob.metal_backend.selection"):
        backend, _ = select(emulated_kernel(off_by_one))
    assert backend.name == "portable" and "differs from the portable path" in backend.reason
    assert backend.fn is paged_attention and caplog.records


@pytest.mark.parametrize(
    "bad,expect",
    [
        (lambda q, *a: (_ for _ in ()).throw(RuntimeError("boom")), "RuntimeError: boom"),
        (lambda q, *a: q * float("nan"), "non-finite"),
        (lambda q, *a: q[:, :1], "expected"),
        (lambda q, *a: q.astype(mx.float16), "expected"),
    ],
)
def test_raising_or_malformed_kernels_are_rejected(bad, expect):
    backend, _ = select(bad)
    assert backend.name == "portable" and expect in backend.reason, backend.reason


def test_a_kernel_that_fails_to_build_is_rejected():
    def loader():
        raise RuntimeError("metal compiler error")

    backend, calls = select(loader=loader)
    assert backend.name == "portable" and "failed to build" in backend.reason and calls


def test_probe_can_be_skipped():
    sentinel = emulated_kernel(off_by_one=1)
    backend, _ = select(sentinel, probe=False)
    assert backend.name == "metal" and backend.fn is sentinel and "skipped" in backend.reason


@pytest.mark.parametrize("metal", [False, True])
def test_gpu_portable_path_uses_long_query_chunks_only_in_half_precision(rng, monkeypatch, metal):
    from batchjob.metal_backend import selection
    from batchjob.metal_backend.attention_plan import GPU_SHAPE_BUCKETS
    from batchjob.metal_backend.probe import make_ragged_batch
    from batchjob.metal_backend.selection import GPU_GROUP_ROWS, GPU_QUERY_CHUNK, gpu_portable_attention

    monkeypatch.setattr(selection, "metal_is_available", lambda: metal)
    shape = dict(num_q_heads=4, num_kv_heads=2, head_dim=32, block_size=16)
    assert gpu_portable_attention(mx.float32) is paged_attention  # unfused on CUDA: keep score matrices small
    fn = gpu_portable_attention(mx.bfloat16)
    assert fn.keywords == {"query_chunk": GPU_QUERY_CHUNK, "group_rows": GPU_GROUP_ROWS, "contiguous_kv": False,
                           "fold_followers": True,
                           "shape_buckets": 0 if metal else GPU_SHAPE_BUCKETS}   # cuDNN's graphs are per shape
    batch = make_ragged_batch(rng, [700, 3], [0, 40], dtype=mx.float32, **shape)
    np.testing.assert_allclose(np.array(fn(batch.q, batch.k_cache, batch.v_cache, batch.meta, 0.2)),
                               np.array(paged_attention(batch.q, batch.k_cache, batch.v_cache, batch.meta, 0.2)),
                               atol=1e-5)
