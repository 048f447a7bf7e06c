"""Process-wide settings of the engine's worker processes, each checked in a fresh interpreter."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest


def _run(code: str) -> dict:
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_keep_torch_out_hides_torch_from_transformers_only_when_not_imported():
    pytest.importorskip("torch")   # with torch absent there is nothing to hide
    got = _run("""
import json, sys
from batchjob.engine.process_setup import keep_torch_out
first, second = keep_torch_out(), keep_torch_out()
from transformers.utils import is_torch_available
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil
try:
    import torch
    imported = True
except ImportError:
    imported = False
print(json.dumps({"first": first, "second": second, "available": is_torch_available(), "imported": imported}))
""")
    assert got == {"first": True, "second": False, "available": False, "imported": False}
    got = _run("""
import json, torch
from batchjob.engine.process_setup import keep_torch_out
print(json.dumps({"hid": keep_torch_out(), "usable": bool(torch.ones(2).sum() == 2)}))
""")
    assert got == {"hid": False, "usable": True}


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_set_blas_threads_caps_a_preloaded_openblas(threads):
    got = _run(f"""
import ctypes, json
from batchjob.engine.process_setup import set_blas_threads
try:
    before = ctypes.CDLL(None).openblas_get_num_threads()
except AttributeError:
    before = None
print(json.dumps({{"before": before, "after": set_blas_threads({threads})}}))
""")
    if got["before"] is None:   # no OpenBLAS in this process (scripts/env.sh preloads it): a no-op
        assert got["after"] is None
    else:
        assert got["after"] == threads
