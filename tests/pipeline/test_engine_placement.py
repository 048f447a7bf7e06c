"""The engine in the driver's process (`runtime.engine_placement`): the placement rules, the engine's thread
behind the driver's `Workers` seam (no Ray), and whole `batchjob run`s that must answer exactly as with actors."""
from __future__ import annotations

import json
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from batchjob.config import ConfigError, JobConfig
from batchjob.contract import ClipJob, ClipMetadata, EngineBase, EngineClip, Question
from batchjob.pipeline.driver_engine import DriverEngine, DriverWorkers
from batchjob.pipeline.placement import Placement, choose_placement, local_gpu_count, single_replica
from batchjob.pipeline.workers import TaskFailed

HERE = Path(__file__).resolve().parent


def job(*, model: dict | None = None, **runtime) -> JobConfig:
    return JobConfig.model_validate({
        "job": "t", "dataset": {"adapter": "manifest", "annotation": "m.jsonl"},
        "model": {"checkpoint": "ckpt", "engine": "mlx", **(model or {})},
        "runtime": runtime, "output": {"directory": "out"}})


# -- the rules ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("runtime, model, gpus, can, where, gpu_only, reason", [
    ({}, {}, 1, True, "driver", True, "one replica, its engine on a GPU"),
    ({}, {}, 0, True, "driver", True, "one replica"),              # Metal: Ray reports no GPU, MLX may
    ({}, {}, 4, True, "actors", False, "4 GPUs, one replica each"),
    ({"engine_actors": 1}, {}, 4, True, "driver", True, "one replica"),
    ({"engine_actors": 2}, {}, 1, True, "actors", False, "engine_actors is 2"),
    ({}, {"device": "cpu"}, 1, True, "actors", False, "model.device is cpu"),
    ({}, {}, 1, False, "actors", False, "runs only in its own process"),
    ({"ray_address": "10.0.0.1:6379"}, {}, 1, True, "actors", False, "Ray cluster"),
    ({"engine_placement": "actors"}, {}, 1, True, "actors", False, "engine_placement: actors"),
    ({"engine_placement": "driver"}, {"device": "cpu"}, 0, True, "driver", False, "engine_placement: driver"),
    ({"engine_placement": "driver"}, {}, 8, True, "driver", False, "engine_placement: driver"),
])
def test_placement_rules(runtime, model, gpus, can, where, gpu_only, reason):
    p = choose_placement(job(model=model, **runtime), gpus, can)
    assert (p.where, p.gpu_only) == (where, gpu_only) and reason in p.reason, p


@pytest.mark.parametrize("runtime, can, names", [
    ({"engine_actors": 3}, True, "engine_actors is 3"),
    ({"ray_address": "10.0.0.1:6379"}, True, "runtime.ray_address"),
    ({}, False, "runs only in its own process"),
])
def test_driver_placement_where_it_cannot_be_is_a_config_error(runtime, can, names):
    with pytest.raises(ConfigError, match=f"runtime.engine_placement: driver, but .*{names}.*auto or actors"):
        choose_placement(job(engine_placement="driver", **runtime), 1, can)


def test_unknown_placement_is_refused_by_the_schema():
    with pytest.raises(Exception, match="engine_placement"):
        job(engine_placement="gpu")


def test_single_replica_plan_keeps_the_engines_cpus_from_the_decoders(rng):
    from batchjob.pipeline.resources import Resources, resolve_runtime

    cpus = rng.randint(3, 64)
    plan = resolve_runtime(single_replica(job(engine_cpus=2)), Resources(cpus=cpus, gpus=8))
    assert (plan.engines, plan.engine_gpus, plan.decoders) == (1, 0.0, cpus - 2)


def test_local_gpu_count(tmp_path, rng):
    n = rng.randint(1, 8)
    for i in range(n):
        (tmp_path / f"0000:{i:02x}:00.0").mkdir()
    (tmp_path / "not-a-gpu").write_text("")
    assert local_gpu_count({}, tmp_path) == n
    assert local_gpu_count({}, tmp_path / "missing") == 0
    assert local_gpu_count({"CUDA_VISIBLE_DEVICES": ""}, tmp_path) == 0
    assert local_gpu_count({"CUDA_VISIBLE_DEVICES": "3,1"}, tmp_path) == 2


