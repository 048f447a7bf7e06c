"""The streaming driver's logic without Ray, MLX or video: scripted in-process decoders and engines.

Each clip's video name scripts what its decoder does: `ok`, `bad` (the loader reports an error), `crash`
(the decoder's process dies on it, every time), `crash1` (dies the first time only), `hang` (never returns
until killed), `enginefail` (decodes, then makes any engine batch holding it fail), `flaky` (fails any
multi-clip batch, answers alone), `enginecrash` (the engine replica that gets it dies, and with it every
batch it held).
"""
from __future__ import annotations

import itertools
import random
import subprocess
import sys
import time

import pytest

from batchjob.config import DatasetConfig, JobConfig, ModelConfig, OutputConfig, RuntimeConfig
from batchjob.contract import Answer, BatchAnswers, ClipMetadata, DecodeStatus
from batchjob.datasets import Row
from batchjob.pipeline.driver import DECODE_ATTEMPTS, ENGINE_QUEUE, Driver, NoEngineLeft, RunStats
from batchjob.pipeline.backpressure import target_depth
from batchjob.pipeline.slots import DecoderSlots
from batchjob.pipeline.work import group_by_clip
from batchjob.pipeline.workers import TaskFailed, WorkerLost

HANG = float("inf")


def expected(row_id: str, n: int) -> int:
    return sum(map(ord, row_id)) % n


