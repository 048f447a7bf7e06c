"""Back-pressure rules and run statistics as pure functions: queue target depth, replica choice, decode
admission, time-weighted queue depth, which stage bounded the run."""
from __future__ import annotations

import math
import random
from collections import Counter

import pytest

from batchjob.pipeline.backpressure import (SAFETY, Rates, may_start_decode, pick_replica, target_depth,
                                            wanted_depth)
from batchjob.pipeline.stats import DepthSampler, RunStats, bound_by, median_and_p90, weighted_summary


def test_target_depth_covers_the_decode_latency_at_the_engine_rate():
    # 200 ms decode, a replica answering 20 clips/s: 4 clips arrive late per decode, x1.5 margin, + a batch
    assert target_depth(200.0, 20.0, 4, 64, 1) == math.ceil(0.2 * 20 * SAFETY) + 4
    # a fast decoder needs little more than one batch
    assert target_depth(5.0, 2.0, 4, 64, 1) == 5
    # clamped by the memory bound shared among replicas (the unclamped want says by how much)
    assert target_depth(2000.0, 50.0, 4, 32, 2) == 16 and wanted_depth(2000.0, 50.0, 4) == 154
    # never below one batch, unless the bound per replica is smaller still
    assert target_depth(1.0, 0.1, 3, 64, 1) == 4 and target_depth(1.0, 0.1, 8, 6, 2) == 3


def test_target_depth_before_rates_are_measured_is_two_batches_within_the_bound():
    assert target_depth(None, None, 4, 64, 1) == 8
    assert target_depth(150.0, None, 4, 64, 1) == 8
    assert target_depth(None, None, 4, 6, 1) == 6
    assert target_depth(None, None, 4, 4, 4) == 1


def test_target_depth_stays_in_range_for_random_inputs():
    rng = random.Random(7)
    for _ in range(2000):
        cpb, fif, reps = rng.randint(1, 8), rng.randint(1, 64), rng.randint(1, 8)
        d = target_depth(rng.choice([None, rng.uniform(0.1, 5000)]), rng.choice([None, rng.uniform(0.01, 200)]),
                         cpb, fif, reps)
        hi = max(1, fif // reps)
        assert min(cpb, hi) <= d <= hi


def test_pick_replica_shortest_queue_then_least_load_then_lowest_index():
    assert pick_replica([3, 1, 2], [0, 2, 0], {0, 1, 2}) == 1
    assert pick_replica([1, 1, 1], [2, 1, 1], {0, 1, 2}) == 1
    assert pick_replica([0, 0], [0, 0], {0, 1}) == 0
    assert pick_replica([0, 5, 5], [0, 0, 1], {1, 2}) == 1      # dead replica 0 is never chosen
    with pytest.raises(ValueError):
        pick_replica([0], [0], set())


def test_pick_replica_against_a_brute_force_reference():
    rng = random.Random(11)
    for _ in range(1000):
        n = rng.randint(1, 6)
        q, load = [rng.randint(0, 4) for _ in range(n)], [rng.randint(0, 2) for _ in range(n)]
        alive = {r for r in range(n) if rng.random() < 0.7} or {rng.randrange(n)}
        best = sorted(alive, key=lambda r: (q[r], load[r], r))[0]
        shortest = min(q[r] for r in alive)
        got = pick_replica(q, load, alive)
        assert got == best and q[got] == shortest and got in alive


def test_may_start_decode_respects_memory_bound_and_queue_target():
    assert may_start_decode(in_flight=3, frames_in_flight=4, decoding=1, queued=1, target=3, live_replicas=1)
    assert not may_start_decode(4, 4, 0, 0, 8, 1)                 # memory bound reached
    assert not may_start_decode(3, 16, 2, 4, 3, 2)                # queues (with decodes under way) at target
    assert may_start_decode(3, 16, 2, 3, 3, 2)
    assert not may_start_decode(0, 16, 0, 0, 3, 0)                # no replica left: nothing to decode for


def test_rates_measure_recent_median_decode_and_clips_per_busy_second():
    r = Rates()
    assert r.decode_ms_median is None and r.engine_clips_per_s is None
    for ms in (10, 30, 20, 1000):
        r.decoded(ms)
    assert r.decode_ms_median == 25
    r.answered(4, 0.5)
    r.answered(2, 0.5)
    assert r.engine_clips_per_s == pytest.approx(6.0)


def test_weighted_summary_weights_each_depth_by_how_long_it_held():
    assert weighted_summary(Counter()) is None
    assert weighted_summary(Counter({0: 0.0})) is None
    assert weighted_summary(Counter({0: 1.0, 5: 3.0, 9: 0.5})) == {"min": 0.0, "median": 5.0, "max": 9.0}
    assert weighted_summary(Counter({2: 10.0, 7: 0.1})) == {"min": 2.0, "median": 2.0, "max": 7.0}


def test_depth_sampler_against_a_reference_timeline():
    rng = random.Random(3)
    s = DepthSampler(2)
    t, timeline = 0.0, []
    for _ in range(200):
        depths = [rng.randint(0, 6), rng.randint(0, 6)]
        dt = rng.uniform(0.001, 0.1)
        s.observe(t, depths)
        timeline.append((depths, dt))
        t += dt
    s.observe(t, [0, 0])
    total, per = s.summary()
    # reference: expand each interval into many equal ticks, then plain statistics
    tick = 0.0005
    ticks = [(d, round(dt / tick)) for d, dt in timeline]
    for r in range(2):
        values = sorted(v for d, n in ticks for v in [d[r]] * n)
        assert per[r]["min"] == values[0] and per[r]["max"] == values[-1]
        assert abs(per[r]["median"] - values[len(values) // 2]) <= 1
    sums = sorted(v for d, n in ticks for v in [sum(d)] * n)
    assert total["max"] == sums[-1] and abs(total["median"] - sums[len(sums) // 2]) <= 1


def test_bound_by_names_the_busier_stage_or_the_driver():
    assert bound_by(decode_busy=0.95, engine_busy=0.4) == "decode"
    assert bound_by(decode_busy=0.3, engine_busy=0.9) == "engine"
    assert bound_by(decode_busy=0.5, engine_busy=0.5) == "driver"


def test_run_stats_derived_values():
    s = RunStats(done_rows=10, stream_s=10.0, wall_s=12.0, decoders=4, engines=2, decode_busy_s=8.0,
                 engine_busy_s=18.0, engine_busy_s_by_replica=[10.0, 8.0])
    assert s.gpu_busy == pytest.approx(0.9)
    assert s.engine_busy_by_replica == pytest.approx([1.0, 0.8])
    assert s.bound_by == "engine"
    d = s.as_dict()
    for key in ("rows_per_s", "overlap_efficiency", "decode_busy_s", "engine_busy_s", "stream_s", "wall_s",
                "gpu_busy", "engine_busy_by_replica", "queue_depth", "queue_depth_by_replica", "decode_ms_per_clip",
                "decode_ms_per_clip_p90", "engine_ms_per_clip", "engine_ms_per_clip_p90", "bound_by", "engines",
                "decoders", "engine_gpus", "peak_rss_mb"):
        assert key in d, key
    assert RunStats().gpu_busy is None and RunStats().bound_by is None


def test_median_and_p90():
    assert median_and_p90([]) == (None, None)
    med, p90 = median_and_p90(list(range(1, 101)))
    assert med == 50.5 and p90 == pytest.approx(90.1)
