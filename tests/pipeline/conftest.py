"""Fixtures for pipeline tests: a deterministic engine plugin, synthetic datasets, a CLI runner.

Pipeline runs go through the real CLI in a subprocess (as cron runs it), with this directory on
PYTHONPATH so `model.engine: conftest:DeterministicEngine` resolves in the driver and in Ray workers.
The deterministic engine answers from a hash of the row id and reports the frame shape it received in
`prompt_tokens`, so a test can check that every question got its own clip's frames.
"""
from __future__ import annotations

import hashlib
import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
import zlib
from pathlib import Path

import numpy as np
import pytest
import yaml

from batchjob.contract import EngineBase

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
TEST_ENGINE = "conftest:DeterministicEngine"


def expected_choice(row_id: str, num_options: int) -> int:
    return int(hashlib.sha256(row_id.encode()).hexdigest(), 16) % num_options


def frame_signature(num_frames: int, width: int) -> int:
    return num_frames * 10_000 + width


class DeterministicEngine(EngineBase):
    """Test engine: answer = hash(row id); prompt_tokens encodes the frames' shape; optional delay.
    A question containing ENGINE_FAIL makes the batch raise; ENGINE_CRASH kills the engine's process."""

    def __init__(self, model, prompt):
        self.model_id = "deterministic-test"
        self.delay = float(os.environ.get("BATCHJOB_TEST_ENGINE_DELAY", "0"))
        log_dir = os.environ.get("BATCHJOB_TEST_ENGINE_LOG")
        if log_dir:   # which GPUs Ray gave this replica
            Path(log_dir, f"engine-{os.getpid()}").write_text(os.environ.get("CUDA_VISIBLE_DEVICES", "<unset>"))

    def answer(self, clips):
        from batchjob.contract import Answer

        out = []
        for clip in clips:
            frames, questions = clip.payload, clip.job.questions
            assert frames.dtype == np.uint8 and frames.ndim == 4 and frames.shape[3] == 3, frames.shape
            assert len(clip.metadata.frames_indices) == frames.shape[0]
            if any("ENGINE_FAIL" in q.text for q in questions):
                raise RuntimeError(f"test engine refuses {clip.job.media_id}")
            if any("ENGINE_CRASH" in q.text for q in questions):
                os._exit(3)      # the replica's process dies, as on a GPU fault or the OOM killer
            time.sleep(self.delay)
            for q in questions:
                c = expected_choice(q.row_id, len(q.options))
                probs = [0.05] * len(q.options)
                probs[c] = 1.0 - 0.05 * (len(q.options) - 1)
                out.append(Answer(q.row_id, c, probs, frame_signature(frames.shape[0], frames.shape[2]), 0, None))
        return out


class DriverDeterministicEngine(DeterministicEngine):
    """The same engine, allowed on a thread of the driver (`runtime.engine_placement: driver`)."""

    runs_in_driver = True


@pytest.fixture(scope="session")
def isolated_network():
    """Ray probes 8.8.8.8 to find its address: tests that start Ray must run without a route off loopback."""
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        s.connect(("8.8.8.8", 53))
        routed = True
    except OSError:
        routed = False
    finally:
        s.close()
    if routed:
        pytest.fail("Ray tests must run in a loopback-only network namespace; run them via scripts/test.sh or "
                    "`unshare -rn sh -c 'ip link set lo up; source scripts/env.sh; python -m pytest tests/pipeline'`")


@pytest.fixture(scope="session")
def seed() -> int:
    s = int(os.environ.get("BATCHJOB_TEST_SEED", time.time_ns() % 100_000))
    print(f"pipeline test seed: {s} (set BATCHJOB_TEST_SEED to reproduce)")
    return s


@pytest.fixture
def rng(request, seed) -> random.Random:
    """Fresh draws per test and run, from the run's seed and the test's id: the failure report shows the seed
    (captured output), and BATCHJOB_TEST_SEED=<it> replays the draws."""
    print(f"{request.node.nodeid}: BATCHJOB_TEST_SEED={seed}")
    return random.Random(f"{seed}:{request.node.nodeid}")


@pytest.fixture
def np_rng(request, seed) -> np.random.Generator:
    """numpy's twin of `rng`, from the same seed."""
    print(f"{request.node.nodeid}: BATCHJOB_TEST_SEED={seed}")
    return np.random.default_rng([seed, zlib.crc32(request.node.nodeid.encode())])


