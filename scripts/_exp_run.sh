#!/bin/bash
# Temporary: checkpoint write, then each load way in a fresh process (page cache warm after the first).
set -u
python3 -c "import sys; sys.path.insert(0,'scripts'); import bench_pipeline_gpu as b; from batchjob.synthetic.random_engine import QWEN25_VL_7B; from pathlib import Path; print(b.ensure_checkpoint(Path('/tmp/bjcache'), QWEN25_VL_7B, 28, 32, 200704, 'bfloat16'))"
C=$(ls -d /tmp/bjcache/checkpoint-*)
ls -la $C
for w in cat mlx_vlm mxload_gpu mxload_cpu numpy_1 numpy_8 mlx_vlm; do timeout 120 python3 scripts/_exp_load.py $C $w 2>&1 | grep -E "RESULT|Error|error" | tail -3; done
# Ray start: where the seconds go (log timestamps of a fresh local start)
python3 - <<'PY'
import time, logging, os, glob
t = time.perf_counter()
import ray
ray.init(address="local", num_cpus=16, include_dashboard=False, _node_ip_address="127.0.0.1", log_to_driver=False, logging_level=logging.WARNING)
print("ray.init", round(time.perf_counter() - t, 2))
logs = sorted(glob.glob("/tmp/ray/session_latest/logs/*"))
for f in logs:
    if os.path.isfile(f) and (f.endswith(".log") or f.endswith(".out") or f.endswith(".err")):
        lines = open(f, errors="replace").read().splitlines()
        if lines:
            print(os.path.basename(f), len(lines), "|", lines[0][:110], "|", lines[-1][:110])
ray.shutdown()
PY
for os_mem in 2000000000; do python3 -c "
import time, logging, ray
t=time.perf_counter(); ray.init(address='local', num_cpus=16, include_dashboard=False, _node_ip_address='127.0.0.1', log_to_driver=False, logging_level=logging.WARNING, object_store_memory=$os_mem); print('ray.init object_store', $os_mem, round(time.perf_counter()-t,2)); ray.shutdown()"; done
