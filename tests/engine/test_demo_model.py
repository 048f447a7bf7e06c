"""The demo model and its training: the trainer computes what the engine computes, saves weights the hub way,
its short mode lowers the loss, and the committed checkpoint is the one its training record names."""
from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[2]


def _probs(logits: np.ndarray) -> np.ndarray:
    e = np.exp(logits - logits.max(axis=1, keepdims=True))
    return e / e.sum(axis=1, keepdims=True)


def _assert_engine_agrees(model, prep, checkpoint: Path, config, seed: int) -> None:
    """Option probabilities of the trainer's forward (in-memory `model`) and of the Classifier loading
    `checkpoint` from disk, on fresh clips and every question kind."""
    from batchjob.engine import Classifier, ClassifyRequest, Clip
    from batchjob.synthetic.scenes import questions_for
    from batchjob.synthetic.trainer import batch_logits, sample_clip

    clf = Classifier.from_pretrained(checkpoint, config)
    rng = np.random.default_rng(seed)
    kinds = set()
    for k in range(3):
        scene, frames, meta = sample_clip(rng, 8, order=k != 1)
        inputs = prep.clip_inputs(frames, meta)
        questions = questions_for(scene)
        ours = _probs(batch_logits(model, prep.family, prep.batch([inputs], [prep.example(0, inputs, q)
                                                                              for q in questions])))
        theirs = clf.classify([ClassifyRequest(f"r{i}", Clip(frames, meta, f"clip{k}"), q.text, q.options)
                               for i, q in enumerate(questions)])
        for q, row, answer in zip(questions, ours, theirs):
            assert answer.error is None
            np.testing.assert_allclose(row[:len(q.options)], answer.probs, atol=2e-5, err_msg=q.kind)
            kinds.add(q.kind)
    assert kinds == {"colour", "count", "direction", "order"}


@pytest.mark.parametrize("model_type", ["qwen2_5_vl", "qwen3_vl"])
def test_saved_weights_are_what_the_engine_loads(tmp_path, model_type):
    """Perturb every parameter (as training does), save in the hub layout, load with the engine: the engine's
    answers equal the trainer's forward on the in-memory model."""
    import mlx.core as mx
    from mlx.utils import tree_map

    from batchjob.demo_model import RECIPES
    from batchjob.synthetic.tiny_model import write_tiny_checkpoint
    from batchjob.synthetic.trainer import EnginePrep, load_for_training, save_hub_weights

    recipe = RECIPES[model_type]
    path = write_tiny_checkpoint(tmp_path / "ckpt", recipe.spec(seed=3))
    prep = EnginePrep(path, recipe.engine_config)
    model = load_for_training(path, prep.family)
    mx.random.seed(4)
    model.update(tree_map(lambda p: p + 0.05 * mx.random.normal(p.shape), model.parameters()))
    save_hub_weights(model, path)
    _assert_engine_agrees(model, prep, path, recipe.engine_config, seed=5)


def test_short_training_lowers_the_loss(tmp_path):
    """The script's CI mode: a few steps from random initialisation lower the loss on a fixed batch, and the
    record names the files it wrote."""
    out = tmp_path / "model"
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "train_demo_model.py"), "--short", "--out", str(out)],
                       capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert r.returncode == 0, r.stdout + r.stderr
    record = json.loads((out / "training.json").read_text())
    before, after = record["fixed_batch_loss"]
    assert after < before, record
    assert [c["step"] for c in record["curve"]] == sorted(c["step"] for c in record["curve"])
    from batchjob.demo_model import checkpoint_sha256

    assert record["sha256"] == checkpoint_sha256(out)


