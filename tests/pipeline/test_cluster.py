"""Scale-out: a two-node Ray cluster on loopback started the way a user would (`ray start`), a job run
through `--ray-address`, decoders placed on both nodes."""
from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path

import pytest

pytestmark = [pytest.mark.ray, pytest.mark.slow]   # each starts Ray (12-20 s on a busy 2-core machine)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def ray_start(h, args: list[str], temp_dir: str, **env: str) -> subprocess.Popen:
    ray_bin = Path(os.environ.get("VIRTUAL_ENV", "")) / "bin" / "ray"
    exe = str(ray_bin) if ray_bin.exists() else shutil.which("ray") or "ray"
    return subprocess.Popen([exe, "start", "--block", "--node-ip-address=127.0.0.1", "--disable-usage-stats",
                             f"--temp-dir={temp_dir}", *args], env=h.cli_env(**env), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)


def wait_started(proc: subprocess.Popen, timeout: float = 90) -> str:
    """`ray start --block` prints a banner once its node is up; read until then."""
    seen = []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            if proc.poll() is not None:
                break
            continue
        seen.append(line)
        if "Ray runtime started" in line:
            return "".join(seen)
    raise AssertionError("ray start did not come up:\n" + "".join(seen[-40:]))


def test_two_node_cluster_spreads_decoders(tmp_path, h, synthetic, isolated_network):
    """Also the GPU path without GPUs: the head declares two logical GPUs, so `engine_actors: auto` makes two
    replicas with one Ray GPU each, and Ray hands each its own CUDA_VISIBLE_DEVICES."""
    manifest, _clips = synthetic
    port = free_port()
    temp_dir = tempfile.mkdtemp(prefix="bjray", dir="/tmp")   # short: Ray's socket paths must fit 107 bytes
    engine_log = tmp_path / "engines"
    engine_log.mkdir()
    nodes: list[subprocess.Popen] = []
    try:
        head = ray_start(h, ["--head", f"--port={port}", "--include-dashboard=false", "--num-cpus=2",
                             "--num-gpus=2"], temp_dir, BATCHJOB_TEST_ENGINE_LOG=str(engine_log))
        nodes.append(head)
        wait_started(head)
        worker = ray_start(h, [f"--address=127.0.0.1:{port}", "--num-cpus=1", "--num-gpus=0"], temp_dir)
        nodes.append(worker)
        wait_started(worker)
        cfg = h.write_config(tmp_path / "job.yaml", manifest, runtime={"engine_actors": "auto"})
        res = h.run_cli("run", str(cfg), "--ray-address", f"127.0.0.1:{port}", "--stats-json",
                        str(tmp_path / "stats.json"))
        assert res.returncode == 0, res.stderr[-3000:]
        rows = h.read_rows(tmp_path / "out")
        assert sorted(r["row_id"] for r in rows) == sorted(r["id"] for r in h.manifest_records(manifest))
        decode_nodes = {r["decode_node"] for r in rows}
        assert len(decode_nodes) == 2, f"decoders ran on {decode_nodes}; expected the head and the worker node"
        stats = json.loads((tmp_path / "stats.json").read_text())
        assert (stats["engines"], stats["engine_gpus"], stats["decoders"]) == (2, 1.0, 2)
        visible = sorted(p.read_text() for p in engine_log.iterdir())
        assert visible == ["0", "1"], visible
    finally:
        for proc in reversed(nodes):     # our own nodes only, by pid (never `ray stop`)
            h.kill_tree(proc)
        shutil.rmtree(temp_dir, ignore_errors=True)
