"""The demo's default model and what `batchjob demo` checks its accuracy against: the default is a trained model
whose clips are drawn as it was trained, its config holds its recipe, unknown model types are refused by name,
and the accuracy bar (`batchjob.demo_accuracy`) is a binomial tail that sits well above chance at the demo's size.
No Ray, no engine: the end-to-end run is tests/pipeline/test_e2e_mlx.py."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from batchjob.demo_accuracy import MISS_PROBABILITY, bar, chance_per_kind, check_kinds

ROOT = Path(__file__).resolve().parents[2]


def _records(config: Path) -> list[dict]:
    return [json.loads(x) for x in (config.parent / "manifest.jsonl").read_text().splitlines() if x.strip()]


def test_default_is_the_trained_model_that_learned_motion():
    """Qwen3-VL on "wrap" scenes is the default (direction from motion, not from where a shape stands)."""
    from batchjob.demo_model import DEFAULT_MODEL_TYPE, RECIPES, packaged_model_dir, recorded_motion

    assert DEFAULT_MODEL_TYPE == "qwen3_vl"
    record = json.loads((packaged_model_dir(DEFAULT_MODEL_TYPE) / "training.json").read_text())
    assert record["model_type"] == DEFAULT_MODEL_TYPE
    assert recorded_motion(packaged_model_dir(DEFAULT_MODEL_TYPE)) == RECIPES[DEFAULT_MODEL_TYPE].motion == "wrap"


@pytest.mark.parametrize("model_type", ["qwen3_vl", "qwen2_5_vl"])
def test_demo_set_is_drawn_as_its_checkpoint_was_trained(tmp_path, model_type):
    """The demo's clips are the scenes of the motion its checkpoint (the one its config names) records: the same
    seed's scenes drawn with that motion are those clips, and drawn with the other motion they are not (so a
    demo set drawn the wrong way fails here)."""
    from batchjob.config import load_config
    from batchjob.demo import build_demo, build_scene_clips
    from batchjob.demo_model import DEFAULT_MODEL_TYPE, RECIPES, packaged_model_dir, recorded_motion
    from batchjob.synthetic.scenes import MOTIONS

    args = () if model_type == DEFAULT_MODEL_TYPE else (model_type,)
    config = build_demo(tmp_path / "cache", 2, *args)
    checkpoint = Path(load_config(config).model.checkpoint)
    motion = recorded_motion(checkpoint)
    assert motion == recorded_motion(packaged_model_dir(model_type)) == RECIPES[model_type].motion
    records = _records(config)
    assert {r["motion"] for r in records} == {motion}
    names = {r["video"] for r in records}
    assert names == {r["video"] for r in build_scene_clips(tmp_path / "same", 2, seed=0, motion=motion)}
    [other] = [m for m in MOTIONS if m != motion]
    assert names.isdisjoint(r["video"] for r in build_scene_clips(tmp_path / "other", 2, seed=0, motion=other))


def test_default_demo_config_is_the_packaged_one_and_holds_the_recipe(tmp_path):
    """The default demo writes the packaged config unchanged (configs/demo.yaml is the same file), with the
    default recipe's pixel budget and frames; another family gets its own names, budget and output."""
    import yaml

    from batchjob.demo import build_demo
    from batchjob.demo_model import DEFAULT_MODEL_TYPE, RECIPES

    config = build_demo(tmp_path, 1)
    assert config.name == "demo.yaml" and config.read_text() == (ROOT / "configs" / "demo.yaml").read_text()
    raw = yaml.safe_load(config.read_text())
    recipe = RECIPES[DEFAULT_MODEL_TYPE]
    assert (raw["job"], raw["model"]["checkpoint"], raw["output"]["directory"]) == ("demo", "model", "output")
    assert (raw["model"]["max_pixels"], raw["loader"]["num_frames"]) == (recipe.max_pixels, recipe.num_frames)
    other = yaml.safe_load(build_demo(tmp_path, 1, "qwen2_5_vl").read_text())
    assert (other["job"], other["model"]["checkpoint"], other["output"]["directory"]) == (
        "demo-qwen2_5_vl", "model-qwen2_5_vl", "output-qwen2_5_vl")
    assert other["model"]["max_pixels"] == RECIPES["qwen2_5_vl"].max_pixels != recipe.max_pixels
    assert json.loads((tmp_path / "demo" / "model" / "training.json").read_text())["model_type"] == DEFAULT_MODEL_TYPE
    assert json.loads((tmp_path / "demo" / "model-qwen2_5_vl" / "training.json").read_text())["model_type"] == \
        "qwen2_5_vl"


