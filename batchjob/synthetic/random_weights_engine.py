"""`RandomWeightsEngine`: the MLX engine over a random model in a real model's shape (see random_engine.py).

Select it in a job config with `model.engine: batchjob.synthetic.random_engine:RandomWeightsEngine`.
"""
from __future__ import annotations

from batchjob.config import ModelConfig, PromptConfig
from batchjob.pipeline.mlx_engine import MlxEngine, engine_config

from .random_engine import random_classifier


class RandomWeightsEngine(MlxEngine):
    """`MlxEngine` whose `load` builds the random model in the engine actor (decoders prepare inputs alike)."""

    @classmethod
    def load(cls, model: ModelConfig, prompt: PromptConfig) -> "RandomWeightsEngine":
        return cls(random_classifier(model.checkpoint, engine_config(model, prompt)), model)
