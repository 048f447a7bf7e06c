"""scripts/diag_upload.py runs where CI runs (MLX on the CPU): it checks that the bytes it times arrive intact and
reports every figure the GPU results quote (benchmarks/results/*-diag-upload.log)."""
from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_diag_upload_smoke():
    done = subprocess.run([sys.executable, str(ROOT / "scripts" / "diag_upload.py"), "--mib", "0.3", "--repeats", "2"],
                          capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    figures = ast.literal_eval(done.stdout.split(": ", 1)[1].strip())
    assert {"host_write_ms", "first_device_read_ms", "second_device_read_ms", "total_ms"} <= set(figures)
    assert all(figures[k] > 0 for k in ("host_write_ms", "first_device_read_ms", "total_ms"))
    assert "torch_pinned_h2d_ms" in figures or "torch_pinned_h2d_error" in figures
