"""Which files of a checkpoint directory hold the weights the engine reads: one rule for the engine's load
(checkpoint.py) and for anything that reads them ahead (pipeline/readahead.py). No MLX import: the job's
driver asks it before any engine exists."""
from __future__ import annotations

import json
from pathlib import Path


def weight_files(path: Path) -> list[Path]:
    """The shards mlx-vlm reads, in reading order: those the index names (when there is one), else every
    *.safetensors file but `consolidated.safetensors` (a second copy some checkpoints ship)."""
    index = path / "model.safetensors.index.json"
    try:
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        files = [path / s for s in shards if (path / s).is_file()]
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        files = []
    return files or sorted(f for f in path.glob("*.safetensors")
                           if f.name != "consolidated.safetensors" and f.is_file())