# -- the engine's thread, without Ray -------------------------------------------------------------------------
class ThreadEngine(EngineBase):
    """Records the thread it runs on; a question "FAIL" makes its batch raise; `gpu` says whether it is on one."""
    runs_in_driver = True
    gpu = True
    threads: list[str] = []

    def __init__(self, model, prompt):
        ThreadEngine.threads.append(threading.current_thread().name)
        self.model_id = "thread-test"

    @classmethod
    def on_gpu(cls, model):
        return cls.gpu

    def answer(self, clips):
        from batchjob.contract import Answer

        ThreadEngine.threads.append(threading.current_thread().name)
        out = []
        for c in clips:
            if any(q.text == "FAIL" for q in c.job.questions):
                raise RuntimeError(f"refuses {c.job.media_id}\nsecond line")
            total = int(np.asarray(c.payload).sum())
            out += [Answer(q.row_id, total % len(q.options), (1.0,) + (0.0,) * (len(q.options) - 1))
                    for q in c.job.questions]
        return out


class StagingEngine(ThreadEngine):
    """Stages batches ahead (`stage`) and says when its device is busy (`watch_device`); records when each batch's
    host work, device wait and staging happen. A question "STAGE-FAIL" makes its staging raise."""
    events: list[tuple[str, str, str, float]] = []     # (what, batch's first media id, thread, time)

    def __init__(self, model, prompt):
        super().__init__(model, prompt)
        self.busy = None

    def watch_device(self, busy):
        self.busy = busy

    def _note(self, what, clips):
        StagingEngine.events.append((what, clips[0].job.media_id, threading.current_thread().name, time.perf_counter()))

    def stage(self, clips):
        self._note("stage", clips)
        if any(q.text == "STAGE-FAIL" for c in clips for q in c.job.questions):
            raise RuntimeError("staging refuses")
        time.sleep(0.01)

    def answer(self, clips):
        self._note("host", clips)
        time.sleep(0.03)             # the call's own host work: no staging may run now
        self._note("busy", clips)
        for _ in range(3):           # a call of several passes: busy once each
            self.busy()
            time.sleep(0.02)         # the device's work, the thread waiting on it
        out = super().answer(clips)
        self._note("end", clips)
        return out


class SlowLoadEngine(ThreadEngine):
    """A load of many short steps, each marked on a StepClock (as the MLX engine's load is)."""

    @classmethod
    def load(cls, model, prompt):
        from batchjob.startup import StepClock

        clock = StepClock()
        for i in range(400):
            time.sleep(0.01)
            clock.mark(f"step{i}")
        return cls(model, prompt)


class BrokenEngine(ThreadEngine):
    @classmethod
    def load(cls, model, prompt):
        raise RuntimeError("no weights in ckpt")


@pytest.fixture
def engine_module(monkeypatch):
    """This module importable by name, so `model.engine` can name its engines."""
    monkeypatch.syspath_prepend(str(HERE))
    monkeypatch.setitem(sys.modules, "placement_engines", sys.modules[__name__])
    ThreadEngine.threads = []
    return "placement_engines"


def _clip(i: int, text: str = "q?") -> tuple[EngineClip, np.ndarray]:
    frames = np.random.default_rng(i).integers(0, 255, (2, 4, 4, 3), dtype=np.uint8)
    qs = tuple(Question(f"r{i}-{k}", text, ("a", "b", "c")) for k in range(2))
    return EngineClip(ClipJob(f"v{i}.mp4", f"v{i}", qs), ClipMetadata(frames_indices=(0, 1))), frames


def _driver_engine(module: str, cls: str) -> DriverEngine:
    cfg = job(model={"engine": f"{module}:{cls}"})
    return DriverEngine(cfg.model, cfg.prompt, resolve=lambda xs: xs)


def test_driver_engine_answers_on_its_own_thread_in_order(engine_module, rng):
    engine = _driver_engine(engine_module, "ThreadEngine")
    try:
        workers = DriverWorkers([], engine)
        assert engine.description().model_id == "thread-test"
        batches = [[_clip(rng.randrange(10**6)) for _ in range(rng.randint(1, 3))] for _ in range(5)]
        tickets = [workers.answer(0, [c for c, _ in b], [f for _, f in b]) for b in batches]
        results = {}
        while len(results) < len(tickets):
            for t in workers.wait([t for t in tickets if t not in results], timeout=5):
                results[t] = workers.result(t)
        for b, t in zip(batches, tickets):
            want = {q.row_id: int(f.sum()) % 3 for c, f in b for q in c.job.questions}
            assert {a.row_id: a.choice for a in results[t].answers} == want
            assert results[t].engine_ms >= 0
        assert set(ThreadEngine.threads) == {"batchjob-engine"}   # the load and every batch: one thread
        assert engine.ready_at is not None and engine.ready_at >= engine.started
    finally:
        engine.close()
    assert not engine._thread.is_alive()


