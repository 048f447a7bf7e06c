"""Prefill-only VLM classifier on MLX: packed paged attention, video encoded once per clip.

`Classifier.from_pretrained(path, EngineConfig(...)).classify(requests)` answers multiple-choice questions
about decoded clips with one forward pass each; see classifier.py for the loop and DESIGN.md for the shape.
"""

from .classifier import Classifier
from .preprocess import VideoInputs, VisionSettings, load_vision_settings, preprocess_video
from .types import ClassifyRequest, ClassifyResult, Clip, EngineConfig, EngineError

__all__ = ["Classifier", "ClassifyRequest", "ClassifyResult", "Clip", "EngineConfig", "EngineError", "VideoInputs",
           "VisionSettings", "load_vision_settings", "preprocess_video"]
