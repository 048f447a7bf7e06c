"""Diagnostic: a local Ray's start on this machine (import, init, four actors, shutdown), with and without its
worker prestart. The bench's own start-up breakdown (`startup.steps.ray_start`) is the figure of record.

    python3 scripts/diag_ray_start.py
"""
import os, sys, time, subprocess
code = """
import time, os, logging
t = time.perf_counter()
import ray
t1 = time.perf_counter()
ray.init(address="local", num_cpus=16, include_dashboard=False, _node_ip_address="127.0.0.1", log_to_driver=False, logging_level=logging.WARNING)
t2 = time.perf_counter()
@ray.remote(num_cpus=1)
class A:
    def ping(self): return os.getpid()
a = [A.remote() for _ in range(4)]
ray.get([x.ping.remote() for x in a])
t3 = time.perf_counter()
ray.shutdown()
print("RESULT", round(t1-t, 2), round(t2-t1, 2), round(t3-t2, 2), round(time.perf_counter()-t3, 2))
"""
for label, extra in (("default", {}), ("no_prestart", {"RAY_enable_worker_prestart": "0", "RAY_prestart_worker_first_driver": "0"}), ("default2", {})):
    env = dict(os.environ, RAY_USAGE_STATS_ENABLED="0", RAY_AUTH_MODE="disabled", **extra)
    t = time.perf_counter()
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    line = [l for l in out.stdout.splitlines() if l.startswith("RESULT")]
    print(label, "import/init/4 actors/shutdown:", line, "total", round(time.perf_counter() - t, 2), out.stderr[-300:] if not line else "")
