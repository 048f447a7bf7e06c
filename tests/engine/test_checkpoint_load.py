"""The engine reads each weight file once, while mlx-vlm and transformers import, and builds the same model as
mlx-vlm's own loader from the same files (sharded or not)."""
from __future__ import annotations

import json
import random
import shutil

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten

from batchjob.engine import checkpoint as ckpt
from batchjob.engine.types import EngineConfig


def shard(src, dst, parts: int, rng: random.Random) -> list[str]:
    """The checkpoint at `src` copied to `dst` with its weights split at random into `parts` files + an index."""
    shutil.copytree(src, dst)
    (dst / "model.safetensors").unlink()
    weights = mx.load(str(src / "model.safetensors"))
    names = sorted(weights)
    rng.shuffle(names)
    cuts = sorted(rng.sample(range(1, len(names)), parts - 1))
    files, weight_map = [], {}
    for i, chunk in enumerate(np.split(np.array(names, dtype=object), cuts)):
        name = f"model-{i + 1:05d}-of-{parts:05d}.safetensors"
        mx.save_safetensors(str(dst / name), {k: weights[k] for k in chunk})
        weight_map.update({k: name for k in chunk})
        files.append(str(dst / name))
    (dst / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return files


@pytest.mark.parametrize("name", ["qwen2_5_vl-gqa", "qwen3_vl"])
@pytest.mark.parametrize("parts", [1, 3])
def test_each_file_read_once_and_the_model_matches_mlx_vlms_loader(tmp_path, checkpoint_dir, monkeypatch, name, parts,
                                                                  rng):
    from mlx_vlm.utils import load_model

    from batchjob.engine.families import family_for

    path = ckpt.Path(checkpoint_dir(name))
    if parts > 1:
        files = shard(path, tmp_path / "sharded", parts, random.Random(int(rng.integers(2**32))))
        path = tmp_path / "sharded"
    else:
        files = [str(path / "model.safetensors")]
    assert sorted(map(str, ckpt.weight_files(path))) == sorted(files)

    reads: list[str] = []
    real_load = mx.load
    monkeypatch.setattr(mx, "load", lambda f, *a, **k: (reads.append(str(f)), real_load(f, *a, **k))[1])
    loaded = ckpt.load_checkpoint(path, EngineConfig(dtype="float32"))
    monkeypatch.setattr(mx, "load", real_load)
    assert sorted(reads) == sorted(files), "every weight file read exactly once"

    reference = load_model(path)            # mlx-vlm alone, then the same load-time corrections
    family_for(json.loads((path / "config.json").read_text()), path).fix_model(reference)
    reference.set_dtype(mx.float32)
    ours, theirs = dict(tree_flatten(loaded.model.parameters())), dict(tree_flatten(reference.parameters()))
    assert ours.keys() == theirs.keys()
    for k in ours:
        assert ours[k].dtype == theirs[k].dtype and mx.array_equal(ours[k], theirs[k]).item(), k


def test_a_file_mlx_cannot_read_is_left_to_mlx_vlm(tmp_path, monkeypatch):
    """A shard MLX's reader refuses (a dtype mlx-vlm converts itself) is not prefetched; the rest are."""
    good, odd = tmp_path / "a.safetensors", tmp_path / "b.safetensors"
    mx.save_safetensors(str(good), {"w": mx.arange(4)})
    odd.write_bytes(b"not safetensors")
    shards = ckpt.read_weights([good, odd])
    assert list(shards) == [str(good)] and mx.array_equal(shards[str(good)]["w"], mx.arange(4)).item()


def test_a_failed_background_import_is_raised_where_the_model_loads(monkeypatch):
    import builtins

    real_import = builtins.__import__

    def refuse(name, *args, **kwargs):
        if name == "mlx_vlm.utils":
            raise ImportError("mlx_vlm.utils broken for this test")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", refuse)
    imports = ckpt._BackgroundImports()
    with pytest.raises(ImportError, match="broken for this test"):
        imports.wait()