class FakeWorkers:
    """The `Workers` seam in one process. Results become ready after a random small delay."""

    def __init__(self, num_decoders: int, num_engines: int, rng: random.Random, probe_fails: int = 0,
                 probe_fails_forever: bool = False, decode_delay=(0.0, 0.01), engine_delay=(0.0, 0.01)):
        self.num_decoders, self.num_engines, self.rng = num_decoders, num_engines, rng
        self.ids = itertools.count()
        self.ready_at: dict[int, float] = {}
        self.value: dict[int, object] = {}
        self.decoding: dict[int, int] = {}          # decoder -> its status ticket
        self.seen: dict[str, int] = {}              # video -> decode calls
        self.probe_fails, self.probe_fails_forever = probe_fails, probe_fails_forever
        self.killed: list[int] = []
        self.probes = 0
        self.batches: list[list[str]] = []
        self.max_in_flight = 0
        self.open_clips: set[str] = set()           # decode started, rows not yet written
        self.decode_delay, self.engine_delay = decode_delay, engine_delay
        self.engine_of: dict[int, tuple[int, list[str]]] = {}   # engine ticket -> replica, its clips
        self.sent: list[tuple[int, list[str]]] = []             # every batch: replica, clips
        self.answered_by: dict[str, list[int]] = {}             # row id -> replicas whose answer came back
        self.dead_engines: set[int] = set()
        self.lost: set[str] = set()                             # clips whose batch died with its replica

    def _ticket(self, value, delay: float) -> int:
        t = next(self.ids)
        self.ready_at[t], self.value[t] = time.monotonic() + delay, value
        return t

    def decode(self, decoder: int, video: str):
        assert decoder not in self.decoding, "a decoder got a second clip while busy"
        self.seen[video] = self.seen.get(video, 0) + 1
        kind = video.split("-")[0]
        meta = ClipMetadata.from_loader({"fps": 10.0, "total_num_frames": 40, "frames_indices": [0, 13, 26, 39],
                                         "video_backend": "fake", "keyframe_source": "index"})
        if kind == "crash" or (kind == "crash1" and self.seen[video] == 1):
            value, delay = WorkerLost("RayActorError"), self.rng.uniform(0, 0.01)
        elif kind == "hang":
            value, delay = WorkerLost("RayActorError"), HANG
        elif kind == "bad":
            value, delay = DecodeStatus("n0", 1.0, 1.0, error=f"decode failed: LoaderError: {video}: corrupt"), 0.0
        else:
            value, delay = DecodeStatus(f"n{decoder}", 2.0, 3.0, metadata=meta), self.rng.uniform(*self.decode_delay)
        t = self._ticket(value, delay)
        self.decoding[decoder] = t
        self.open_clips.add(video)
        self.max_in_flight = max(self.max_in_flight, len(self.open_clips))
        assert len(self.open_clips) <= self.bound, f"{len(self.open_clips)} clips in flight, bound {self.bound}"
        return t, ("frames of", video)

    def answer(self, engine: int, clips, payloads):
        videos = [c.job.video for c in clips]
        self.batches.append(videos)
        self.sent.append((engine, videos))
        if engine in self.dead_engines or any(v.startswith("enginecrash") for v in videos):
            # the replica's process dies: this batch and every batch it still held fail with it
            self.dead_engines.add(engine)
            now = time.monotonic()
            for t, (e, _) in self.engine_of.items():
                if e == engine and t in self.value:
                    self.value[t], self.ready_at[t] = WorkerLost("ActorDiedError"), now
            t = self._ticket(WorkerLost("ActorDiedError"), 0.0)
            self.engine_of[t] = (engine, videos)
            return t
        for c, p in zip(clips, payloads):
            assert p == ("frames of", c.job.video), "a clip was answered from another clip's frames"
            assert c.metadata.standard()["frames_indices"] == [0, 13, 26, 39]
        if any(c.job.video.startswith("enginefail") for c in clips):
            t = self._ticket(TaskFailed("RuntimeError: engine refuses enginefail"), 0.0)
        elif len(clips) > 1 and any(c.job.video.startswith("flaky") for c in clips):
            t = self._ticket(TaskFailed("RuntimeError: flaky in a batch"), 0.0)
        else:
            answers = tuple(Answer(q.row_id, expected(q.row_id, len(q.options)),
                                   [1 / len(q.options)] * len(q.options), 100, 50)
                            for c in clips for q in c.job.questions)
            t = self._ticket(BatchAnswers(answers, 5.0), self.rng.uniform(*self.engine_delay))
        self.engine_of[t] = (engine, videos)
        return t

    def probe(self, decoder: int):
        self.probes += 1
        if self.probe_fails_forever or self.probe_fails > 0:
            self.probe_fails -= 1
            return self._ticket(WorkerLost("ActorUnavailableError"), 0.0)
        return self._ticket(f"node{decoder}", 0.0)

    def wait(self, tickets, timeout: float):
        deadline = time.monotonic() + timeout
        while True:
            now = time.monotonic()
            ready = [t for t in tickets if self.ready_at[t] <= now]
            if ready or now >= deadline:
                return ready
            time.sleep(0.002)

    def result(self, ticket):
        value = self.value.pop(ticket)
        for d, t in list(self.decoding.items()):
            if t == ticket:
                del self.decoding[d]
        if isinstance(value, BatchAnswers):
            for a in value.answers:
                self.answered_by.setdefault(a.row_id, []).append(self.engine_of[ticket][0])
        if isinstance(value, WorkerLost) and ticket in self.engine_of:
            self.lost.update(self.engine_of[ticket][1])
        if isinstance(value, Exception):
            raise value
        return value

    def kill_decoder(self, decoder: int) -> None:
        self.killed.append(decoder)
        self.ready_at[self.decoding[decoder]] = time.monotonic()


def make_rows(videos: list[str], rng: random.Random) -> list[Row]:
    rows = []
    for v in videos:
        for q in range(rng.randint(1, 3)):
            n = rng.randint(2, 5)
            rows.append(Row(f"{v}#{q}", v, f"question {q} about {v}?", tuple(f"opt{i}" for i in range(n))))
    return rows


def run_driver(tmp_path, videos, rng, *, decoders=2, engines=1, timeout_s=30.0, frames_in_flight=4,
               clips_per_batch=2, rows=None, skip=frozenset(), **fake):
    cfg = JobConfig(job="t", dataset=DatasetConfig(adapter="manifest", annotation="m.jsonl"),
                    model=ModelConfig(checkpoint="ckpt"), output=OutputConfig(directory=str(tmp_path)),
                    runtime=RuntimeConfig(decode_actors=decoders, engine_actors=engines, decode_timeout_s=timeout_s,
                                          frames_in_flight=frames_in_flight, clips_per_batch=clips_per_batch))
    rows = rows or make_rows(videos, rng)
    workers = FakeWorkers(decoders, engines, rng, **fake)
    workers.bound = frames_in_flight
    written: list[dict] = []

    def write(out: list[dict]) -> None:     # a clip's rows come in one call: it leaves the flight
        written.extend(out)
        workers.open_clips -= {r["video"] for r in out}

    stats = RunStats(total_rows=len(rows))
    workers.stopped = None
    try:
        Driver(cfg, workers, "fake-model", write, stats).run(group_by_clip(rows, set(skip), "fake", 4, {}))
    except NoEngineLeft as err:
        workers.stopped = err
    return rows, written, workers, stats


