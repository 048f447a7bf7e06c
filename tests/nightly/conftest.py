"""Helpers for nightly tests that need no Ray: random run records, output rows, a seed."""
from __future__ import annotations

import os
import random
import time
from datetime import datetime, timedelta, timezone
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def rng() -> random.Random:
    seed = int(os.environ.get("BATCHJOB_TEST_SEED", time.time_ns() % 100_000))
    print(f"nightly test seed: {seed} (set BATCHJOB_TEST_SEED to reproduce)")
    return random.Random(seed)


def make_record(rng: random.Random, job: str, night: str, *, output: str | None = None, exit_status: int = 0,
                accuracy: float | None = None, started: datetime | None = None, **kw):
    from batchjob.nightly.history import RunRecord

    started = started or datetime(2026, 1, 1, 1, 30, tzinfo=timezone.utc) + timedelta(seconds=rng.randint(0, 10**7))
    answered = rng.randint(0, 500)
    fields = dict(
        nightly_run_id=f"n{rng.randint(0, 10**9)}", night=night, job=job, config=f"/cfg/{job}.yaml",
        fingerprint=f"{rng.getrandbits(64):016x}", output=output or f"/out/{job}/{night}", model="/models/m",
        model_hash=f"{rng.getrandbits(64):016x}", engine_model="m", loader="pyav_keyframes",
        started_at=started, finished_at=started + timedelta(seconds=rng.randint(1, 3600)), rows_total=answered + 7,
        rows_answered=answered, error_rows=rng.randint(0, answered), output_rows=answered + 7,
        output_error_rows=rng.randint(0, 7), accuracy=rng.random() if accuracy is None else accuracy,
        per_category={f"cat{i}": {"n": float(rng.randint(1, 9)), "accuracy": rng.random()} for i in range(2)},
        rows_per_s=rng.random() * 10, exit_status=exit_status, alerts=[], batchjob_version="0.1.0",
        mlx_version="0.32.4", av_version="18.1", ray_version=None, host="h", log=None)
    fields.update(kw)
    return RunRecord(**fields)


def output_rows(rng: random.Random, ids: list[str], *, error_p: float = 0.15, model: str = "m") -> list[dict]:
    """Rows in the job output's schema, random answers / probabilities / errors."""
    rows = []
    for rid in ids:
        n = rng.choice([2, 3, 4, 5])
        answer = rng.randrange(n)
        err = "decode failed" if rng.random() < error_p else None
        probs = [rng.random() for _ in range(n)]
        total = sum(probs)
        probs = [p / total for p in probs]
        pred = None if err else max(range(n), key=probs.__getitem__)
        rows.append({"row_id": rid, "video": f"{rid.split('q')[0]}.mp4", "question": f"q about {rid}",
                     "options": [f"o{i}" for i in range(n)], "answer": answer, "category": rng.choice("xyz"),
                     "pred_index": pred, "pred_letter": None if err else "ABCDE"[pred], "probs": None if err else probs,
                     "correct": False if err else pred == answer, "error": err, "model": model})
    return rows


@pytest.fixture
def nh():
    """The helpers above, for test modules (which cannot import this conftest under importlib mode)."""
    from types import SimpleNamespace

    return SimpleNamespace(make_record=make_record, output_rows=output_rows, ROOT=ROOT)
