"""The end-to-end accuracy canary: the committed demo model, a full `batchjob run` (console script, Ray, decoders,
engine, Parquet) on fresh seeded clips, must answer as well as it did at training time, and must not when the
frames go wrong on the way (reversed, colour channels swapped, order shuffled).

What it protects: the chain from the file to the answer (decoding, frame choice and order, colour conversion,
preprocessing, prompt, positions), which parity with transformers does not see: a mistake there leaves outputs
well formed and only makes them wrong.

The bar per question kind is the accuracy recorded at training time (`training.json`), less a margin that a
correct run misses with probability below 1e-4 (binomial tail at the recorded accuracy, for this run's number
of questions); each fault must drop the kinds it breaks (pooled) below the bar at their recorded accuracy.
"""
from __future__ import annotations

import json
import os
from collections import defaultdict
from pathlib import Path

import pytest

from batchjob.demo_accuracy import bar

pytestmark = [pytest.mark.ray, pytest.mark.slow, pytest.mark.usefixtures("isolated_network")]

HERE = Path(__file__).resolve().parent
CLIPS = 48
FAULTS = ("clean", "reversed", "channels", "shuffled")   # folders canary_faults.py reads the fault from
# what each fault breaks: reversed time flips direction and order; BGR swaps red and blue (colour, and the
# order question, whose options are colours); shuffled frames scramble motion
BROKEN = {"reversed": ("direction", "order"), "channels": ("colour",), "shuffled": ("direction", "order")}


@pytest.fixture(scope="module", params=["qwen2_5_vl", "qwen3_vl"])
def canary_run(request, tmp_path_factory, h, seed):
    """One `batchjob run` per model family over fresh clips, every question asked once per fault folder."""
    from batchjob.demo import build_scene_clips
    from batchjob.demo_model import RECIPES, packaged_model_dir, trained_motion

    model, recipe = packaged_model_dir(request.param), RECIPES[request.param]
    if not (model / "training.json").is_file():
        pytest.fail(f"{model}: no trained demo model (scripts/train_demo_model.py writes it)")
    root = tmp_path_factory.mktemp("canary")
    records = build_scene_clips(root / "clips" / "clean", CLIPS, seed=seed, motion=trained_motion(request.param))
    rows = []
    for fault in FAULTS:
        if fault != "clean":
            (root / "clips" / fault).mkdir()
            for name in {r["video"] for r in records}:
                os.link(root / "clips" / "clean" / name, root / "clips" / fault / name)
        rows += [{**r, "id": f"{fault}/{r['id']}", "video": f"{fault}/{r['video']}", "fault": fault} for r in records]
    manifest = root / "manifest.jsonl"
    manifest.write_text("".join(json.dumps(r) + "\n" for r in rows))
    config = h.write_config(root / "job.yaml", manifest, engine="canary_faults:FaultyMlxEngine",
                            checkpoint=str(model), model={"dtype": "auto", "max_pixels": recipe.max_pixels},
                            loader={"name": "opencv", "num_frames": recipe.num_frames},
                            runtime={"clips_per_batch": 4, "frames_in_flight": 8, "engine_cpus": 1},
                            output={"directory": str(root / "out"), "rows_per_part": 256, "flush_seconds": 5})
    r = h.run_console("run", str(config), timeout=600, env=h.cli_env(PYTHONPATH=os.pathsep.join(
        [str(HERE), str(h.ROOT)])))
    assert r.returncode == 0, r.stdout + r.stderr
    accuracy: dict[str, dict[str, list[bool]]] = defaultdict(lambda: defaultdict(list))
    for row in h.read_rows(root / "out"):
        assert row["error"] is None, row
        fault = row["row_id"].split("/")[0]
        accuracy[fault][row["category"]].append(bool(row["correct"]))
    recorded = json.loads((model / "training.json").read_text())["accuracy"]
    return recorded, accuracy, request.param


def recorded_family(run) -> str:
    return run[2]


def test_clean_run_reaches_recorded_accuracy(canary_run):
    recorded, accuracy, _ = canary_run
    clean = accuracy["clean"]
    assert set(clean) == set(recorded)
    report = {k: (sum(v) / len(v), len(v), recorded[k], bar(recorded[k], len(v))) for k, v in clean.items()}
    print(f"canary {recorded_family(canary_run)} (accuracy, questions, recorded, bar):", report)
    for kind, (acc, n, rec, level) in report.items():
        assert acc >= level, f"{kind}: {acc:.3f} over {n} questions, below {level:.3f} (recorded {rec:.3f})"


@pytest.mark.parametrize("fault", sorted(BROKEN))
def test_fault_drops_accuracy_below_the_bar(canary_run, fault):
    """The kinds a fault breaks, pooled (a shuffle leaves about half the direction answers right by chance:
    per kind, 48 questions could land above the bar): below the bar at their pooled recorded accuracy. A
    correct run's pooled count varies less than a binomial at the mean accuracy, so that bar holds it too."""
    recorded, accuracy, family = canary_run
    pooled, expected = [], 0.0
    for kind in BROKEN[fault]:
        answers = accuracy[fault][kind]
        print(f"canary {family} fault {fault}: {kind} {sum(answers) / len(answers):.3f} over {len(answers)}")
        pooled += answers
        expected += recorded[kind] * len(answers)
    acc, level = sum(pooled) / len(pooled), bar(expected / len(pooled), len(pooled))
    assert acc < level, f"{fault}: {BROKEN[fault]} still at {acc:.3f} over {len(pooled)} (bar {level:.3f})"