def _train_script():
    spec = importlib.util.spec_from_file_location("train_demo_model", ROOT / "scripts" / "train_demo_model.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_training_environment_is_pinned_however_the_shell_started():
    """A fresh shell, one that already preloads OpenBLAS (scripts/env.sh) and one that names its own thread count
    each end in one environment the script trains in; the weights depend on the BLAS thread count, so the
    first two must end in the same one (the recorded rebuild command is the same in both)."""
    from batchjob.openblas import OPENBLAS as blas

    script = _train_script()
    pinned = script.pinned_environment
    fresh = pinned({"PATH": "/bin"}, linux=True, openblas_exists=True)
    assert fresh == {"PATH": "/bin", "LD_PRELOAD": blas, "OMP_NUM_THREADS": "1", "BATCHJOB_NO_OPENBLAS": "1"}
    env_sh = pinned({"PATH": "/bin", "LD_PRELOAD": f"{blas}:/lib/other.so"}, linux=True, openblas_exists=True)
    assert env_sh["OMP_NUM_THREADS"] == "1" and env_sh["LD_PRELOAD"] == f"{blas}:/lib/other.so"
    assert pinned({"LD_PRELOAD": "/lib/other.so"}, linux=True, openblas_exists=True)["LD_PRELOAD"] == \
        f"{blas}:/lib/other.so"
    # a count the caller names is kept, whichever of OpenBLAS's variables names it (and recorded as such)
    for var in script.BLAS_THREAD_VARS:
        told = pinned({"LD_PRELOAD": blas, var: "2"}, linux=True, openblas_exists=True)
        assert told is None and script._blas_threads({var: "2", "OMP_NUM_THREADS": "3"}) == (
            "2" if var != "OMP_NUM_THREADS" else "3")
    # already pinned, opted out, or no OpenBLAS to preload: nothing to start again for
    assert pinned(fresh, linux=True, openblas_exists=True) is None
    assert pinned({"BATCHJOB_NO_OPENBLAS": "1"}, linux=True, openblas_exists=True) is None
    assert pinned({"OMP_NUM_THREADS": "1"}, linux=False, openblas_exists=True) is None
    assert pinned({}, linux=True, openblas_exists=False) == {"OMP_NUM_THREADS": "1", "BATCHJOB_NO_OPENBLAS": "1"}


@pytest.mark.parametrize("model_type", ["qwen2_5_vl", "qwen3_vl"])
def test_committed_checkpoint_matches_its_training_record(model_type):
    """The packaged files hash to what the training script recorded, and the record holds what rebuilding
    needs (seed, command) and what the canary compares with (accuracy per kind, well above chance)."""
    from batchjob.demo_model import RECIPES, checkpoint_files, checkpoint_sha256, packaged_model_dir

    path = packaged_model_dir(model_type)
    record = json.loads((path / "training.json").read_text())
    assert record["sha256"] == checkpoint_sha256(path)
    assert {"model.safetensors", "config.json"} <= {p.name for p in checkpoint_files(path)}
    assert record["model_type"] == model_type and isinstance(record["seed"], int)
    assert record["command"].startswith("scripts/train_demo_model.py")
    assert ("--model-type qwen3_vl" in record["command"]) == (model_type == "qwen3_vl")
    # rebuilding with the recorded command trains what the recipe says: the same scenes, steps and loss weights
    recipe = RECIPES[model_type]
    assert "--steps" not in record["command"] and "--motion" not in record["command"]
    assert (record.get("motion", "span"), record["steps"], record["kind_weights"]) == (
        recipe.motion, recipe.steps, recipe.kind_weights)
    assert set(record["accuracy"]) == {"colour", "count", "direction", "order"}
    # issue 20's bar on fresh clips of the training distribution, measured on enough clips to mean it (1200 clips:
    # 1200 questions per kind, 600 order questions; a standard error under 1%)
    assert record["eval_clips"] >= 1200 and all(v >= 0.95 for v in record["accuracy"].values()), record["accuracy"]
    # trained with the BLAS thread count the script pins (the weights depend on it), within issue 20's 15 minutes
    # for set-up, training and the final evaluation on the 2-core machine
    assert record["threads"] == "1" and record["openblas"], record
    assert record["training_seconds"] + record["eval_seconds"] <= 15 * 60, record


@pytest.mark.parametrize("model_type", ["qwen2_5_vl", "qwen3_vl"])
def test_committed_checkpoint_trainer_and_engine_agree(model_type):
    from batchjob.demo_model import RECIPES, packaged_model_dir
    from batchjob.synthetic.trainer import EnginePrep, load_for_training

    recipe, path = RECIPES[model_type], packaged_model_dir(model_type)
    prep = EnginePrep(path, recipe.engine_config)
    _assert_engine_agrees(load_for_training(path, prep.family), prep, path, recipe.engine_config, seed=11)
