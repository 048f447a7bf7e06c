"""Prefill-only VLM classifier on MLX: packed paged attention, video encoded once per clip.

`Classifier.from_pretrained(path, EngineConfig(...)).classify(requests)` answers multiple-choice questions
about decoded clips with one forward pass each; see classifier.py for the loop and DESIGN.md for the shape.
The names below are imported on first use, so `batchjob.engine.types` or `.process_setup` can be imported
(by the pipeline, or the vLLM engine) on a node without MLX.
"""
from __future__ import annotations

import importlib

_EXPORTS = {
    "Classifier": ".classifier",
    "ClassifyRequest": ".types", "ClassifyResult": ".types", "Clip": ".types", "EngineConfig": ".types",
    "EngineError": ".types",
    "VideoInputs": ".preprocess", "VisionSettings": ".preprocess", "load_vision_settings": ".preprocess",
    "preprocess_video": ".preprocess",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name], __name__), name)
    globals()[name] = value
    return value