def check_every_row_once(rows, written):
    assert len({r["row_id"] for r in written}) == len(written), "a row written twice"
    assert sorted(r["row_id"] for r in written) == sorted(r.row_id for r in rows)


@pytest.fixture
def rng():
    seed = random.randrange(1 << 30)
    print(f"seed {seed}")
    return random.Random(seed)


def test_answers_every_row_once_within_the_in_flight_bound(tmp_path, rng):
    videos = [f"ok-{i}" for i in range(rng.randint(5, 15))]
    bound = rng.randint(1, 4)
    rows, written, workers, stats = run_driver(tmp_path, videos, rng, decoders=rng.randint(1, 3),
                                               engines=rng.randint(1, 2), frames_in_flight=bound,
                                               clips_per_batch=rng.randint(1, 3))
    check_every_row_once(rows, written)
    by_id = {r.row_id: r for r in rows}
    for out in written:
        row = by_id[out["row_id"]]
        assert out["error"] is None and out["pred_index"] == expected(row.row_id, len(row.options))
        assert out["frame_indices"] == [0, 13, 26, 39] and out["decode_ms"] == 2.0
        assert out["prompt_tokens"] == 100 and out["cached_tokens"] == 50 and out["engine_ms"] == 5.0
    assert workers.max_in_flight <= bound
    assert stats.done_rows == len(rows) and stats.error_rows == 0 and stats.done_clips == len(videos)
    assert stats.decode_busy_s == pytest.approx(len(videos) * 3.0 / 1000)


def test_bad_clips_and_engine_failures_cost_only_their_rows(tmp_path, rng):
    videos = [f"ok-{i}" for i in range(6)] + ["bad-1", "enginefail-1", "crash1-1"]
    rng.shuffle(videos)
    rows, written, workers, stats = run_driver(tmp_path, videos, rng, clips_per_batch=3)
    check_every_row_once(rows, written)
    errors = {r["row_id"].split("#")[0]: r["error"] for r in written if r["error"]}
    assert set(errors) == {"bad-1", "enginefail-1"}
    assert errors["bad-1"].startswith("decode failed: LoaderError")
    assert errors["enginefail-1"] == "engine failed: RuntimeError: engine refuses enginefail"
    assert workers.seen["crash1-1"] == 2             # died once, retried, answered
    assert ["enginefail-1"] in workers.batches       # isolated after its batch failed
    assert stats.error_rows == sum(1 for r in written if r["error"])


def test_a_decoder_that_always_crashes_on_a_clip_gives_an_error_row(tmp_path, rng):
    rows, written, workers, _ = run_driver(tmp_path, ["crash-1", "ok-1", "ok-2"], rng, probe_fails=3)
    check_every_row_once(rows, written)
    errors = {r["row_id"].split("#")[0]: r["error"] for r in written if r["error"]}
    assert errors == {"crash-1": "decoder process died on this clip (RayActorError)"}
    assert workers.seen["crash-1"] == DECODE_ATTEMPTS


def test_a_hanging_decode_is_killed_after_the_timeout(tmp_path, rng):
    t0 = time.monotonic()
    rows, written, workers, _ = run_driver(tmp_path, ["hang-1"] + [f"ok-{i}" for i in range(4)], rng,
                                           timeout_s=0.3)
    check_every_row_once(rows, written)
    errors = {r["row_id"].split("#")[0]: r["error"] for r in written if r["error"]}
    assert errors == {"hang-1": "decode timed out after 0.3 s"}
    assert len(workers.killed) == 1 and workers.seen["hang-1"] == 1   # a clip that hung once is not retried
    assert time.monotonic() - t0 < 5