def test_unknown_model_type_is_refused_by_name(tmp_path, h):
    from batchjob.demo import build_demo
    from batchjob.demo_model import check_demo_model_type, trained_motion

    for call in (lambda: build_demo(tmp_path, 1, "qwen9_vl"), lambda: trained_motion("qwen9_vl"),
                 lambda: check_demo_model_type("qwen3_vl_moe", trained=True)):
        with pytest.raises(ValueError) as e:
            call()
        assert "qwen3_vl" in str(e.value) and "qwen2_5_vl" in str(e.value), str(e.value)
    assert not (tmp_path / "demo" / "model").exists()     # refused before anything was built
    wide = h.cli_env(COLUMNS="400")     # typer's error box would wrap the message
    res = h.run_cli("demo", "--cache", str(tmp_path), "--model-type", "qwen9_vl", env=wide)
    assert res.returncode == 2 and "'qwen9_vl' is not a demo model type" in res.stderr, res.stderr
    assert "--model-type" in res.stderr and "qwen3_vl, qwen2_5_vl, qwen3_vl_moe" in res.stderr, res.stderr
    res = h.run_cli("demo", "--cache", str(tmp_path), "--model-type", "qwen3_vl_moe", "--compare-loaders", env=wide)
    assert res.returncode == 2 and "--compare-loaders needs a trained model" in res.stderr, res.stderr
    assert not (tmp_path / "demo").exists()


def test_bar_is_a_binomial_tail():
    """The bar against a simulation: a model at the recorded accuracy lands below it about as rarely as claimed
    (checked at a looser level the simulation can resolve), and the bar sits below the recorded accuracy."""
    rng = np.random.default_rng(0)
    for recorded, n in ((0.97, 24), (0.9, 40), (0.6, 12)):
        level = bar(recorded, n)
        assert level < recorded
        below = (rng.binomial(n, recorded, size=200_000) / n < level).mean()
        assert below < 5 * MISS_PROBABILITY + 1e-4, (recorded, n, level, below)
        one_more = (rng.binomial(n, recorded, size=200_000) / n < level + 1 / n).mean()
        assert one_more >= MISS_PROBABILITY, (recorded, n, level, one_more)   # the bar is the largest such
    with pytest.raises(ValueError):
        bar(1.2, 10)


def test_default_demo_bars_sit_well_above_chance(tmp_path, np_rng):
    """At the demo's default size (16 clips) every kind's bar, at the default model's recorded accuracy, is above
    chance. Simulated runs (the other kinds as recorded): one kind answered at chance passes the whole check in
    under 15% of runs (16 direction questions at 0.5 reach the bar 11/16 about 10% of the time), two kinds at
    chance, as the canary's faults break them, in under 1%. The canary (48 clips) is the sharper test."""
    from batchjob.demo import build_scene_clips
    from batchjob.demo_model import DEFAULT_MODEL_TYPE, packaged_model_dir, trained_motion

    recorded = json.loads((packaged_model_dir(DEFAULT_MODEL_TYPE) / "training.json").read_text())["accuracy"]
    records = build_scene_clips(tmp_path, 16, seed=0, motion=trained_motion(DEFAULT_MODEL_TYPE))
    chance = chance_per_kind(records)
    assert set(chance) == set(recorded)
    n = {k: sum(r["category"] == k for r in records) for k in recorded}
    levels = {k: bar(recorded[k], n[k]) for k in recorded}
    total = sum(n.values())
    pooled_level = bar(sum(recorded[k] * n[k] for k in n) / total, total)
    assert all(levels[k] > chance[k] for k in recorded), (levels, chance)
    rng = np_rng
    cases = [((k,), 0.15) for k in recorded] + [(("direction", "order"), 0.01), (("colour", "order"), 0.01)]
    for broken, most in cases:
        right = {k: rng.binomial(n[k], chance[k] if k in broken else recorded[k], size=20_000) for k in n}
        passes = np.logical_and.reduce([right[k] / n[k] >= levels[k] for k in n]
                                       + [sum(right.values()) / total >= pooled_level])
        assert passes.mean() < most, (broken, levels, chance, passes.mean())


def test_check_kinds_against_a_count_by_hand(np_rng):
    """check_kinds on random per-kind outcomes: each kind against its own bar, chance from the options, and all
    kinds pooled against the bar at their mean recorded accuracy."""
    rng = np_rng
    options = {"colour": 4, "count": 3, "direction": 2, "order": 4}
    recorded = {k: float(rng.uniform(0.6, 0.99)) for k in options}
    records = [{"category": k, "options": ["x"] * options[k]} for k in options for _ in range(int(rng.integers(3, 30)))]
    n = {k: sum(r["category"] == k for r in records) for k in options}
    right = {k: int(rng.integers(0, n[k] + 1)) for k in options}
    per_category = {k: {"n": n[k], "accuracy": right[k] / n[k]} for k in options}
    checks = {c.kind: c for c in check_kinds(per_category, recorded, chance_per_kind(records))}
    for k in options:
        c = checks[k]
        assert (c.n, c.accuracy, c.chance, c.bar) == (n[k], right[k] / n[k], pytest.approx(1 / options[k]),
                                                        bar(recorded[k], n[k]))
        assert c.passed == (right[k] / n[k] >= bar(recorded[k], n[k]))
    total = sum(n.values())
    pooled = checks["all"]
    assert pooled.n == total and pooled.accuracy == pytest.approx(sum(right.values()) / total)
    assert pooled.bar == bar(sum(recorded[k] * n[k] for k in n) / total, total)
    broken = dict(per_category, direction={"n": 40, "accuracy": 0.5})
    assert not {c.kind: c for c in check_kinds(broken, dict(recorded, direction=0.97),
                                                chance_per_kind(records))}["direction"].passed
    with pytest.raises(ValueError, match="no recorded accuracy"):
        check_kinds({"shape": {"n": 3, "accuracy": 1.0}}, recorded, {"shape": 0.5})