def test_the_next_batch_is_staged_while_the_engine_waits_on_its_device(engine_module, rng):
    """Each batch after the first is staged on the staging thread while an earlier batch waits on its device,
    never during a batch's own host work; answers come back in order, a staging failure costs nothing."""
    StagingEngine.events = []
    engine = _driver_engine(engine_module, "StagingEngine")
    try:
        workers = DriverWorkers([], engine)
        engine.description()
        texts = ["q?"] * 6
        texts[rng.randrange(1, 6)] = "STAGE-FAIL"
        batches = [[_clip(100 + i, texts[i])] for i in range(6)]
        tickets = [workers.answer(0, [c for c, _ in b], [f for _, f in b]) for b in batches]
        results = [None] * len(tickets)
        for i, t in enumerate(tickets):
            workers.wait([t], timeout=10)
            results[i] = workers.result(t)
        for b, r in zip(batches, results):
            assert {a.row_id: a.choice for a in r.answers} == {q.row_id: int(f.sum()) % 3 for c, f in b
                                                              for q in c.job.questions}
    finally:
        engine.close()
    events = StagingEngine.events
    at = {(what, mid): t for what, mid, _, t in events}
    assert {thread for what, _, thread, _ in events if what == "stage"} == {"batchjob-engine-stage"}
    assert {thread for what, _, thread, _ in events if what != "stage"} == {"batchjob-engine"}
    ids = [b[0][0].job.media_id for b in batches]
    assert [mid for what, mid, _, _ in events if what == "host"] == ids       # answered in order
    for mid in ids:
        assert ("stage", mid) in at and at[("stage", mid)] < at[("host", mid)]   # staged before its answer began
        for other in ids:                                                      # never inside a call's host work
            assert not at[("host", other)] < at[("stage", mid)] < at[("busy", other)], (mid, other)
    for k, mid in enumerate(ids[1:], 1):     # queued behind running batches: staged in one's device wait
        assert any(at[("busy", prev)] < at[("stage", mid)] < at[("end", prev)] for prev in ids[:k]), mid


def test_a_failing_batch_is_a_task_failure_and_the_engine_goes_on(engine_module):
    engine = _driver_engine(engine_module, "ThreadEngine")
    try:
        workers = DriverWorkers([], engine)
        bad, good = _clip(1, "FAIL"), _clip(2)
        t_bad = workers.answer(0, [bad[0]], [bad[1]])
        t_good = workers.answer(0, [good[0]], [good[1]])
        assert workers.wait([t_bad, t_good], timeout=0) in ([], [t_bad], [t_bad, t_good])
        with pytest.raises(TaskFailed, match=r"^RuntimeError: refuses v1$"):
            workers.wait([t_bad], timeout=5)
            workers.result(t_bad)
        workers.wait([t_good], timeout=5)
        assert len(workers.result(t_good).answers) == 2
    finally:
        engine.close()


def test_auto_placement_asks_the_engine_whether_it_has_a_gpu(engine_module):
    from batchjob.pipeline.job import plan_placement

    cfg = job(model={"engine": f"{engine_module}:ThreadEngine"})
    ThreadEngine.gpu = False
    try:
        assert plan_placement(cfg) == Placement("actors", False, "auto: the engine runs on the CPU here")
    finally:
        ThreadEngine.gpu = True
    assert plan_placement(cfg).in_driver or local_gpu_count() > 1
    assert plan_placement(cfg, owns_process=False).reason == \
        "auto: inside another program the engine keeps its own process"
    forced = job(model={"engine": f"{engine_module}:ThreadEngine"}, engine_placement="driver")
    ThreadEngine.gpu = False
    try:
        assert plan_placement(forced) == Placement("driver", False, "runtime.engine_placement: driver")
    finally:
        ThreadEngine.gpu = True
    assert ThreadEngine.threads == []          # deciding loads nothing


