"""scripts/diag_cuda_attention.py on a CPU: the Hopper kernel is stood in for by the portable path (the
script's plumbing, not the kernel, is under test here), on the small probe batches and a follower batch."""
from __future__ import annotations

import json
import sys
from pathlib import Path


ROOT = Path(__file__).resolve().parents[2]


def test_diag_cuda_attention_smoke(tmp_path, monkeypatch):
    sys.path.insert(0, str(ROOT / "scripts"))
    import diag_cuda_attention

    from batchjob.engine import cuda_attention
    from batchjob.metal_backend import paged_attention

    def stand_in(dtype, heads, block_size, portable):
        kernel = lambda q, k, v, meta, scale, q_rows=None: paged_attention(q, k, v, meta, scale)   # noqa: E731
        return cuda_attention.HopperAttention(kernel, portable), "stand-in"

    monkeypatch.setattr(cuda_attention, "select_hopper_attention", stand_in)
    monkeypatch.setitem(diag_cuda_attention.BATCHES, "follower", ([6] * 5, [64] * 5, 1))
    out = tmp_path / "diag.json"
    assert diag_cuda_attention.main(["--heads", "4", "2", "64", "--dtype", "float16", "--repeats", "1",
                                     "--cases", "probe_prefill", "probe_decode", "follower",
                                     "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["cases"]
    assert set(rows) == {"probe_prefill", "probe_decode", "follower"}
    for row in rows.values():
        assert row["engine_chose"] == "kernel" and row["kernel_finite"] and row["portable_finite"]
        assert row["kernel_max_err"] < 1e-2 and row["kernel_ms"] > 0 and row["flops"] > 0
        assert row["sdpa_padded_ms"] > 0 and row["engine_vs_padded"] > 0


def test_diag_cuda_attention_says_why_without_a_hopper_gpu(capsys):
    sys.path.insert(0, str(ROOT / "scripts"))
    import diag_cuda_attention

    assert diag_cuda_attention.main(["--cases", "probe_decode"]) == 2
    assert "no Hopper kernel" in capsys.readouterr().out
