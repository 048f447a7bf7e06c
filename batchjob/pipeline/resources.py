"""How many decoders and engine replicas a run gets, and how much of a GPU each replica asks Ray for.

`runtime.engine_actors`, `engine_gpus` and `decode_actors` may say `auto`; `resolve_runtime` turns them into
numbers from what Ray reports (CPUs and GPUs of the local machine or the joined cluster). It is a pure function
so every rule is unit-tested without Ray; the numbers it returns go into the run's statistics.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from batchjob.config import ConfigError, JobConfig


@dataclass(frozen=True)
class Resources:
    """What Ray reports: logical CPUs and GPUs (summed over the cluster's nodes)."""
    cpus: float
    gpus: float


@dataclass(frozen=True)
class ResolvedRuntime:
    decoders: int
    engines: int
    engine_gpus: float      # Ray num_gpus per engine replica (0: the engine runs without a Ray GPU)
    decode_cpus: float
    engine_cpus: float

    @property
    def cpus_needed(self) -> float:
        return self.decoders * self.decode_cpus + self.engines * self.engine_cpus

    @property
    def gpus_needed(self) -> float:
        return self.engines * self.engine_gpus


def resolve_runtime(cfg: JobConfig, found: Resources) -> ResolvedRuntime:
    """Numbers for every `auto`; ConfigError (naming the key and the fix) when Ray cannot place what was asked.

    - engine_gpus auto: 1 when Ray reports a GPU and model.device is not cpu, else 0 (an engine on Metal
      or on the CPU needs no Ray GPU); for vLLM, its tensor_parallel_size (one replica spans that many GPUs).
    - engine_actors auto: one replica per GPU share when the engines use GPUs (GPUs // engine_gpus), else 1.
    - decode_actors auto: the CPUs left after the engines' CPUs, each decoder taking decode_cpus, at least 1.
    """
    rt = cfg.runtime
    vllm = cfg.model.vllm if cfg.model.engine == "vllm" else None
    per_replica = float(vllm.tensor_parallel_size) if vllm else 1.0
    if rt.engine_gpus == "auto":
        engine_gpus = per_replica if found.gpus >= per_replica and cfg.model.device != "cpu" else 0.0
    else:
        engine_gpus = float(rt.engine_gpus)
    if engine_gpus > 0 and cfg.model.device == "cpu":
        raise ConfigError(f"runtime.engine_gpus: {engine_gpus:g} GPU per engine, but model.device is cpu; "
                          "set engine_gpus to 0 (or auto), or model.device to auto")
    if rt.engine_actors == "auto":
        engines = max(1, math.floor(found.gpus / engine_gpus + 1e-9)) if engine_gpus > 0 else 1
    else:
        engines = rt.engine_actors
    if engines * engine_gpus > found.gpus + 1e-9:
        raise ConfigError(f"runtime: {engines} engine replica(s) x engine_gpus {engine_gpus:g} need "
                          f"{engines * engine_gpus:g} GPUs, but Ray reports {found.gpus:g}; lower "
                          "runtime.engine_actors or engine_gpus (auto fits them), or run where the GPUs are visible "
                          "(CUDA_VISIBLE_DEVICES)")
    if rt.decode_actors == "auto":
        left = found.cpus - engines * rt.engine_cpus
        decoders = max(1, math.floor(left / rt.decode_cpus + 1e-9))
    else:
        decoders = rt.decode_actors
    plan = ResolvedRuntime(decoders=decoders, engines=engines, engine_gpus=engine_gpus,
                           decode_cpus=rt.decode_cpus, engine_cpus=rt.engine_cpus)
    if plan.cpus_needed > found.cpus + 1e-9:   # Ray would leave actors pending forever
        raise ConfigError(f"runtime: {decoders} decoder(s) x decode_cpus {rt.decode_cpus:g} + {engines} engine "
                          f"replica(s) x engine_cpus {rt.engine_cpus:g} need {plan.cpus_needed:g} CPUs, but Ray "
                          f"reports {found.cpus:g}; lower decode_actors, decode_cpus or engine_cpus")
    return plan


def cpus_to_start(cfg: JobConfig) -> float:
    """Logical CPUs a local Ray must offer before the plan is known: the explicit counts (an `auto` one
    needs at least one actor); `auto` decoders then fill what the machine has."""
    rt = cfg.runtime
    decoders = rt.decode_actors if rt.decode_actors != "auto" else 1
    engines = rt.engine_actors if rt.engine_actors != "auto" else 1
    return decoders * rt.decode_cpus + engines * rt.engine_cpus


OBJECT_STORE_PER_CLIP = 256 * 2**20   # a 16-frame 1080p clip is ~100 MB of frames, its prepared input ~40 MB
OBJECT_STORE_MIN = 2 * 2**30
OBJECT_STORE_HOST_SHARE = 0.3         # Ray's own default: 30% of RAM


def object_store_bytes(frames_in_flight: int, host_ram: int) -> int:
    """A local Ray's object store, sized from what the job keeps in flight (frames_in_flight clips' payloads
    and their answers) instead of Ray's 30% of RAM: the store is set up at start (a larger one starts slower)
    and its pages are host memory the decoders and the OS compete for. Never above Ray's own default."""
    want = max(OBJECT_STORE_MIN, frames_in_flight * OBJECT_STORE_PER_CLIP)
    return int(min(want, host_ram * OBJECT_STORE_HOST_SHARE))


DECODER_RESIDENT = 512 * 2**20   # a decoder process's resident memory (interpreter, PyAV, numpy, a clip)


def host_reserved_bytes(decoders: int, frames_in_flight: int, host_ram: int) -> int:
    """What the job's processes beside the engine hold on its machine: the decoders and Ray's object store. On
    Apple silicon (and on a CPU) that is the memory the engine's budget comes from, so the engine leaves it."""
    return decoders * DECODER_RESIDENT + object_store_bytes(frames_in_flight, host_ram)


def local_ray_cpus(cpus_needed: float) -> int:
    """The logical CPUs a private local Ray offers: the cores this process may use, or more when the actors
    asked for need more (the OS then shares the cores)."""
    return max(local_cpus(), math.ceil(cpus_needed))


def ray_resources() -> Resources:
    """The CPUs and GPUs of the Ray instance this process is connected to."""
    import ray

    res = ray.cluster_resources()
    return Resources(cpus=float(res.get("CPU", 0.0)), gpus=float(res.get("GPU", 0.0)))


def local_cpus() -> int:
    """Cores this process may use (a container's or taskset's limit, not the host's count)."""
    import os

    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:   # macOS
        return os.cpu_count() or 1
