"""Diagnostic (not a benchmark of the user's path): ways to get a checkpoint's weights onto the GPU with MLX.

Each way runs in a fresh process on the same checkpoint directory (the page cache warm after the first):
  cat          read the files (the page cache's speed)
  mlx_vlm      mlx-vlm's load_model, lazy, then evaluate the parameters (what the engine did before)
  mxload_gpu   mx.load on the GPU stream, evaluate (MLX reads tensor by tensor on one thread)
  mxload_cpu   mx.load on the CPU stream (parallel reads into unified memory), then the first GPU use
Made the engine load on the CPU stream (engine/checkpoint.py). Run on the GPU machine:

    for w in cat mlx_vlm mxload_gpu mxload_cpu; do python3 scripts/diag_weight_load.py CHECKPOINT_DIR $w; done
"""
import glob
import json
import os
import sys
import time


path = sys.argv[1]
which = sys.argv[2]
files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
import mlx.core as mx
mx.set_default_device(mx.gpu)
def now(): return time.perf_counter()
t0 = now()
out = {"which": which}
if which == "cat":
    for f in files:
        with open(f, "rb") as fh:
            while fh.read(1 << 26):
                pass
    out["s"] = now() - t0
elif which == "mlx_vlm":
    from mlx_vlm.utils import load_model
    from pathlib import Path
    m = load_model(Path(path), lazy=True)
    out["build_lazy_s"] = now() - t0
    t1 = now(); mx.eval(m.parameters()); mx.synchronize(); out["eval_s"] = now() - t1
elif which == "mxload_gpu":
    ws = {}
    for f in files: ws.update(mx.load(f))
    out["lazy_s"] = now() - t0
    t1 = now(); mx.eval(list(ws.values())); mx.synchronize(); out["eval_s"] = now() - t1
elif which == "mxload_cpu":
    ws = {}
    for f in files: ws.update(mx.load(f, stream=mx.cpu))
    t1 = now(); mx.eval(list(ws.values())); out["cpu_eval_s"] = now() - t1
    t2 = now(); s = [mx.sum(v) for v in ws.values()]; mx.eval(s); mx.synchronize(); out["first_gpu_use_s"] = now() - t2
    t3 = now(); s = [mx.sum(v) for v in ws.values()]; mx.eval(s); mx.synchronize(); out["second_gpu_use_s"] = now() - t3
out["total_s"] = now() - t0
out["gb"] = sum(os.path.getsize(f) for f in files) / 2**30
print("RESULT", json.dumps(out), flush=True)
