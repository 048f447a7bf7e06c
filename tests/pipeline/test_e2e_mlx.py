"""End to end with the real MLX engine: `batchjob demo --compare-loaders` (the default trained demo model,
Qwen3-VL, and the Qwen2.5-VL one; synthetic clips) through the CLI, then the rows checked against the classifier
called directly on the same clips, the loader comparison against the job's own answers, and the demo's printed
accuracy check against a bar and chance computed here."""
from __future__ import annotations

import json

import numpy as np
import pytest

pytestmark = [pytest.mark.ray, pytest.mark.slow]   # each starts Ray (12-20 s on a busy 2-core machine)


def _check_loader_comparison(output, records, rows, summary, stdout):
    """`--compare-loaders`: every loader x GOP kind in the table, printed and in `batchjob report`; its
    pyav_adaptive row (decoded and answered in process) equals the job's own answers (Ray, decoders, engine)
    on the same clips, which were read by pyav_adaptive too."""
    from pathlib import Path

    table = json.loads((output / "loader_comparison.json").read_text())
    got = {(r["loader"], r["gop"]): r for r in table["rows"]}
    assert set(got) == {(lo, g) for lo in ("pyav_keyframes", "pyav_adaptive", "opencv") for g in ("gop0.5s", "1key")}
    assert summary["loader_comparison"]["rows"] == table["rows"]
    assert (output / "loader_comparison.html").is_file()
    assert all(f"| {lo} | {g} |" in stdout for lo, g in got), stdout
    gop = {r["video"]: r["gop"] for r in records}
    for g in ("gop0.5s", "1key"):
        for kind, acc in got[("pyav_adaptive", g)]["accuracy"].items():
            mine = [r["correct"] for r in rows if gop[Path(r["video"]).name] == g and r["category"] == kind]
            assert acc == (pytest.approx(sum(mine) / len(mine)) if mine else None), (g, kind)
        assert got[("pyav_adaptive", g)]["clips"] == len({v for v, k in gop.items() if k == g})


def _check_accuracy_lines(records, summary, stdout, recorded):
    """The demo's accuracy check, printed: each kind (and all pooled) against its bar at the recorded accuracy,
    with chance from the options; a trained model's kinds all pass (the run exited 0)."""
    from batchjob.demo_accuracy import bar

    lines = " ".join(stdout.split())
    assert "accuracy per kind against the model's training record" in lines, stdout
    for kind, v in summary["per_category"].items():
        options = [len(r["options"]) for r in records if r["category"] == kind]
        chance = sum(1 / k for k in options) / len(options)
        assert v["n"] == len(options) and v["accuracy"] > chance, (kind, v, chance)
        assert f"{kind} {v['accuracy']:.4f} over {v['n']} >= bar {bar(recorded[kind], v['n']):.4f} " \
               f"(recorded {recorded[kind]:.4f}, chance {chance:.2f})" in lines, (kind, stdout)
    assert " all " in lines and "BELOW" not in lines, stdout


