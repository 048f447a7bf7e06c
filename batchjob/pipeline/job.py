"""One job from config to Parquet: preflight checks, resume, Ray start-up, the driver, the final flush."""
from __future__ import annotations

import os
import platform
import signal
import threading
from dataclasses import dataclass
from datetime import datetime, timezone
from importlib import metadata
from pathlib import Path
from typing import Callable

from batchjob.config import JobConfig
from batchjob.contract import StartupStep
from batchjob.datasets import Row
from batchjob.pipeline.driver import Driver, RunStats
from batchjob.pipeline.driver_engine import DriverEngine
from batchjob.pipeline.output import PartWriter, lock_output, prepare_output, read_verified
from batchjob.pipeline.placement import Placement, single_replica
from batchjob.pipeline.resume import RESUME_COLUMNS, ResumePlan, answered_rows, plan_resume, rescore_rows
from batchjob.pipeline.retry import RowSink, commit_retry, staging_writer
from batchjob.pipeline.work import group_by_clip
from batchjob.preflight import preflight, refuse_if_no_clip_exists
from batchjob.startup import StepClock


class EngineStartError(RuntimeError):
    """The engine could not load (bad checkpoint, memory budget...): exit 1, nothing was written."""


class JobTerminated(Exception):
    """SIGTERM (a cron or systemd timeout) arrived: the run unwinds, flushing finished rows and stopping Ray."""


_terminate = threading.Event()


def _on_sigterm(signum, frame) -> None:
    # Only set a flag: an exception raised inside Ray's Cython calls turns into a SystemError. The
    # driver's progress hook raises JobTerminated at the next loop turn (within ~0.5 s).
    _terminate.set()


def _catch_sigterm():
    """Installed after ray.init, which sets its own SIGTERM handler (it would exit without our flush).
    Only the main thread may set handlers; elsewhere the caller's own handling applies."""
    _terminate.clear()
    if threading.current_thread() is threading.main_thread():
        return signal.signal(signal.SIGTERM, _on_sigterm)
    return None


