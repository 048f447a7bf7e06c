"""Starting or joining Ray the way an unattended job on a shared machine should.

Local by default, and private: a fresh Ray bound to 127.0.0.1 with no dashboard. `address=None` in
`ray.init` would silently join whatever cluster `ray start` last left on the machine, so a local run
asks for "local" explicitly. With an address the job joins that cluster and scales out.
"""
from __future__ import annotations

import logging
import os


def ray_env_defaults() -> None:
    """No usage reporting; token auth off unless the site chose it (a stray ~/.ray/auth_token otherwise
    makes explicit-address joins fail after ~20 s, see PLATFORM.md)."""
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")


def start_ray(address: str | None, cpus_needed: float, object_store_memory: int | None = None) -> bool:
    """Connect to Ray; returns True when this process started (and so must stop) a local instance.
    `object_store_memory` sizes a local instance's store (None: Ray's default); a cluster keeps its own."""
    ray_env_defaults()
    import ray

    if ray.is_initialized():
        return False
    quiet = dict(log_to_driver=os.environ.get("BATCHJOB_RAY_LOGS") == "1", logging_level=logging.WARNING,
                 configure_logging=True)
    if address:
        ray.init(address=address, **quiet)
        return True
    from batchjob.pipeline.resources import local_ray_cpus

    # Enough logical CPUs for every actor we ask for, even on a 2-core laptop: the OS shares the cores.
    # GPUs are left to Ray's own detection (it honours CUDA_VISIBLE_DEVICES), so engines can ask for them.
    num_cpus = local_ray_cpus(cpus_needed)
    ray.init(address="local", num_cpus=num_cpus, include_dashboard=False, _node_ip_address="127.0.0.1",
             object_store_memory=object_store_memory, **quiet)
    return True


def stop_ray() -> None:
    import ray

    if ray.is_initialized():
        ray.shutdown()