@pytest.mark.parametrize("model_type", [None, "qwen2_5_vl"])     # None: the default (Qwen3-VL)
def test_demo_end_to_end_matches_direct_classifier(model_type, tmp_path, h, isolated_network, rng):
    from batchjob.demo import demo_names
    from batchjob.demo_model import DEFAULT_MODEL_TYPE, packaged_model_dir

    args = ("--model-type", model_type) if model_type else ()
    model_type = model_type or DEFAULT_MODEL_TYPE
    res = h.run_cli("demo", "--cache", str(tmp_path), "--clips", "6", *args, "--compare-loaders", timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    summary = " ".join(res.stdout.split())   # the table wraps long cells
    assert "memory budget" in summary and "auto: 75% of RAM, less" in summary and "KV" in summary, res.stdout
    assert "start-up" in summary and "to the first answer" in summary and "engine_load" in summary, res.stdout
    assert "host peak memory" in summary and "MB each" in summary, res.stdout   # the decoders' own peaks
    root = tmp_path / "demo"
    records = h.manifest_records(root / "manifest.jsonl")
    names = demo_names(model_type)
    assert json.loads((root / names.checkpoint / "training.json").read_text())["model_type"] == model_type
    rows = h.read_rows(root / names.output)
    assert sorted(r["row_id"] for r in rows) == sorted(r["id"] for r in records)
    per_clip = [sum(r["video"] == v for r in records) for v in sorted({r["video"] for r in records})]
    assert len(per_clip) == 6 and set(per_clip) <= {3, 4} and per_clip.count(4) >= 3   # order: 2+ movers
    for r in rows:
        assert r["error"] is None, r
        assert r["pred_index"] == int(np.argmax(r["probs"])) and abs(sum(r["probs"]) - 1) < 1e-4
        assert len(r["probs"]) == len(r["options"]) and r["pred_letter"] == "ABCDE"[r["pred_index"]]
        assert r["correct"] == (r["pred_index"] == r["answer"]) and len(r["frame_indices"]) == 8
        assert r["prompt_tokens"] > 0 and r["model"]

    from batchjob.pipeline.output import read_file_metadata

    engine = read_file_metadata(root / names.output)["engine"]   # who answered, on what (issue 10)
    assert engine["engine"] == "mlx" and engine["device"] == "cpu" and engine["dtype"] == "float32"
    assert engine["attention_backend"] == "portable" and engine["attention_reason"]
    memory = engine["memory"]     # the budget, where it came from and what it bought (issue 18)
    assert memory["device"] == "cpu" and memory["kv_blocks"] > 0
    assert memory["budget_source"].startswith("auto: 75% of RAM, less ")   # the decoders and Ray's store
    assert 0 < memory["weights_bytes"] + memory["kv_bytes"] < memory["budget_bytes"]
    assert memory["budget_gb"] <= memory["device_memory_gb"]

    rep = h.run_cli("report", str(root / names.output), "--json")
    s = json.loads(rep.stdout)
    assert s["accuracy"] == pytest.approx(sum(r["correct"] for r in rows) / len(rows))
    assert s["rows"] == len(records) and s["errors"] == 0 and s["loaders"] == ["pyav_adaptive"]
    assert set(s["per_category"]) == {"colour", "count", "direction", "order"}
    _check_loader_comparison(root / names.output, records, rows, s, res.stdout)
    cells = " ".join(res.stdout.replace("│", " ").split())
    for cat, v in s["per_category"].items():      # the run summary prints the same per category
        assert f"{cat} {v['accuracy']:.4f} over {v['n']} rows" in cells, (cat, res.stdout)
    recorded = json.loads((packaged_model_dir(model_type) / "training.json").read_text())["accuracy"]
    _check_accuracy_lines(records, s, res.stdout, recorded)

    # Independent path: load the clip and ask the classifier directly, one question at a time.
    from batchjob.config import load_config
    from batchjob.engine import Classifier, ClassifyRequest, Clip, EngineConfig
    from batchjob.loaders import load_video

    cfg = load_config(root / names.config)
    clf = Classifier.from_pretrained(cfg.model.checkpoint, EngineConfig(
        dtype="float32", max_pixels=cfg.model.max_pixels, memory_budget_gb=1.0))
    for row in rng.sample(rows, 3):
        frames, meta = load_video(row["video"], backend="pyav_adaptive", num_frames=8)
        assert list(meta["frames_indices"]) == row["frame_indices"]
        [direct] = clf.classify([ClassifyRequest(row["row_id"], Clip(frames, meta, row["video"]), row["question"],
                                                 tuple(row["options"]))])
        assert direct.choice == row["pred_index"], (row["row_id"], direct, row["probs"])
        np.testing.assert_allclose(direct.probs, row["probs"], atol=2e-4)
