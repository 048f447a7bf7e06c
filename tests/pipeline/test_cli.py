"""CLI contract without Ray: bad configs exit 2 naming the key or path; helper commands."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest


BAD = [
    ({"loader": {"num_frame": 8}}, "loader.num_frame"),
    ({"loader": {"num_frames": "sixteen"}}, "loader.num_frames"),
    ({"dataset": {"annotation": "/nonexistent/anno.jsonl"}}, "/nonexistent/anno.jsonl"),
    ({"loader": {"name": "decord"}}, "loader.name"),
    ({"model": {"engine": "tensorrt"}}, "model.engine"),
    ({"model": {"checkpoint": "/nonexistent/ckpt"}}, "/nonexistent/ckpt"),
    ({"prompt": {"option_labels": list("ABCDEF")}}, "prompt.option_labels"),
    ({"model": {"min_pixels": 50000, "max_pixels": 40000}}, "min_pixels"),
    ({"model": {"vllm": {"enforce_eager": True}}}, "model.vllm"),
]
# `run` shares validate's checks: two cases show it exits 2 before starting anything.
CASES = [("validate", *c) for c in BAD] + [("run", *BAD[0]), ("run", *BAD[4])]


@pytest.mark.parametrize("command, change, named", CASES)
def test_bad_config_exits_2_naming_the_problem(tmp_path, h, synthetic, command, change, named):
    manifest, _ = synthetic
    cfg = h.write_config(tmp_path / "job.yaml", manifest, **change)
    res = h.run_cli(command, str(cfg))
    assert res.returncode == 2, (res.returncode, res.stdout, res.stderr[-2000:])
    assert named in res.stderr and "Traceback" not in res.stderr, res.stderr
    assert not (tmp_path / "out").exists()        # nothing started, nothing written
    if "engine" in named:
        assert "mlx" in res.stderr and "vllm" in res.stderr   # the valid choices are listed
    assert "job.yaml" in res.stderr or named.startswith("/")    # the file is named
    if "loader.name" in named:
        assert "pyav_keyframes" in res.stderr


def test_engine_vllm_without_vllm_names_the_extra(tmp_path, h, synthetic):
    import importlib.util

    if importlib.util.find_spec("vllm") is not None:
        pytest.skip("vLLM is installed here")
    manifest, _ = synthetic
    res = h.run_cli("validate", str(h.write_config(tmp_path / "job.yaml", manifest, model={"engine": "vllm"})))
    assert res.returncode == 2 and "batchjob[vllm]" in res.stderr and "model.engine" in res.stderr, res.stderr


def test_validate_ok_and_helpers(tmp_path, h, synthetic):
    manifest, clips = synthetic
    res = h.run_cli("validate", str(h.write_config(tmp_path / "job.yaml", manifest)))
    assert res.returncode == 0 and f"{len(clips) * 3} questions on {len(clips)} clips" in res.stdout, res.stderr
    listed = h.run_cli("loaders")
    assert listed.returncode == 0 and all(n in listed.stdout
                                          for n in ("pyav_keyframes", "pyav_adaptive", "pyav_burst", "opencv"))
    missing = h.run_cli("report", str(tmp_path / "nowhere"))
    assert missing.returncode == 2 and "no part-" in missing.stderr


def test_console_script_preloads_openblas(h):
    """cron users set no env vars: the CLI re-execs itself with the system OpenBLAS preloaded."""
    openblas = "/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0"
    if not os.path.exists(openblas):
        pytest.skip("no system OpenBLAS on this machine")
    env = {k: v for k, v in h.cli_env().items() if k not in ("LD_PRELOAD", "BATCHJOB_NO_OPENBLAS")}
    run = subprocess.run([sys.executable, "-m", "batchjob.cli", "versions"], env=env, capture_output=True, text=True)
    assert run.returncode == 0 and "openblas       preloaded" in run.stdout, run.stdout + run.stderr
    env["BATCHJOB_NO_OPENBLAS"] = "1"
    run = subprocess.run([sys.executable, "-m", "batchjob.cli", "versions"], env=env, capture_output=True, text=True)
    assert "not preloaded" in run.stdout


def test_shipped_configs_parse_and_demo_copy_matches():
    """configs/*.yaml must stay valid against the schema; the packaged demo config is the same file."""
    from pathlib import Path

    from batchjob.config import load_config

    root = Path(__file__).resolve().parents[2]
    for name in ("nextqa", "mvbench", "demo"):
        cfg = load_config(root / "configs" / f"{name}.yaml")
        assert cfg.loader.num_frames in (8, 16)
    for name in ("nextqa", "mvbench"):
        cfg = load_config(root / "configs" / f"{name}.yaml")
        assert (cfg.model.checkpoint, cfg.model.max_pixels, cfg.loader.name, cfg.loader.num_frames) == \
            ("Qwen/Qwen2.5-VL-7B-Instruct", 256 * 28 * 28, "pyav_keyframes", 16)
    assert (root / "configs/demo.yaml").read_text() == (root / "batchjob/assets/demo.yaml").read_text()
    qwen3 = load_config(root / "configs" / "nextqa-qwen3vl.yaml")
    assert (qwen3.model.checkpoint, qwen3.model.timestamps, qwen3.loader.name) == \
        ("Qwen/Qwen3-VL-8B-Instruct", "actual", "pyav_keyframes")


# What nextqa-qwen3vl.yaml may set apart from nextqa.yaml: the job's name, the model, its output, Qwen3-VL's
# whole-clip pixel budget (a per-frame value would mean 16x fewer pixels) and its timestamp rule.
QWEN3_MAY_DIFFER = {"job", "model.checkpoint", "model.max_pixels", "model.timestamps", "output.directory", "source"}


def _flat(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        out.update(_flat(v, f"{prefix}{k}.") if isinstance(v, dict) else {f"{prefix}{k}": v})
    return out


def test_qwen3vl_config_is_nextqa_but_for_the_model_family():
    """Users switch models by switching these two files: every other setting (runtime sizing, remote I/O, device)
    and its comment must be the same, or the Qwen3-VL job silently runs another way."""
    from pathlib import Path

    from batchjob.config import load_config

    configs = Path(__file__).resolve().parents[2] / "configs"
    base, qwen3 = (_flat(load_config(configs / f).model_dump()) for f in ("nextqa.yaml", "nextqa-qwen3vl.yaml"))
    assert set(base) == set(qwen3)
    differ = {k for k in base if base[k] != qwen3[k]}
    assert differ <= QWEN3_MAY_DIFFER, {k: (base[k], qwen3[k]) for k in differ - QWEN3_MAY_DIFFER}
    assert qwen3["model.max_pixels"] == 16 * base["model.max_pixels"]        # the same pixels per frame, 16 frames
    assert qwen3["runtime.decode_actors"] == qwen3["runtime.engine_actors"] == "auto"
    # The text too, below the header: the same keys in the same order with the same comments, except the
    # allowed keys' own lines (a comment that drifts misleads as much as a value).
    def body(name: str) -> list[str]:
        lines = (configs / name).read_text().splitlines()
        return [ln for ln in lines[next(i for i, ln in enumerate(lines) if ln.startswith("job:")):]
                if ln.strip().split(":")[0] not in {"job", "checkpoint", "max_pixels", "timestamps", "directory",
                                                    "temporal_step"}]
    assert body("nextqa.yaml") == body("nextqa-qwen3vl.yaml")


def test_budget_larger_than_the_device_exits_2_before_any_work(tmp_path, h, synthetic):
    """`validate` and `run` refuse a memory budget this machine's device (here the CPU's RAM) cannot hold."""
    from batchjob.engine.memory_budget import host_ram_bytes
    from batchjob.synthetic.tiny_model import TinyModelSpec, write_tiny_checkpoint

    manifest, _ = synthetic
    ckpt = str(write_tiny_checkpoint(tmp_path / "tiny", TinyModelSpec()))
    too_much = host_ram_bytes() // 2**30 + 64
    cfg = h.write_config(tmp_path / "job.yaml", manifest, engine="mlx", checkpoint=ckpt,
                         model={"device": "cpu", "memory_budget_gb": too_much})
    for command in ("validate", "run"):
        res = h.run_cli(command, str(cfg))
        assert res.returncode == 2, (command, res.returncode, res.stderr[-2000:])
        for part in ("model.memory_budget_gb", f"{too_much} GiB", "physical RAM", "job.yaml"):
            assert part in res.stderr, (part, res.stderr)
        assert not (tmp_path / "out").exists()
    ok = h.write_config(tmp_path / "job.yaml", manifest, engine="mlx", checkpoint=ckpt,
                        model={"device": "cpu", "memory_budget_gb": 1})
    res = h.run_cli("validate", str(ok))
    assert res.returncode == 0, res.stderr[-2000:]
