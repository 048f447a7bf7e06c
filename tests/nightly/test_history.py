"""Run history: records round-trip, appends are atomic under SIGKILL, temp files are never read."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from datetime import datetime, timezone
from pathlib import Path

import pyarrow.parquet as pq

from batchjob.nightly.history import (append_record, last_two_outputs, previous_run, read_history, records_dir)


def test_records_round_trip_oldest_first(tmp_path, rng, nh):
    recs = [nh.make_record(rng, rng.choice(["a", "b"]), f"2026-01-{i + 1:02d}")
            for i in range(12)]
    recs[3] = nh.make_record(rng, "a", "2026-01-04", per_category={}, alerts=["x", "y"], model_hash=None,
                             rows_per_s=None, ray_version="2.60")
    for r in rng.sample(recs, len(recs)):
        append_record(tmp_path, r)
    h = read_history(tmp_path)
    assert h.unreadable == []
    assert h.records == sorted(recs, key=lambda r: (r.started_at, r.job))
    assert {f.name.startswith("run-") for f in records_dir(tmp_path).iterdir()} == {True}
    # any Parquet reader sees the same rows (the dataset is plain Parquet files)
    assert pq.read_table(records_dir(tmp_path)).num_rows == len(recs)


def test_temp_and_damaged_files_are_left_out(tmp_path, rng, nh):
    good = nh.make_record(rng, "a", "2026-01-01")
    append_record(tmp_path, good)
    folder = records_dir(tmp_path)
    (folder / ".run-x.parquet.tmp").write_bytes(b"PAR1 torn")
    (folder / "run-99999999T000000000000Z-a-deadbeef.parquet").write_bytes(b"not parquet")
    h = read_history(tmp_path)
    assert h.records == [good]
    assert len(h.unreadable) == 1 and "run-99999999" in h.unreadable[0]
    append_record(tmp_path, nh.make_record(rng, "a", "2026-01-02"))
    assert not list(folder.glob(".*.tmp")), "the next append cleans up after a killed one"


def test_baselines(tmp_path, rng, nh):
    t = lambda i: datetime(2026, 1, i, 1, 30, tzinfo=timezone.utc)  # noqa: E731
    recs = [
        nh.make_record(rng, "a", "2026-01-01", started=t(1), output="/o/1", accuracy=0.5),
        nh.make_record(rng, "a", "2026-01-02", started=t(2), output="/o/2", accuracy=0.6),
        nh.make_record(rng, "b", "2026-01-02", started=t(2), output="/b", accuracy=0.1),
        nh.make_record(rng, "a", "2026-01-03", started=t(3), output="/o/3", exit_status=1, accuracy=0.2),
        nh.make_record(rng, "a", "2026-01-04", started=t(4), output="/o/4", exit_status=2, accuracy=None,
                       output_rows=0),
        nh.make_record(rng, "b", "2026-01-04", started=t(4), output="/b", accuracy=0.2),
    ]
    for r in recs:
        append_record(tmp_path, r)
    h = read_history(tmp_path)
    assert previous_run(h, "a") == recs[1]              # failed runs are no baseline
    assert previous_run(h, "a", before=t(2)) == recs[0]
    assert previous_run(h, "zzz") is None
    assert last_two_outputs(h, "a") == (recs[1], recs[3])   # a run that exited 1 still wrote rows
    assert last_two_outputs(h, "b") is None                 # one growing dataset: nothing to compare


APPENDER = textwrap.dedent("""
    import os, random, signal, sys
    from datetime import datetime, timedelta, timezone
    sys.path.insert(0, {tests!r})
    from conftest import make_record
    import batchjob.nightly.history as history
    folder, mode, tag = sys.argv[1], sys.argv[2], sys.argv[4]
    rng = random.Random(int(sys.argv[3]))
    if mode == "before-rename":          # die with the whole temp file written, before it is published
        def replace(src, dst):
            os.kill(os.getpid(), signal.SIGKILL)
        os.replace = replace              # the os module atomic_write renames with
    i = 0
    while True:
        r = make_record(rng, "job", "2026-01-01", nightly_run_id=f"{{tag}}-{{i}}",
                        started=datetime(2026, 1, 1, tzinfo=timezone.utc) + timedelta(seconds=i))
        history.append_record(folder, r)
        print(i, flush=True)
        i += 1
""")


def _appender(tmp_path: Path, mode: str, seed: int, tag: str) -> subprocess.Popen:
    script = tmp_path / "appender.py"
    script.write_text(APPENDER.format(tests=str(Path(__file__).parent)))
    return subprocess.Popen([sys.executable, str(script), str(tmp_path / "h"), mode, str(seed), tag],
                            stdout=subprocess.PIPE, text=True)


def test_sigkill_during_appends_never_tears_a_row(tmp_path, rng):
    """SIGKILL an appending process at random instants: every published record is whole, none twice."""
    for round_ in range(3):
        proc = _appender(tmp_path, "loop", rng.randint(0, 10**6), str(round_))
        first = proc.stdout.readline()                     # at least one append done
        time.sleep(rng.uniform(0, 0.4))
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        acked = [int(x) for x in (first + proc.stdout.read()).split()]
        h = read_history(tmp_path / "h")
        assert h.unreadable == []
        ids = [r.nightly_run_id for r in h.records]
        assert len(ids) == len(set(ids)), "a record appears once"
        mine = {int(i.split("-")[1]) for i in ids if i.split("-")[0] == str(round_)}
        # this round's records: every acknowledged one, plus at most the one in flight, whole
        assert set(acked) <= mine <= set(range(len(acked) + 1)), (acked, sorted(mine))
    proc = _appender(tmp_path, "before-rename", 1, "k")
    assert proc.wait() == -signal.SIGKILL
    leftovers = list(records_dir(tmp_path / "h").glob(".*.tmp"))
    assert leftovers, "the kill happened with a complete temp file on disk"
    before = read_history(tmp_path / "h")
    assert before.unreadable == [] and not any(r.nightly_run_id.startswith("k-") for r in before.records)
    n_files = len(list(records_dir(tmp_path / "h").glob("run-*.parquet")))
    assert n_files == len(before.records), "the killed append published nothing"
