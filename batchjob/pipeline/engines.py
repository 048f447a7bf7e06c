"""Engine registry: the seam between the pipeline and whatever answers the questions.

`model.engine` names a built-in engine ("mlx", "vllm") or a plugin given as `package.module:Class`; either
way the result implements `batchjob.contract.Engine`. Built-in engines are named by module path and
imported only when resolved, so the driver never imports MLX or vLLM (the MLX engine module itself imports
MLX only inside `load`, so resolving it is cheap everywhere).
"""
from __future__ import annotations

import importlib

from batchjob.config import ConfigError, ModelConfig
from batchjob.contract import Engine, InputPreparer, missing_engine_methods

ENGINES: dict[str, str] = {
    "mlx": "batchjob.pipeline.mlx_engine:MlxEngine",
    "vllm": "batchjob.pipeline.vllm_engine:VllmEngine",
}


def resolve_engine(name: str) -> type[Engine]:
    """The engine class for `model.engine`; ConfigError naming the valid choices or what a plugin lacks."""
    target = ENGINES.get(name, name)
    if ":" not in target:
        raise ConfigError(f"model.engine: unknown engine {name!r}; valid: {', '.join(sorted(ENGINES))} "
                          "or a plugin 'package.module:Class'")
    mod_name, _, attr = target.partition(":")
    try:
        engine = getattr(importlib.import_module(mod_name), attr)
    except (ImportError, AttributeError) as err:
        raise ConfigError(f"model.engine: cannot import engine {name!r}: {err}") from None
    missing = missing_engine_methods(engine)
    if missing:
        raise ConfigError(f"model.engine: {name!r} does not implement batchjob.contract.Engine (missing: "
                          f"{', '.join(missing)}); subclass batchjob.contract.EngineBase")
    return engine


def input_preparer(model: ModelConfig) -> InputPreparer | None:
    """The engine's decoder-side input preparation for this model (None: decoders ship frames)."""
    return resolve_engine(model.engine).input_preparer(model)

