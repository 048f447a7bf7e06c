"""Where a job's engine runs: in the driver's own process, or in Ray actors (one per replica).

A local job with one replica gains nothing from an engine actor but start-up: the actor can only be created
once Ray is up, so its model load (seconds to tens of seconds at 7B) follows Ray's start. In the driver the
load begins at launch, beside the checks, the output scan, Ray's start and the decoders' start. Actors stay
the choice where replicas must be isolated or spread: several GPUs, a cluster, an engine that cannot share
the driver's process (vLLM runs its own workers), or when asked. `auto` picks the driver only where the
engine runs on a GPU: there the load dominates start-up, while a CPU engine loads in moments and keeps its
BLAS threads and torch-hiding out of the caller's process.

The choice is a pure function of the config and what the machine shows before Ray starts, so every rule is
unit-tested; the run's statistics record it with its reason.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from batchjob.config import ConfigError, JobConfig

@dataclass(frozen=True)
class Placement:
    where: str           # "driver" | "actors"
    gpu_only: bool       # auto: the driver only once the engine says it runs on a GPU (else actors)
    reason: str

    @property
    def in_driver(self) -> bool:
        return self.where == "driver"


def choose_placement(cfg: JobConfig, local_gpus: int, engine_can: bool) -> Placement:
    """The engine's placement for this job; ConfigError naming the key when `driver` was asked where it
    cannot be. `local_gpus`: the GPUs a local Ray would report; `engine_can`: the engine class can run in the
    driver's process (`runs_in_driver`)."""
    rt, requested = cfg.runtime, cfg.runtime.engine_placement
    if requested == "actors":
        return Placement("actors", False, "runtime.engine_placement: actors")
    why_not = None
    if rt.ray_address:
        why_not = "the job joins a Ray cluster (runtime.ray_address), where replicas are actors"
    elif not engine_can:
        why_not = f"engine {cfg.model.engine!r} runs only in its own process"
    elif rt.engine_actors != "auto" and rt.engine_actors > 1:
        why_not = f"runtime.engine_actors is {rt.engine_actors} (the driver holds one replica)"
    if why_not is not None:
        if requested == "driver":
            raise ConfigError(f"runtime.engine_placement: driver, but {why_not}; set engine_placement to auto "
                              "or actors")
        return Placement("actors", False, f"auto: {why_not}")
    if requested == "driver":
        return Placement("driver", False, "runtime.engine_placement: driver")
    if rt.engine_actors == "auto" and cfg.model.device != "cpu" and local_gpus > 1:
        return Placement("actors", False, f"auto: {local_gpus} GPUs, one replica each")
    if cfg.model.device == "cpu":
        return Placement("actors", False, "auto: model.device is cpu")
    return Placement("driver", True, "auto: a local job with one replica, its engine on a GPU")


def single_replica(cfg: JobConfig) -> JobConfig:
    """The config a driver-placed engine runs under: one replica, no Ray GPU reserved for it (the driver's
    process uses the GPUs it sees), its CPUs still kept from the decoders."""
    rt = cfg.runtime.model_copy(update={"engine_actors": 1, "engine_gpus": 0.0})
    return cfg.model_copy(update={"runtime": rt})


def local_gpu_count(environ: dict[str, str] | None = None, proc: Path = Path("/proc/driver/nvidia/gpus")) -> int:
    """NVIDIA GPUs a local Ray would report, without starting it: CUDA_VISIBLE_DEVICES when set, else the
    driver's list of GPUs. 0 on machines without an NVIDIA driver (Ray reports no Apple GPU either)."""
    env = os.environ if environ is None else environ
    visible = env.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        return len([v for v in visible.split(",") if v.strip() and v.strip() != "-1"])
    try:
        return sum(1 for p in proc.iterdir() if p.is_dir())
    except OSError:
        return 0