def test_a_load_error_reaches_the_driver(engine_module):
    engine = _driver_engine(engine_module, "BrokenEngine")
    with pytest.raises(RuntimeError, match="no weights in ckpt"):
        engine.description()
    with pytest.raises(RuntimeError, match="no weights in ckpt"):   # kept: every later wait is told the same
        engine.description()
    engine.close()


def test_close_stops_a_load_at_its_next_step(engine_module, rng):
    from batchjob.startup import LoadCancelled

    engine = _driver_engine(engine_module, "SlowLoadEngine")
    time.sleep(rng.uniform(0.05, 0.3))
    t0 = time.perf_counter()
    engine.close()
    assert time.perf_counter() - t0 < 1.0 and not engine._thread.is_alive()
    with pytest.raises(LoadCancelled):
        engine.description()


# -- whole runs ------------------------------------------------------------------------------------------------


@pytest.mark.ray
def test_driver_placement_answers_every_row_as_actors_do(tmp_path, h, synthetic, isolated_network, rng):
    """The deterministic engine in the driver: every row once with its own clip's frames (the payloads crossed
    Ray's object store into the driver's thread), a failing batch costs only its clip, and the statistics say
    where the engine ran, with its load beside the other start-up steps."""
    manifest, clips = synthetic
    records = h.manifest_records(manifest)
    victim = rng.choice(records)["video"]
    for r in records:
        if r["video"] == victim:
            r["question"] = "ENGINE_FAIL " + r["question"]
    data = tmp_path / "m.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in records))
    (tmp_path / "clips").symlink_to(manifest.parent / "clips")
    cfg = h.write_config(tmp_path / "job.yaml", data, engine="conftest:DriverDeterministicEngine",
                         runtime={"engine_placement": "driver", "max_error_fraction": 1.0})
    res = h.run_cli("run", str(cfg), "--stats-json", str(tmp_path / "stats.json"))
    assert res.returncode == 0, res.stderr[-3000:]
    rows = h.read_rows(tmp_path / "out")
    assert sorted(r["row_id"] for r in rows) == sorted(r["id"] for r in records)
    width = {c["video"]: c["width"] for c in clips}
    for r in rows:
        rec = next(x for x in records if x["id"] == r["row_id"])
        if rec["video"] == victim:
            assert "engine failed: RuntimeError: test engine refuses" in r["error"], r
            continue
        assert r["error"] is None and r["pred_index"] == h.expected_choice(r["row_id"], len(rec["options"]))
        assert r["prompt_tokens"] == h.frame_signature(4, width[rec["video"]]), "frames of another clip"
    stats = json.loads((tmp_path / "stats.json").read_text())
    assert stats["engine_runtime"]["placement"] == "driver", stats["engine_runtime"]
    assert stats["engines"] == 1 and stats["engine_gpus"] == 0
    startup = stats["startup"]
    assert startup["total_s"] == pytest.approx(sum(startup["steps"].values()))
    assert 0 < startup["overlapped"]["engine_ready_s"] < startup["total_s"]
    assert "thread_start" in startup["engine_load"]


@pytest.mark.ray
def test_the_mlx_engine_answers_the_same_in_the_driver_and_in_an_actor(tmp_path, h, synthetic, isolated_network,
                                                                        rng):
    """A tiny random Qwen2-VL checkpoint on the CPU: placement changes where the model runs, never its answers;
    `auto` on a machine without a GPU keeps the actor (and says why)."""
    from batchjob.synthetic.tiny_model import TinyModelSpec, write_tiny_checkpoint

    manifest, _ = synthetic
    ckpt = str(write_tiny_checkpoint(tmp_path / "tiny", TinyModelSpec(seed=rng.randrange(10**6))))
    probs, reasons = {}, {}
    for placement in ("driver", "auto"):
        out = tmp_path / f"out-{placement}"
        cfg = h.write_config(tmp_path / f"{placement}.yaml", manifest, engine="mlx", checkpoint=ckpt,
                             dataset={"limit": 9}, runtime={"engine_placement": placement},
                             output={"directory": str(out)})
        res = h.run_cli("run", str(cfg), "--stats-json", str(tmp_path / f"{placement}.json"))
        assert res.returncode == 0, res.stderr[-3000:]
        probs[placement] = {r["row_id"]: r["probs"] for r in h.read_rows(out)}
        rt = json.loads((tmp_path / f"{placement}.json").read_text())["engine_runtime"]
        reasons[placement] = (rt["placement"], rt["placement_reason"])
    assert reasons["driver"][0] == "driver"
    assert reasons["auto"] == ("actors", "auto: the engine runs on the CPU here")
    assert probs["driver"].keys() == probs["auto"].keys() and len(probs["driver"]) == 9
    for k, p in probs["driver"].items():
        np.testing.assert_allclose(p, probs["auto"][k], atol=1e-6, err_msg=k)


