"""`engine: vllm` against the MLX engine and transformers, on the same tiny random Qwen2.5-VL and frames.

Runs in the vLLM test environment (scripts/vllm_env.sh) and skips elsewhere; the MLX engine runs in that
environment when it has MLX, else in the project's main one (.venv, or $BATCHJOB_VENV), and `batchjob run`
with vLLM needs the ray extra in the vLLM environment. The checkpoint has head_dim 32: vLLM's CPU attention rejects 16. The
transformers reference uses transformers' own *video* processor (torchvision, which this environment has),
so it is what a transformers or vLLM user gets.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

pytestmark = pytest.mark.vllm
pytest.importorskip("vllm", reason="needs a real vLLM: run in the environment scripts/vllm_env.sh builds")
pytest.importorskip("torchvision", reason="the transformers reference uses its video processor (torchvision)")

from batchjob.contract import ClipJob, ClipMetadata, EngineClip, Question  # noqa: E402
from batchjob.synthetic.tiny_model import TinyModelSpec, write_tiny_checkpoint  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from engine_probe import save_clips  # noqa: E402

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
SPEC = TinyModelSpec(hidden_size=128, num_heads=4, num_kv_heads=2, intermediate_size=256, vision_hidden=64,
                     vision_heads=2, seed=11)
TOL = 1e-3


def mlx_python() -> str | None:
    """A Python with the MLX engine: $BATCHJOB_MLX_PYTHON, this one if it has MLX, else the project's main environment (CI builds
    it first: scripts/test.sh), so the vLLM environment need not carry MLX."""
    import importlib.util

    if os.environ.get("BATCHJOB_MLX_PYTHON"):
        return os.environ["BATCHJOB_MLX_PYTHON"]
    if importlib.util.find_spec("mlx") is not None and importlib.util.find_spec("mlx_vlm") is not None:
        return sys.executable
    venv = Path(os.environ.get("BATCHJOB_VENV") or ROOT / ".venv")
    return str(venv / "bin" / "python") if (venv / "bin" / "python").exists() else None


def need_mlx() -> str:
    python = mlx_python()
    if python is None:
        pytest.skip("compares with the MLX engine: needs MLX here or the project's main environment (.venv)")
    return python
# Frame sizes on the checkpoint's pixel bounds (28*28*4 .. 28*28*16): as they are, or resized by the processor.
# The last one is long enough (16 frames at the pixel cap) to fill a whole KV block on vLLM's CPU backend
# (block size 128), so its second question must find the video prefix in the prefix cache.
NO_RESIZE = [(56, 84), (84, 112), (56, 56), (112, 56), (112, 112, 16)]
RESIZE = [(100, 150), (70, 98), (45, 200), (130, 90)]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    return write_tiny_checkpoint(tmp_path_factory.mktemp("tiny-hd32"), SPEC)


def make_clips(rng: np.random.Generator, sizes, tag: str) -> list[EngineClip]:
    clips = []
    for i, (h, w, *frames) in enumerate(sizes):
        n = frames[0] if frames else int(rng.choice([2, 4]))
        indices = np.cumsum(rng.integers(1, 4, n)) - 1
        total = int(indices[-1]) + int(rng.integers(1, 5))
        meta = ClipMetadata(total_num_frames=total, fps=30.0, duration=total / 30.0, video_backend="synthetic",
                            frames_indices=tuple(int(x) for x in indices), do_sample_frames=False,
                            extra={"keyframe_source": "synthetic"})   # an extra key vLLM must never see
        questions = tuple(Question(f"{tag}{i}q{j}", f"What happens in clip {i}, question {j}?",
                                   tuple(f"option {k} {rng.integers(0, 99)}" for k in range(int(rng.integers(2, 6)))))
                          for j in range(2))
        frames = rng.integers(0, 256, (n, h, w, 3), dtype=np.uint8)
        clips.append(EngineClip(ClipJob(f"{tag}{i}.mp4", f"{tag}{i}|{h}x{w}", questions), meta, frames))
    return clips


def answers(kind: str, checkpoint: Path, directory: Path) -> dict:
    python = need_mlx() if kind == "mlx" else sys.executable
    res = subprocess.run([python, str(HERE / "engine_probe.py"), kind, str(checkpoint), str(directory)],
                         capture_output=True, text=True, timeout=600, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert res.returncode == 0, res.stderr[-3000:]
    return json.loads((directory / f"{kind}.json").read_text())


def test_vllm_matches_the_mlx_engine_and_transformers(checkpoint, tmp_path):
    seed = int(os.environ.get("BATCHJOB_TEST_SEED", np.random.SeedSequence().entropy % 2**32))
    print(f"BATCHJOB_TEST_SEED={seed}")
    rng = np.random.default_rng(seed)
    clips = make_clips(rng, NO_RESIZE, "plain") + make_clips(rng, RESIZE, "resized")
    save_clips(tmp_path, clips)
    by = {kind: answers(kind, checkpoint, tmp_path) for kind in ("mlx", "vllm", "transformers")}
    report = {}
    for kind in ("plain", "resized"):
        rows = [q.row_id for c in clips for q in c.job.questions if q.row_id.startswith(kind)]
        assert all(by[e][r]["error"] is None for e in by for r in rows), {e: by[e][r]["error"] for e in by for r in rows}

        def diff(a: str, b: str) -> float:
            return max(float(np.abs(np.subtract(by[a][r]["probs"], by[b][r]["probs"])).max()) for r in rows)

        report[kind] = {"requests": len(rows), "vllm_vs_transformers": diff("vllm", "transformers"),
                        "vllm_vs_mlx": diff("vllm", "mlx"), "mlx_vs_transformers": diff("mlx", "transformers"),
                        "spread": max(float(np.ptp(by["transformers"][r]["probs"])) for r in rows)}
    print(json.dumps(report, indent=1))
    for kind, figures in report.items():
        assert figures["requests"] >= 8
        assert figures["spread"] > 0.02, f"{kind}: near-uniform options would make the comparison weak"
        for pair in ("vllm_vs_transformers", "vllm_vs_mlx", "mlx_vs_transformers"):
            assert figures[pair] < TOL, (kind, pair, figures)
    vllm, mlx = by["vllm"], by["mlx"]
    # Prefix caching: the second question about a clip reuses its video prefix.
    long_clip = clips[len(NO_RESIZE) - 1].job.questions
    assert vllm[long_clip[0].row_id]["cached_tokens"] == 0 < vllm[long_clip[1].row_id]["cached_tokens"], long_clip
    for r, a in vllm.items():   # the same prompt as the MLX engine's, probabilities over the options only
        assert abs(sum(a["probs"]) - 1) < 1e-9 and a["prompt_tokens"] == mlx[r]["prompt_tokens"]


def _write_job(path: Path, data: Path, checkpoint: Path, out: Path, engine: str) -> Path:
    import yaml

    cfg = yaml.safe_load((ROOT / "configs" / "demo.yaml").read_text())
    cfg["dataset"].update(annotation=str(data / "manifest.jsonl"), video_root=str(data / "clips"))
    # float32 for both: `dtype: auto` (the demo's) is each engine's own default, and vLLM's turns a float32
    # checkpoint into half precision (bfloat16 on a CPU), which moves the probabilities by ~1e-3.
    # max_pixels: the Qwen2.5-VL per-frame budget this test was written for (the demo config's is now the
    # Qwen3-VL demo model's whole-clip budget)
    cfg["model"].update(checkpoint=str(checkpoint), engine=engine, dtype="float32", max_pixels=7056)
    if engine == "vllm":
        cfg["model"]["vllm"] = {"max_model_len": 4096, "enforce_eager": True}
    cfg["output"].update(directory=str(out), rows_per_part=8)
    cfg["runtime"].update(decode_cpus=0.5, engine_cpus=1)
    path.write_text(yaml.safe_dump(cfg))
    return path


def _run(*args: str, python: str = sys.executable) -> subprocess.CompletedProcess:
    # One vLLM process per engine actor (a tiny model starts in seconds), a small CPU KV cache.
    env = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_KVCACHE_SPACE": "1", **os.environ,
           "RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0"}
    return subprocess.run([python, "-m", "batchjob.cli", *args], capture_output=True, text=True,
                          timeout=600, env=env, cwd=ROOT)


@pytest.mark.ray
@pytest.mark.slow
def test_batchjob_run_with_vllm_writes_the_mlx_engines_rows(tmp_path, checkpoint):
    pytest.importorskip("ray", reason="batchjob run needs the ray extra in the vLLM environment")
    from batchjob.demo import build_synthetic_dataset
    from batchjob.pipeline.output import read_file_metadata, read_output

    pythons = {"mlx": need_mlx(), "vllm": sys.executable}

    data = tmp_path / "data"
    manifest, clips = build_synthetic_dataset(data, num_clips=5, seconds=(0.8, 2.5),
                                              seed=int(np.random.SeedSequence().entropy % 2**31))
    # error rows: a corrupt clip and a missing one
    (data / "clips" / "corrupt.mp4").write_bytes(b"\x00not a video" * 100)
    records = [json.loads(line) for line in manifest.read_text().splitlines() if line.strip()]
    bad = [{**records[0], "id": "bad-corrupt", "video": "corrupt.mp4"},
           {**records[0], "id": "bad-missing", "video": "missing.mp4"}]
    manifest.write_text("".join(json.dumps(r) + "\n" for r in records + bad))
    tables = {}
    for engine in ("mlx", "vllm"):
        out = tmp_path / f"out-{engine}"
        job = _write_job(tmp_path / f"{engine}.yaml", data, checkpoint, out, engine)
        if engine == "vllm":   # resume: a partial run first, then the rest
            res = _run("run", str(job), "--limit", "4", python=pythons[engine])
            assert res.returncode in (0, 1), res.stderr[-3000:]
        res = _run("run", str(job), python=pythons[engine])
        assert res.returncode in (0, 1), res.stderr[-3000:]   # 1: error rows above the job's threshold
        tables[engine] = {r["row_id"]: r for r in read_output(out).to_pylist()}
        assert read_file_metadata(out)["engine"]["dtype"] == "float32", read_file_metadata(out)["engine"]
    mlx, vllm = tables["mlx"], tables["vllm"]
    worst = max((float(np.abs(np.subtract(mlx[r]["probs"], vllm[r]["probs"])).max()) for r in mlx if mlx[r]["probs"]),
                default=0.0)
    print(f"{len(mlx)} rows, {sum(1 for r in mlx.values() if r['error'])} error rows; "
          f"max |dprob| mlx vs vllm = {worst:.2e}")
    assert sorted(mlx) == sorted(vllm) == sorted(r["id"] for r in records + bad)   # every row exactly once
    for row_id, a in mlx.items():
        b = vllm[row_id]
        for key in ("video", "question", "options", "answer", "frame_indices", "error", "loader", "num_frames"):
            assert a[key] == b[key] or (key == "error" and a[key] and b[key]), (row_id, key, a[key], b[key])
        if a["error"]:
            assert a["probs"] is None and b["probs"] is None and b["pred_index"] is None
            continue
        pa, pb = np.array(a["probs"]), np.array(b["probs"])
        assert np.abs(pa - pb).max() < TOL, (row_id, pa, pb)
        if a["pred_index"] != b["pred_index"]:   # only within TOL of a tie
            top = np.sort(pa)[-2:]
            assert top[1] - top[0] < 2 * TOL, (row_id, pa, pb)
        assert a["prompt_tokens"] == b["prompt_tokens"]
    assert {vllm[r]["error"].split(":")[0] for r in ("bad-corrupt", "bad-missing")} == {"decode failed"}


def test_the_run_records_the_dtype_vllm_chose_for_auto(checkpoint):
    """`dtype: auto` is vLLM's own rule (half precision for a float32 checkpoint): the engine's description,
    which goes into every part's metadata, names the dtype that answered, never the word `auto`."""
    code = ("import sys; from batchjob.config import ModelConfig, PromptConfig, VllmConfig; "
            "from batchjob.pipeline.vllm_engine import VllmEngine; "
            "e = VllmEngine.load(ModelConfig(checkpoint=sys.argv[1], engine='vllm', dtype=sys.argv[2], "
            "vllm=VllmConfig(max_model_len=4096, enforce_eager=True)), PromptConfig()); "
            "print('DTYPE', e.describe().details['dtype'])")
    env = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_KVCACHE_SPACE": "1", **os.environ,
           "PYTHONPATH": str(ROOT)}
    got = {}
    for asked in ("auto", "float32"):
        res = subprocess.run([sys.executable, "-c", code, str(checkpoint), asked], capture_output=True, text=True,
                             timeout=600, env=env)
        assert res.returncode == 0, res.stderr[-3000:]
        got[asked] = [ln.split()[1] for ln in res.stdout.splitlines() if ln.startswith("DTYPE ")][-1]
    assert got["float32"] == "float32", got
    assert got["auto"] in ("bfloat16", "float16"), got     # float32 checkpoint, vLLM's auto: half precision
