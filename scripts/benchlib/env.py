"""What a results file must say about where it was measured, and how it is written."""
from __future__ import annotations

import datetime
import importlib
import json
import os
import platform
import subprocess
import sys
from pathlib import Path


def gpu_facts() -> dict:
    """Name, driver and memory of the first NVIDIA GPU and how many there are; `gpu: cpu` without one."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=30).stdout.strip()
        name, driver, memory = [s.strip() for s in out.splitlines()[0].split(",")]
        return {"gpu": name, "driver": driver, "gpu_memory": memory, "gpus": len(out.splitlines()),
                "gpu_details": gpu_details()}
    except (OSError, subprocess.SubprocessError, ValueError, IndexError):
        return {"gpu": "cpu", "gpus": 0}


# What tells two lent machines of one kind apart, beside the name: which board, and the limits it runs under.
GPU_DETAILS = ("uuid", "pci.bus_id", "vbios_version", "clocks.max.sm", "clocks.max.memory", "power.limit",
               "enforced.power.limit", "power.max_limit", "persistence_mode", "ecc.mode.current", "temperature.gpu")


def nvidia_smi_query(fields: tuple[str, ...], index: int, command: str = "nvidia-smi") -> list[str] | None:
    """`fields` of GPU `index` as `command` prints them (CSV, with units); None when it is missing, refuses a
    field or answers with another number of values."""
    try:
        done = subprocess.run([command, f"--id={index}", "--query-gpu=" + ",".join(fields),
                               "--format=csv,noheader"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return None
    values = [v.strip() for v in done.stdout.strip().split(",")]
    return values if done.returncode == 0 and len(values) == len(fields) else None


def gpu_details(index: int = 0) -> dict:
    """GPU_DETAILS of GPU `index` as nvidia-smi prints them; where this driver refuses one, the others still
    (asked one at a time); empty without nvidia-smi."""
    values = nvidia_smi_query(GPU_DETAILS, index)
    if values is not None:
        return dict(zip(GPU_DETAILS, values))
    if nvidia_smi_query(GPU_DETAILS[:1], index) is None:
        return {}
    return {name: got[0] for name in GPU_DETAILS if (got := nvidia_smi_query((name,), index)) is not None}


def module_versions(modules: tuple[str, ...]) -> dict:
    """`__version__` of each module (the first dotted part names the key); a missing one says so, never fails."""
    out = {}
    for mod in modules:
        try:
            out[mod.split(".")[0]] = importlib.import_module(mod).__version__
        except Exception as exc:
            out[mod.split(".")[0]] = f"missing ({type(exc).__name__})"
    return out


def environment(modules: tuple[str, ...] = ("mlx.core",)) -> dict:
    """Python, machine, CPUs, the command line, the GPU and the versions of `modules`."""
    return {"python": platform.python_version(), "machine": platform.platform(), "cpus": os.cpu_count(),
            "command": " ".join([Path(sys.argv[0]).name] + sys.argv[1:]), **gpu_facts(), **module_versions(modules)}


def results_path(out: Path, env: dict, stem: str, suffix: str = "") -> Path:
    """`<out>/<stem>-<gpu>-<date><suffix>.json` (stem first so one benchmark's files sort together)."""
    gpu = str(env.get("gpu", "gpu")).replace(" ", "-").replace("/", "-")
    return Path(out) / f"{stem}-{gpu}-{datetime.date.today().isoformat()}{suffix}.json"


def save_json(report: dict, path: Path) -> None:
    """Written to a temporary name and renamed: a run stopped at its limit leaves the last whole file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(report, indent=1, default=float) + "\n")
    tmp.rename(path)