@pytest.fixture(scope="session")
def synthetic(tmp_path_factory, seed):
    """8 clips of mixed sizes and lengths, 3 questions each (24 rows)."""
    from batchjob.demo import build_synthetic_dataset

    root = tmp_path_factory.mktemp("synthetic")
    manifest, clips = build_synthetic_dataset(root, num_clips=8, seconds=(0.8, 3.0), seed=seed)
    return manifest, clips


def write_config(path: Path, manifest: Path, *, engine: str = TEST_ENGINE, checkpoint: str | None = None,
                 **sections) -> Path:
    """A job config for tests; keyword sections (dataset=..., runtime=...) update the defaults."""
    ckpt = checkpoint
    if ckpt is None:
        ckpt = str(path.parent / "ckpt")
        Path(ckpt).mkdir(exist_ok=True)
    cfg = {
        "job": "test",
        "dataset": {"adapter": "manifest", "annotation": str(manifest), "video_root": str(manifest.parent / "clips")},
        "model": {"checkpoint": ckpt, "engine": engine, "dtype": "float32"},
        "loader": {"name": "pyav_keyframes", "num_frames": 4},
        "runtime": {"decode_actors": 2, "engine_actors": 1, "decode_cpus": 0.5, "engine_cpus": 0.5,
                    "frames_in_flight": 4, "clips_per_batch": 2},
        "output": {"directory": str(path.parent / "out"), "rows_per_part": 4, "flush_seconds": 1},
    }
    for key, value in sections.items():
        cfg[key] = {**cfg.get(key, {}), **value} if isinstance(value, dict) else value
    path.write_text(yaml.safe_dump(cfg))
    return path


def cli_env(**extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(HERE), str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env.setdefault("RAY_AUTH_MODE", "disabled")
    env.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    env.update(extra)
    return env


def run_cli(*args: str, timeout: float = 240, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "batchjob.cli", *args], capture_output=True, text=True,
                          timeout=timeout, env=env or cli_env(), cwd=ROOT)


CONSOLE = Path(sys.executable).with_name("batchjob")


def run_console(*args: str, timeout: float = 240, env: dict | None = None,
                input: str | None = None) -> subprocess.CompletedProcess:
    """The installed console script, as a user (or cron) types it; it re-executes itself with the system
    OpenBLAS preloaded, as in production."""
    if not CONSOLE.is_file():
        pytest.skip(f"no console script at {CONSOLE} (package not installed in this environment)")
    return subprocess.run([str(CONSOLE), *args], capture_output=True, text=True, timeout=timeout,
                          env=env or cli_env(), cwd=ROOT, input=input)


def descendants(pid: int) -> list[int]:
    """Every live process below `pid` (read from /proc; no psutil here)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry.name))
    out, todo = [], [pid]
    while todo:
        for c in children.get(todo.pop(), []):
            out.append(c)
            todo.append(c)
    return out


def kill_tree(proc: subprocess.Popen) -> None:
    """SIGKILL a CLI run and every process it started (its local Ray included), by pid."""
    pids = descendants(proc.pid)
    for pid in [proc.pid, *pids]:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    proc.wait(timeout=30)


def read_rows(out_dir: Path):
    from batchjob.pipeline.output import read_output

    return read_output(out_dir).to_pylist()


def reader_counts(out: Path) -> dict[str, int]:
    """An output's rows as other tools count them: pyarrow's dataset discovery, pyarrow on the folder, DuckDB's
    globs (temporaries, staged and damaged parts must be invisible to every one of them)."""
    import duckdb
    import pyarrow.dataset as pads
    import pyarrow.parquet as pq

    counts = {"pyarrow.dataset": pads.dataset(out, format="parquet").count_rows(),
              "pq.read_table(dir)": pq.read_table(out).num_rows}
    for glob in ("*.parquet", "part-*", "**/*.parquet"):
        counts[f"duckdb {glob}"] = duckdb.sql(f"SELECT count(*) FROM read_parquet('{out}/{glob}')").fetchall()[0][0]
    return counts


def manifest_records(manifest: Path) -> list[dict]:
    return [json.loads(line) for line in manifest.read_text().splitlines() if line.strip()]


@pytest.fixture(scope="session")
def h():
    """The helpers above, for test modules (which cannot import this conftest under importlib mode)."""
    from types import SimpleNamespace

    return SimpleNamespace(write_config=write_config, run_cli=run_cli, run_console=run_console, cli_env=cli_env,
                           kill_tree=kill_tree,
                           descendants=descendants, read_rows=read_rows, manifest_records=manifest_records,
                           expected_choice=expected_choice, frame_signature=frame_signature, ROOT=ROOT,
                           TEST_ENGINE=TEST_ENGINE, CONSOLE=CONSOLE, reader_counts=reader_counts)