def test_probe_failures_keep_a_decoder_out_until_it_answers(tmp_path, rng, monkeypatch):
    monkeypatch.setattr(DecoderSlots, "PROBE_FOR_S", 30.0)
    rows, written, workers, _ = run_driver(tmp_path, ["crash1-1"] + [f"ok-{i}" for i in range(5)], rng,
                                           decoders=1, probe_fails=2)
    check_every_row_once(rows, written)
    assert not any(r["error"] for r in written)        # the restarted decoder came back and did everything
    assert workers.probes == 3                          # two failed probes, then one that answered


def test_all_decoders_dead_fails_the_remaining_rows_without_hanging(tmp_path, rng, monkeypatch):
    monkeypatch.setattr(DecoderSlots, "PROBE_FOR_S", 0.0)
    videos = ["crash-1", "crash-2"] + [f"ok-{i}" for i in range(5)]
    rows, written, workers, stats = run_driver(tmp_path, videos, rng, decoders=2, probe_fails_forever=True)
    check_every_row_once(rows, written)
    errors = {r["row_id"].split("#")[0]: r["error"] for r in written}
    assert all(e is not None for e in errors.values())
    assert {v for v, e in errors.items() if e.startswith("no decoder process left alive")} >= {f"ok-{i}" for i in range(5)}
    assert stats.error_rows == len(rows)