@pytest.mark.ray
def test_driver_placement_failures_exit_cleanly(tmp_path, h, synthetic, isolated_network):
    """A checkpoint that cannot load: exit 1 naming it, nothing written; a config refused by the checks: exit 2
    before anything starts; `validate` names an impossible placement."""
    manifest, _ = synthetic
    bad = tmp_path / "not-a-checkpoint"
    bad.mkdir()
    (bad / "config.json").write_text("{}")
    cfg = h.write_config(tmp_path / "job.yaml", manifest, engine="mlx", checkpoint=str(bad),
                         runtime={"engine_placement": "driver"})
    res = h.run_cli("run", str(cfg))
    assert res.returncode == 1 and "engine error" in res.stderr and str(bad) in res.stderr, res.stderr[-2000:]
    assert not any((tmp_path / "out").glob("part-*"))
    cfg = h.write_config(tmp_path / "job.yaml", manifest, engine="conftest:DriverDeterministicEngine",
                         loader={"name": "pyav_keyframes", "num_frames": 4, "kwargs": {"no_such_option": 1}},
                         runtime={"engine_placement": "driver"})
    t0 = time.monotonic()
    res = h.run_cli("run", str(cfg))
    assert res.returncode == 2 and "no_such_option" in res.stderr, res.stderr[-2000:]
    assert time.monotonic() - t0 < 60
    cfg = h.write_config(tmp_path / "job.yaml", manifest, engine="conftest:DriverDeterministicEngine",
                         runtime={"engine_placement": "driver", "engine_actors": 2})
    res = h.run_cli("validate", str(cfg))
    assert res.returncode == 2 and "runtime.engine_placement: driver" in res.stderr, res.stderr[-2000:]


def test_readahead_names_a_checkpoints_weight_files_and_reads_them(tmp_path, rng):
    from batchjob.pipeline.readahead import warm_page_cache, weight_files

    sizes = {f"model-{i:05d}-of-00004.safetensors": rng.randint(1, 4096) for i in range(1, 5)}
    for name, size in sizes.items():
        (tmp_path / name).write_bytes(rng.randbytes(size))
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "sub.safetensors").mkdir()
    (tmp_path / "consolidated.safetensors").write_bytes(rng.randbytes(64))   # a second copy: never read
    files = weight_files(tmp_path)
    assert [f.name for f in files] == sorted(sizes)   # the engine's files in its order; no folders, no copy
    from batchjob.engine.checkpoint import weight_files as engine_reads
    assert files == engine_reads(tmp_path)
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {"a": "model-00002-of-00004.safetensors", "b": "model-00004-of-00004.safetensors"}}))
    assert [f.name for f in weight_files(tmp_path)] == ["model-00002-of-00004.safetensors",
                                                        "model-00004-of-00004.safetensors"]   # the index's shards
    assert weight_files("Qwen/Qwen2.5-VL-7B-Instruct") == [] and weight_files(tmp_path / "missing") == []
    thread = warm_page_cache(files + [tmp_path / "vanished.safetensors"])   # a file gone meanwhile is skipped
    assert thread is not None
    thread.join(10)
    assert not thread.is_alive() and warm_page_cache([]) is None


def test_readahead_probe_says_cached_for_a_file_just_written_and_not_past_its_end(tmp_path, rng):
    import os

    from batchjob.pipeline.readahead import cached

    f = tmp_path / "w.safetensors"
    f.write_bytes(rng.randbytes(3 * 4096))
    fd = os.open(f, os.O_RDONLY)
    try:
        if not hasattr(os, "RWF_NOWAIT"):
            pytest.skip("no RWF_NOWAIT here")
        assert cached(fd, 0) and cached(fd, 2 * 4096)
        assert not cached(fd, 3 * 4096 + 10)            # nothing to read there
    finally:
        os.close(fd)
