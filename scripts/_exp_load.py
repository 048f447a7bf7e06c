"""Temporary experiment (not committed): ways to get a 7B checkpoint's weights onto the GPU with MLX."""
import glob, json, os, struct, subprocess, sys, time
from concurrent.futures import ThreadPoolExecutor
import numpy as np

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
elif which.startswith("numpy"):
    threads = int(which.split("_")[1]) if "_" in which else 1
    DT = {"BF16": (np.uint16, mx.bfloat16), "F32": (np.float32, None), "F16": (np.float16, None), "U32": (np.uint32, None)}
    jobs = []
    for f in files:
        with open(f, "rb") as fh:
            n = struct.unpack("<Q", fh.read(8))[0]
            header = json.loads(fh.read(n))
        mm = np.memmap(f, dtype=np.uint8, mode="r")
        for k, v in header.items():
            if k == "__metadata__": continue
            a, b = v["data_offsets"]
            npdt, view = DT[v["dtype"]]
            jobs.append((k, mm[8 + n + a: 8 + n + b].view(npdt).reshape(v["shape"]), view))
    def conv(j):
        k, arr, view = j
        x = mx.array(arr)
        return k, (x.view(view) if view is not None else x)
    t1 = now()
    with ThreadPoolExecutor(threads) as ex:
        ws = dict(ex.map(conv, jobs))
    mx.eval(list(ws.values())); out["host_copy_s"] = now() - t1
    t2 = now(); s = [mx.sum(v) for v in ws.values()]; mx.eval(s); mx.synchronize(); out["first_gpu_use_s"] = now() - t2
    t3 = now(); s = [mx.sum(v) for v in ws.values()]; mx.eval(s); mx.synchronize(); out["second_gpu_use_s"] = now() - t3
out["total_s"] = now() - t0
out["gb"] = sum(os.path.getsize(f) for f in files) / 2**30
print("RESULT", json.dumps(out), flush=True)