def versions() -> dict[str, str]:
    out = {"python": platform.python_version(), "platform": platform.platform()}
    for dist in ("batchjob", "mlx", "mlx-vlm", "transformers", "av", "ray", "pyarrow", "numpy"):
        try:
            out[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            pass
    return out


@dataclass(frozen=True)
class RunOptions:
    """How `batchjob run` treats the existing output. `retry_errors`: answer only the error rows (and edited
    rows) again, in place; `repair`: move damaged parts aside and answer their rows again; `output_key`: how
    messages name the output directory (`--output` when the flag set it)."""
    restart: bool = False
    retry_errors: bool = False
    repair: bool = False
    output_key: str | None = None
    owns_process: bool = False   # the CLI's own process: an engine in the driver may hide torch, cap BLAS threads


def run_job(cfg: JobConfig, options: RunOptions = RunOptions(), *,
            on_start: Callable[[RunStats], None] | None = None,
            on_progress: Callable[[RunStats], None] | None = None) -> RunStats:
    """Run (or resume) the job; rows already in the output are skipped. Returns this run's statistics.

    The checks and the output scan come first (a refused config or a finished job never starts Ray), then Ray.
    An engine in the driver (pipeline/placement.py) loads on its thread from launch, beside all of that: Ray's
    start is slower beside it (Ray forks the driver for each of its processes, and the driver then holds the
    weights) but the load is hidden, which wins over an actor loading after Ray (benchmarks/results/README.md).
    Refused or finished, such a run waits for the load's current step to end (its clock marks are where it can
    stop). With engines in actors, a thread reads the weights' uncached pages
    while Ray starts (pipeline/readahead.py)."""
    import time

    from batchjob.startup import seconds_since_launch

    t0 = time.perf_counter()
    launched = seconds_since_launch()
    clock = StepClock(t0 - launched if launched is not None else t0)
    clock.mark("launch")     # the interpreter, the CLI's imports (and its BLAS re-exec)
    started_at = datetime.now(timezone.utc)
    placement = plan_placement(cfg, options.owns_process)
    early = _start_engine_early(cfg, options, placement) if placement.in_driver else None
    try:
        prepared = _prepare(cfg, options, clock)
        if prepared.clips and early is None:   # the disk reads the weights while Ray starts (pipeline/readahead.py)
            from batchjob.pipeline.readahead import warm_page_cache, weight_files

            warm_page_cache(weight_files(cfg.model.checkpoint))
        try:
            return _run_prepared(cfg, prepared, options, t0, started_at, on_start, on_progress, clock, placement,
                                 early)
        finally:
            os.close(prepared.lock_fd)
    finally:
        if early is not None:
            early.close()


def _start_engine_early(cfg: JobConfig, options: RunOptions, placement: Placement) -> DriverEngine | None:
    """The driver's engine loading from launch, beside the checks, the scan and Ray's start; None when the
    plan cannot be known yet (a config problem the checks will name)."""
    from batchjob.config import ConfigError
    from batchjob.pipeline.placement import local_gpu_count
    from batchjob.pipeline.resources import Resources, cpus_to_start, local_ray_cpus, resolve_runtime

    one = single_replica(cfg)
    try:   # the plan a local Ray will give (its CPUs and the GPUs it will see), known before it starts
        plan = resolve_runtime(one, Resources(cpus=local_ray_cpus(cpus_to_start(one)), gpus=local_gpu_count()))
    except ConfigError:
        return None
    return DriverEngine(_reserve_host(cfg, plan.decoders), cfg.prompt, cpus=cfg.runtime.engine_cpus,
                        process_wide=options.owns_process)


def _reserve_host(cfg: JobConfig, decoders: int):
    """The model config with `host_reserved_gb` set (unless the job set it): what the decoders and Ray's object
    store hold of the engine's memory (one memory on Apple machines and CPUs)."""
    from batchjob.engine.memory_budget import host_ram_bytes
    from batchjob.pipeline.resources import host_reserved_bytes

    if cfg.model.host_reserved_gb is not None:
        return cfg.model
    reserved = host_reserved_bytes(decoders, cfg.runtime.frames_in_flight, host_ram_bytes())
    return cfg.model.model_copy(update={"host_reserved_gb": reserved / 2**30})


@dataclass
class _Prepared:
    """The job checked and its output scanned, under the output's lock: what Ray's side of the run needs."""
    manifest: dict
    resume: ResumePlan
    clips: list
    stats: RunStats
    lock_fd: int


def _prepare(cfg: JobConfig, options: RunOptions, clock: StepClock) -> _Prepared:
    """Preflight checks, the output's lock, the resume scan and the clip plan, a clock mark after each."""
    rows = preflight(cfg, output_key=options.output_key)
    clock.mark("preflight")
    manifest = {"job": cfg.job, "config": cfg.model_dump(), "versions": versions()}
    lock_fd = lock_output(Path(cfg.output.directory))
    try:
        stats = RunStats(total_rows=len(rows))
        resume = _resume(cfg, rows, manifest, options, stats)
        clips = group_by_clip(rows, {r.row_id for r in rows} - resume.run, cfg.loader.name, cfg.loader.num_frames,
                              cfg.loader.kwargs)
    except BaseException:
        os.close(lock_fd)
        raise
    clock.mark("output_scan")     # the lock, the resume scan of the output, the clip plan
    return _Prepared(manifest, resume, clips, stats, lock_fd)


def plan_placement(cfg: JobConfig, owns_process: bool = True) -> Placement:
    """Where the engine runs (pipeline/placement.py); `auto` asks the engine whether it has a GPU here (MLX
    answers without touching a device), and keeps actors inside a caller's own program (`owns_process`
    False: a process that hosted MLX must end with os._exit, which only the CLI may decide). Actors when the
    config has a problem the checks will name next."""
    from batchjob.config import ConfigError
    from batchjob.pipeline.engines import resolve_engine
    from batchjob.pipeline.placement import choose_placement, local_gpu_count

    try:
        engine = resolve_engine(cfg.model.engine)
        placement = choose_placement(cfg, local_gpu_count(), bool(getattr(engine, "runs_in_driver", False)))
        if placement.gpu_only and not owns_process:
            return Placement("actors", False, "auto: inside another program the engine keeps its own process")
        if placement.gpu_only and not engine.on_gpu(cfg.model):
            return Placement("actors", False, "auto: the engine runs on the CPU here")
        return placement
    except ConfigError:
        return Placement("actors", False, "the config has a problem")
    except Exception as err:   # e.g. the engine's device query failing: its load will say it again, in an actor
        return Placement("actors", False, f"auto: the engine could not say where it runs ({type(err).__name__})")


def _resume(cfg: JobConfig, rows: list[Row], manifest: dict, options: RunOptions, stats: RunStats) -> ResumePlan:
    """Read back the output, finish an interrupted replacement, plan the run, re-score edited answer keys."""
    out_dir = Path(cfg.output.directory)
    prepared = prepare_output(out_dir, cfg.fingerprint(), manifest, restart=options.restart, repair=options.repair,
                              columns=RESUME_COLUMNS)
    existing = prepared.existing
    if commit_retry(out_dir):   # a replacement a crash interrupted (it moves rows, never adds or drops one)
        existing = read_verified(out_dir, RESUME_COLUMNS)
    plan = plan_resume(rows, answered_rows(existing), retry_errors=options.retry_errors)
    refuse_if_no_clip_exists(cfg, [r for r in rows if r.row_id in plan.run], rows)
    stats.repaired_parts = [d.path.name for d in prepared.moved]
    stats.rescored_rows = rescore_rows(out_dir, plan.rescore)
    stats.edited_rows, stats.retried_rows = plan.edited, plan.retried
    stats.skipped_rows = len(rows) - len(plan.run)
    return plan


def _engine_error(cfg: JobConfig, err: BaseException) -> EngineStartError:
    """The engine's own message (the last line of a Ray-wrapped traceback), naming engine and checkpoint."""
    lines = [ln.strip() for ln in str(getattr(err, "cause", None) or err).splitlines() if ln.strip()]
    return EngineStartError(f"engine {cfg.model.engine!r} could not load {cfg.model.checkpoint}: "
                            f"{lines[-1] if lines else type(err).__name__}")


def _run_prepared(cfg: JobConfig, prepared: _Prepared, options: RunOptions, t0: float, started_at: datetime,
                  on_start: Callable[[RunStats], None] | None, on_progress: Callable[[RunStats], None] | None,
                  clock: StepClock, placement: Placement, early: DriverEngine | None = None) -> RunStats:
    """From a prepared job to its last row: Ray, the engine, the decoders, the driver, the final flush."""
    import time

    import ray

    from batchjob.engine.memory_budget import host_ram_bytes
    from batchjob.pipeline.actors import make_decoders, make_engines
    from batchjob.pipeline.driver_engine import DriverWorkers
    from batchjob.pipeline.engines import resolve_engine
    from batchjob.pipeline.ray_runtime import start_ray, stop_ray
    from batchjob.pipeline.remote_inputs import remote_options
    from batchjob.pipeline.resources import cpus_to_start, object_store_bytes, ray_resources, resolve_runtime
    from batchjob.pipeline.workers import RayWorkers
    from batchjob.startup import Startup

    out_dir, fingerprint = Path(cfg.output.directory), cfg.fingerprint()
    manifest, resume, clips, stats = prepared.manifest, prepared.resume, prepared.clips, prepared.stats
    loader, n, kw = cfg.loader.name, cfg.loader.num_frames, cfg.loader.kwargs
    rt = cfg.runtime
    if on_start:
        on_start(stats)
    if not clips:
        return stats
    launched_wall = time.time() - (time.perf_counter() - clock.origin)
    in_driver = placement.in_driver
    started = start_ray(rt.ray_address, cpus_to_start(single_replica(cfg) if in_driver else cfg),
                        object_store_bytes(rt.frames_in_flight, host_ram_bytes()))
    clock.mark("ray_start")
    previous = _catch_sigterm()
    driver: Driver | None = None
    stream_start: float | None = None
    writer: RowSink | None = None
    decoders: list = []
    engines: list = []
    try:
        plan = resolve_runtime(single_replica(cfg) if in_driver else cfg, ray_resources())  # `auto` -> numbers
        stats.decoders, stats.engines, stats.engine_gpus = plan.decoders, plan.engines, plan.engine_gpus
        engine_cls = resolve_engine(cfg.model.engine)
        model = _reserve_host(cfg, plan.decoders)
        if in_driver and early is None:   # loads on its thread while the decoders start
            early = DriverEngine(model, cfg.prompt, cpus=rt.engine_cpus, process_wide=options.owns_process)
        elif not in_driver:
            engines = make_engines(plan.engines, plan.engine_cpus, model, cfg.prompt, plan.engine_gpus)
        decoders = make_decoders(plan.decoders, plan.decode_cpus, loader, n, kw,
                                 engine_cls.input_preparer(cfg.model), remote_options(rt))
        try:
            described = [early.description()] if in_driver else ray.get([e.describe.remote() for e in engines])
        except Exception as err:
            # A Ray-wrapped error's last line is the engine's own message; the driver's thread raises it as is.
            raise _engine_error(cfg, err) from None
        clock.mark("engine_load")    # every replica's model loaded (what of it the steps before did not hide)
        stats.model = described[0].model_id
        stats.memory = dict(described[0].details.get("memory") or {})
        # Who answered goes into every part's metadata (next to the config and versions).
        engine_info = {"engine": described[0].engine, "model_id": described[0].model_id,
                       **dict(described[0].details)}
        stats.engine_runtime = {k: str(v) for k, v in described[0].details.items() if k != "memory"}
        stats.engine_runtime["placement"] = placement.where
        stats.engine_runtime["placement_reason"] = placement.reason
        file_meta = {**manifest, "fingerprint": fingerprint, "engine": engine_info}
        per_part, every = cfg.output.rows_per_part, cfg.output.flush_seconds
        writer = parts = RowSink(PartWriter(out_dir, file_meta, per_part, every),
                                 staging_writer(out_dir, file_meta, per_part, every) if resume.replace else None,
                                 resume.replace)
        if _terminate.is_set():          # SIGTERM while the model loaded
            raise JobTerminated()

        def progress(s: RunStats) -> None:
            if _terminate.is_set():
                raise JobTerminated()
            parts.maybe_flush()
            s.wall_s = time.perf_counter() - t0
            if on_progress:
                on_progress(s)

        workers = DriverWorkers(decoders, early) if in_driver else RayWorkers(decoders, engines)
        driver = Driver(cfg, workers, stats.model, parts.add, stats, progress, started_at)
        stats.startup = Startup(engine=list(described[0].startup))
        stream_start = clock.mark("writer")
        driver.run(clips)
    finally:
        if writer is not None:
            writer.flush()   # finished rows are complete rows: keep them even when the run fails
            stats.actor_peak_rss_mb = _actor_peak_rss(engines, decoders)
        if stats.startup is not None and stream_start is not None and driver.first_row_at is not None:
            steps = [*clock.steps, StartupStep("first_answer", driver.first_row_at - stream_start)]
            stats.startup.steps = steps
            stats.startup.total_s = sum(s.seconds for s in steps)
            stats.startup.overlapped = _decoders_ready(decoders, launched_wall)
            if early is not None and early.ready_at is not None:
                stats.startup.overlapped["engine_ready_s"] = early.ready_at - clock.origin
        if resume.replace:
            commit_retry(out_dir)
        stats.wall_s = time.perf_counter() - t0
        if early is not None:
            early.close()    # before Ray stops: a batch still answering may be resolving its payloads
        if started:
            stop_ray()
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
    return stats


def _decoders_ready(decoders: list, launched_wall: float) -> dict[str, float]:
    """Seconds from launch until the decoders were ready (median and last): they start beside the engine's
    load, off the critical path unless they are slower. Best effort, like the memory figures."""
    import ray

    try:
        refs = [d.ready_time.remote() for d in decoders]
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=5) if refs else ([], [])
        times = sorted(ray.get(r) - launched_wall for r in ready)
    except Exception:
        return {}
    if not times:
        return {}
    return {"decoders_ready_median_s": times[len(times) // 2], "decoders_ready_last_s": times[-1]}


def _actor_peak_rss(engines: list, decoders: list) -> dict[str, list[float]]:
    """Peak memory of each live actor process, for the run's statistics; best effort, never fails the run."""
    import ray

    out: dict[str, list[float]] = {}
    try:
        for name, actors in (("engines", engines), ("decoders", decoders)):
            refs = [a.peak_rss_mb.remote() for a in actors]
            ready, _ = ray.wait(refs, num_returns=len(refs), timeout=5) if refs else ([], [])
            values = []
            for ref in ready:
                try:
                    values.append(round(float(ray.get(ref)), 1))
                except ray.exceptions.RayError:    # a dead replica or decoder
                    pass
            out[name] = values
    except Exception:   # Ray itself failing: the run's own error matters, not this figure
        pass
    return out