def test_the_driver_side_imports_no_engine_framework():
    """The driver process resolves engines and builds their preparers without importing MLX, torch or vLLM."""
    code = ("import sys; import batchjob.pipeline.job, batchjob.pipeline.driver, batchjob.pipeline.actors; "
            "from batchjob.pipeline.engines import resolve_engine; "
            "[resolve_engine(n) for n in ('mlx', 'vllm')]; "
            "print(sorted(m for m in ('ray', 'mlx', 'mlx.core', 'torch', 'vllm', 'transformers') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr


def test_every_question_of_a_clip_is_answered_by_one_replica(tmp_path, rng):
    """Placement: a clip's questions travel together, also when a failed batch is retried clip by clip."""
    videos = [f"ok-{i}" for i in range(rng.randint(12, 24))] + [f"flaky-{i}" for i in range(3)]
    rng.shuffle(videos)
    engines = rng.randint(2, 4)
    rows, written, workers, stats = run_driver(tmp_path, videos, rng, decoders=3, engines=engines,
                                               frames_in_flight=rng.randint(4, 12), clips_per_batch=rng.randint(2, 3))
    check_every_row_once(rows, written)
    assert not any(r["error"] for r in written)
    replica_of: dict[str, set[int]] = {}
    for row_id, replicas in workers.answered_by.items():
        assert len(replicas) == 1, f"{row_id} answered {len(replicas)} times"
        replica_of.setdefault(row_id.split("#")[0], set()).update(replicas)
    assert all(len(r) == 1 for r in replica_of.values()), replica_of
    assert len(set().union(*replica_of.values())) > 1, "the work never spread over the replicas"
    for v in (v for v in videos if v.startswith("flaky")):   # its failed batch and its solo retry: one replica
        sent_to = {e for e, clips in workers.sent if v in clips}
        assert sent_to == replica_of[v] and sum(v in clips for _, clips in workers.sent) >= 1
    assert stats.engines == engines and len(stats.engine_busy_s_by_replica) == engines
    assert sum(stats.engine_busy_s_by_replica) == pytest.approx(stats.engine_busy_s)


def test_back_pressure_never_exceeds_frames_in_flight(tmp_path, rng):
    """Random decode and engine speeds, several replicas: the bound holds at every decode (FakeWorkers asserts
    it each time a decoder takes a clip) and the queues never hold more than the bound."""
    for _ in range(3):
        slow_engine = rng.random() < 0.5
        bound = rng.randint(2, 9)
        rows, written, workers, stats = run_driver(
            tmp_path, [f"ok-{i}" for i in range(rng.randint(10, 30))], rng, decoders=rng.randint(1, 4),
            engines=rng.randint(1, 3), frames_in_flight=bound, clips_per_batch=rng.randint(1, 3),
            decode_delay=(0.0, 0.004 if slow_engine else 0.03), engine_delay=(0.0, 0.03 if slow_engine else 0.004))
        check_every_row_once(rows, written)
        assert workers.max_in_flight <= bound and not workers.open_clips
        assert stats.queue_depth["max"] <= bound
        for q in stats.queue_depth_by_replica:
            assert q is None or q["min"] <= q["median"] <= q["max"] <= bound
        assert stats.decode_ms_per_clip == 3.0 and stats.engine_ms_per_clip is not None
        assert stats.bound_by in ("decode", "engine", "driver") and stats.peak_rss_mb > 0


def test_a_dead_replica_costs_only_the_clips_it_held(tmp_path, rng):
    videos = [f"ok-{i}" for i in range(20)]
    videos.insert(rng.randint(3, 10), "enginecrash-1")
    rows, written, workers, stats = run_driver(tmp_path, videos, rng, decoders=3, engines=3, frames_in_flight=9,
                                               clips_per_batch=2)
    check_every_row_once(rows, written)
    assert workers.stopped is None
    (dead,) = workers.dead_engines
    assert "enginecrash-1" in workers.lost and len(workers.lost) <= ENGINE_QUEUE * 2
    assert all(e == dead for e, clips in workers.sent if set(clips) & workers.lost)
    for r in written:
        if r["video"] in workers.lost:
            assert r["error"] == f"engine replica {dead} died: ActorDiedError" and r["pred_index"] is None
        else:
            assert r["error"] is None and r["pred_index"] == expected(r["row_id"], len(r["options"]))
    assert stats.error_rows == sum(1 for r in written if r["error"]) and stats.dead_replicas == [dead]
    # the job went on: after the crash, the survivors took the remaining clips
    crash_at = next(i for i, (_, clips) in enumerate(workers.sent) if "enginecrash-1" in clips)
    later = [(e, clips) for e, clips in workers.sent[crash_at + 1:] if not set(clips) & workers.lost]
    assert later and all(e != dead for e, _ in later)


def test_no_replica_left_stops_and_leaves_unsent_clips_for_the_rerun(tmp_path, rng):
    engines = rng.randint(1, 2)
    videos = [f"ok-{i}" for i in range(3)] + [f"enginecrash-{i}" for i in range(6)] + [f"ok-{i}" for i in range(3, 9)]
    rows, written, workers, stats = run_driver(tmp_path, videos, rng, decoders=2, engines=engines,
                                               frames_in_flight=4, clips_per_batch=1)
    assert isinstance(workers.stopped, NoEngineLeft)
    msg = str(workers.stopped)
    assert f"all {engines} engine replica(s) died" in msg and "rerun the same command" in msg
    assert workers.dead_engines == set(range(engines))
    assert len({r["row_id"] for r in written}) == len(written)
    sent = {v for _, clips in workers.sent for v in clips}
    by_video = {r["video"] for r in written}
    assert by_video <= sent, "a row for a clip that never reached an engine"
    assert {r["video"] for r in written if r["error"]} == workers.lost
    assert any(v not in by_video for v in videos), "every clip got a row: nothing was left for the rerun"
    # the rerun (healthy engines) writes exactly the missing rows
    crash_free = [r for r in rows if not r.video.startswith("enginecrash")] 
    skip = {r["row_id"] for r in written}
    rows2, written2, _, _ = run_driver(tmp_path, [], rng, rows=[r for r in crash_free], skip=skip, engines=engines)
    check_every_row_once([r for r in crash_free if r.row_id not in skip], written2)


def test_queues_are_sized_by_the_measured_rates_not_by_the_memory_bound(tmp_path, rng):
    """A slow engine and fast decoders with a generous bound: decoders stop at the replicas' target depth
    (fakes: decode 3 ms, a batch of 2 in 5 ms, so target = ceil(3 x 400 / 1000 x 1.5) + 2 = 4 per replica)."""
    engines, cpb = 2, 2
    target = target_depth(3.0, cpb / 0.005, cpb, 64, engines)
    assert target == 4 == target_depth(None, None, cpb, 64, engines)
    rows, written, workers, stats = run_driver(
        tmp_path, [f"ok-{i}" for i in range(40)], rng, decoders=4, engines=engines, frames_in_flight=64,
        clips_per_batch=cpb, decode_delay=(0.0, 0.002), engine_delay=(0.02, 0.04))
    check_every_row_once(rows, written)
    assert stats.queue_depth["max"] <= target * engines
    assert workers.max_in_flight <= target * engines + engines * ENGINE_QUEUE * cpb
    assert stats.queue_target == stats.queue_target_wanted == target
